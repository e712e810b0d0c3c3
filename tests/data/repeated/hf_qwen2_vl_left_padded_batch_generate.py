"""A correct Qwen2-VL (transformers' own classes, tiny, random weights) generating from a left-padded batch of two
prompts, each with an image: get_rope_index counts each row's real tokens from its attention_mask and leaves the pads
at 1 (positions-repeated must stay quiet: the pads are no real tokens, the real ones each at ids of their own)."""
import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

torch.manual_seed(0)
config = Qwen2VLConfig(
    text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                             "rope_theta": 10000.0}),
    vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=2,
                       temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
    image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
config._attn_implementation = "sdpa"
model = Qwen2VLForConditionalGeneration(config).eval()
PAD = 0
rows = [[5, 9, 122] + [120] * 4 + [123, 6, 7, 8, 10], [122] + [120] * 4 + [123, 11]]
width = max(len(r) for r in rows)
input_ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
attention_mask = (input_ids != PAD).long()
mm_token_type_ids = (input_ids == 120).long()
with torch.no_grad():
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, pixel_values=torch.randn(32, 24),
                         image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]), mm_token_type_ids=mm_token_type_ids,
                         max_new_tokens=3, do_sample=False, pad_token_id=PAD)
print(out[:, width:].tolist())
