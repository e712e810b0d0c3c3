"""transformers#39389: under generate, the mask that reached Gemma 3's attention at prefill was purely causal, an
image's tokens not seeing each other. With a compileable cache (Gemma 3's default hybrid cache then, a static one
here) generate builds the 4-D masks itself, by create_masks_for_generate; the generic one takes no token_type_ids,
and Gemma3Model, handed a dict of masks, builds none. The fix gives Gemma3ForConditionalGeneration its own
create_masks_for_generate that ors the image blocks on (models/gemma3/modeling_gemma3.py:1031-1055 today).
Written here as today's Gemma 3 (a tiny model from its config, random weights, one 4-token image) whose
create_masks_for_generate is the generic one again."""

import sys

import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, masking_utils

FIXED = "--fixed" in sys.argv


class Gemma3WithoutItsMasks(Gemma3ForConditionalGeneration):
    create_masks_for_generate = staticmethod(masking_utils.create_masks_for_generate)  # token_type_ids left in **kwargs


IMAGE, BOI, EOI, PAD = 60, 61, 62, 0
text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4)
config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE,
                      boi_token_index=BOI, eoi_token_index=EOI, pad_token_id=PAD)
torch.manual_seed(0)
model = (Gemma3ForConditionalGeneration if FIXED else Gemma3WithoutItsMasks)(config).eval()
input_ids = torch.tensor([[5, 6, BOI, IMAGE, IMAGE, IMAGE, IMAGE, EOI, 7]])
with torch.no_grad():
    model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=torch.randn(1, 3, 8, 8),
                   token_type_ids=(input_ids == IMAGE).long(), max_new_tokens=2, do_sample=False, pad_token_id=PAD,
                   cache_implementation="static")
