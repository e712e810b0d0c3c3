"""A program's text config for a decoder (`BertConfig(is_decoder=True)`, as Pix2Struct's recipes build
`Pix2StructTextConfig(is_decoder=True)` at the top of the script) held by no module, beside an encoder built from a
config of its own (no `is_decoder`) and run bidirectionally over a padded batch. The text config speaks for the
decoder it describes, not for the encoder: each sequence's encoder states match the sequence run alone, unpadded.
"""
import torch
from transformers import BertConfig, BertModel

torch.manual_seed(0)
text = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  is_decoder=True)  # (the decoder's: built later by the recipe, not here)
vision = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
vision._attn_implementation = "sdpa"
encoder = BertModel(vision, add_pooling_layer=False).eval()

rows = [[5, 9, 3, 7, 1], [12, 4, 8], [3, 17, 21, 9]]
ids = torch.zeros(3, 5, dtype=torch.long)
mask = torch.zeros(3, 5, dtype=torch.long)
for i, row in enumerate(rows):
    ids[i, :len(row)] = torch.tensor(row)
    mask[i, :len(row)] = 1
with torch.no_grad():
    batch = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    alone = [encoder(input_ids=torch.tensor([row])).last_hidden_state[0] for row in rows]
ok = all(torch.allclose(batch[i, :len(row)], alone[i], atol=1e-5) for i, row in enumerate(rows))
print("encoder states match each row alone:", ok)
assert ok
