"""A vision-language fine-tuning wrapper that splices the image features in itself and calls the text model directly.

The wrapper (a trainer's own module around a Qwen2.5-VL built from its config classes) embeds the ids, puts the vision
tower's pooled features at the image tokens, and hands the embeddings to `model.language_model`, skipping the outer
model's forward, which is where the (t, h, w) rope index is made. Handed no position_ids, the text model numbers the
tokens by their cache positions and copies those into t, h and w alike: each image is rotated as a run of text.
`--fixed` hands the text model `get_rope_index`'s (3, B, L) positions. Tiny config, random weights, CPU.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, IMAGE, START, END = 0, 5, 3, 4
config = Qwen2_5_VLConfig(
    text_config=dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256,
                     rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]},
                     pad_token_id=PAD, bos_token_id=1, eos_token_id=2),
    vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, in_channels=3,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                       fullatt_block_indexes=[0]),
    image_token_id=IMAGE, video_token_id=6, vision_start_token_id=START, vision_end_token_id=END,
)
config._attn_implementation = "sdpa"


class VisionLanguageTrainer(nn.Module):
    """Embeds, splices the image features at the image tokens, runs the text model and the LM head."""

    def __init__(self, vlm):
        super().__init__()
        self.vlm, self.config = vlm, vlm.config

    def forward(self, input_ids, attention_mask, pixel_values, image_grid_thw, labels):
        inner = self.vlm.model
        embeds = inner.get_input_embeddings()(input_ids)
        features = torch.cat(inner.get_image_features(pixel_values, image_grid_thw).pooler_output)
        embeds = embeds.masked_scatter((input_ids == IMAGE)[..., None].expand_as(embeds), features.to(embeds.dtype))
        position_ids = None
        if FIXED:
            position_ids, _ = inner.get_rope_index(input_ids, (input_ids == IMAGE).int(), image_grid_thw,
                                                   attention_mask=attention_mask)
        hidden = inner.language_model(inputs_embeds=embeds, attention_mask=attention_mask,
                                      position_ids=position_ids).last_hidden_state
        logits = self.vlm.lm_head(hidden)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def sample(text_before, grid, text_after):
    t, h, w = grid
    ids = [*text_before, START, *[IMAGE] * (t * h * w // 4), END, *text_after]  # (merge 2 x 2)
    return ids, torch.randn(t * h * w, 3 * 2 * 14 * 14)


trainer = VisionLanguageTrainer(Qwen2_5_VLForConditionalGeneration(config))
samples = [sample([10, 11], (1, 4, 6), [12, 13, 14]), sample([15], (1, 4, 4), [16, 17, 18, 19, 20, 21])]
length = max(len(ids) for ids, _ in samples)
input_ids = torch.tensor([ids + [PAD] * (length - len(ids)) for ids, _ in samples])
attention_mask = (input_ids != PAD).long()
labels = input_ids.masked_fill((attention_mask == 0) | (input_ids == IMAGE), -100)
optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
loss = trainer(input_ids, attention_mask, torch.cat([pixels for _, pixels in samples]),
               torch.tensor([[1, 4, 6], [1, 4, 4]]), labels)
loss.backward()
optimizer.step()
print(f"loss {loss.item():.6f}")
