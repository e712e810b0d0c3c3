"""transformers#30918 (fixed by #30967): PaliGemma handed its language model a 4-D mask of all ones over the real
tokens, the outer product of the 2-D attention_mask, which pre-empted Gemma's causal mask: fine-tuning leaked the
labels, each suffix token seeing the suffix tokens after it. PaliGemma is a prefix-LM: the image and the prompt
(token_type_ids 0) see each other both ways, the suffix (token_type_ids 1) is causal. Written here as a fine-tuning
forward of today's PaliGemma (a tiny model from its config, random weights, one left-padded row) whose mask is built
as transformers 4.41's _merge_input_ids_with_image_features built it; the fix is today's prefix-LM mask."""

import sys

import torch
from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration
from transformers.models.paligemma import modeling_paligemma

FIXED = "--fixed" in sys.argv


def outer_product_mask(config, inputs_embeds, attention_mask, **kwargs):
    # transformers 4.41: attention_mask.unsqueeze(1).unsqueeze(2) * attention_mask.unsqueeze(1).unsqueeze(-1)
    return (attention_mask.unsqueeze(1).unsqueeze(2) * attention_mask.unsqueeze(1).unsqueeze(-1)).bool()


prefix_lm = modeling_paligemma.create_causal_mask
if not FIXED:
    modeling_paligemma.create_causal_mask = outer_product_mask

IMAGE, BOS, PAD = 60, 2, 0
text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8)
vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8,
              patch_size=4, projection_dim=16)
config = PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE, projection_dim=16,
                         pad_token_id=PAD)
torch.manual_seed(0)
model = PaliGemmaForConditionalGeneration(config).eval()
prefix = [IMAGE] * 4 + [BOS, 5, 6]  # the image, then "caption en"
suffix = [7, 8, 9, 1]  # the caption the model learns, then eos
input_ids = torch.tensor([[*prefix, *suffix], [PAD, PAD, *prefix, *suffix[:2]]])
attention_mask = (input_ids != PAD).long()
token_type_ids = torch.tensor([[0] * 7 + [1] * 4, [0] * 9 + [1] * 2])  # as PaliGemmaProcessor returns them with a suffix
labels = torch.where(token_type_ids == 1, input_ids, -100)
try:
    model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels,
          pixel_values=torch.randn(2, 3, 8, 8), use_cache=False).loss.backward()
finally:
    modeling_paligemma.create_causal_mask = prefix_lm  # (a test runs the fix next in the same process)
