"""transformers#38053, fixed by #38080: Gemma 3's bidirectional image mask unmasked attention between every image
token and every other, so with two images the first one saw the second (a later image). transformers 4.51's
Gemma3ForConditionalGeneration._update_causal_mask built it as

    token_type_mask = token_type_ids.unsqueeze(1) == token_type_ids.unsqueeze(2)
    token_type_mask[token_type_ids == 0] = False  # if text token do not change anything

that is, every image token in one block; the fix numbers the images (a new block where an image starts), as
get_block_sequence_ids_for_mask still does. Written here as that block numbering in today's Gemma 3 (a tiny model
from its config, random weights, two 4-token images, one left-padded row), prefill and two generate steps."""

import sys

import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration
from transformers.models.gemma3 import modeling_gemma3

FIXED = "--fixed" in sys.argv


def one_block_for_every_image(token_type_ids, device=None):
    # transformers 4.51: token_type_mask = token_type_ids.unsqueeze(1) == token_type_ids.unsqueeze(2), text rows off
    return torch.where(token_type_ids == 1, 0, -1).to(device)


numbered = modeling_gemma3.get_block_sequence_ids_for_mask
if not FIXED:
    modeling_gemma3.get_block_sequence_ids_for_mask = one_block_for_every_image

IMAGE, BOI, EOI, PAD = 60, 61, 62, 0
text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4)
config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE,
                      boi_token_index=BOI, eoi_token_index=EOI, pad_token_id=PAD)
torch.manual_seed(0)
model = Gemma3ForConditionalGeneration(config).eval()
image = [BOI, IMAGE, IMAGE, IMAGE, IMAGE, EOI]
input_ids = torch.tensor([[PAD, PAD, 5, *image, 6, *image, 7], [8, 9, 5, *image, 6, *image, 7]])
attention_mask = (input_ids != PAD).long()
token_type_ids = (input_ids == IMAGE).long()  # as Gemma3Processor returns them
pixel_values = torch.randn(4, 3, 8, 8)
try:
    with torch.no_grad():
        model.generate(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                       pixel_values=pixel_values, max_new_tokens=2, do_sample=False, pad_token_id=PAD)
finally:
    modeling_gemma3.get_block_sequence_ids_for_mask = numbered  # (a test runs the fix next in the same process)
