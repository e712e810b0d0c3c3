"""A correct Qwen2-VL (transformers' own classes, tiny, random weights): one image and one two-frame video in one
forward. Its vision tower attends each image and each temporal patch of the video alone (cu_seqlens from
repeat_interleave(h * w, t)), its language model causal over text and image tokens: nothing is joined."""
import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

torch.manual_seed(0)
config = Qwen2VLConfig(
    text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                             "rope_theta": 10000.0}),
    vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=2,
                       temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
    image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
config._attn_implementation = "sdpa"
model = Qwen2VLForConditionalGeneration(config).eval()
image_grid_thw = torch.tensor([[1, 4, 4]])  # 16 patches -> 4 image tokens
video_grid_thw = torch.tensor([[2, 4, 4]])  # 2 temporal patches of 16 -> 8 video tokens
ids = [5, 122] + [120] * 4 + [123, 6, 122] + [121] * 8 + [123, 7, 8]
input_ids = torch.tensor([ids])
mm_token_type_ids = (input_ids == 120).long() + 2 * (input_ids == 121).long()  # (the processor's: 1 image, 2 video)
pixel_values = torch.randn(16, 3 * 2 * 2 * 2)
pixel_values_videos = torch.randn(32, 3 * 2 * 2 * 2)
with torch.no_grad():
    out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixel_values,
                image_grid_thw=image_grid_thw, pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
                mm_token_type_ids=mm_token_type_ids)
print(tuple(out.logits.shape))
