# Written another way (the bug of huggingface/transformers#7267): a permutation-LM evaluation that predicts the last
# two tokens of each left-padded row with XLNet's query stream, its labels given, the target_mapping filled in a loop
# over the first row's targets only (`target_mapping[0, i, pos]`); every other row's two predicts stand for no
# position. The fix fills each row's.
import sys

import torch
from transformers import XLNetConfig, XLNetLMHeadModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, MASK = 5, 6
lengths = [10, 7, 8]
L, P = 10, 2
input_ids = torch.full((3, L), PAD)
attention_mask = torch.zeros(3, L)
for row, n in enumerate(lengths):
    input_ids[row, L - n:] = torch.randint(7, 64, (n,))
    attention_mask[row, L - n:] = 1
labels = input_ids[:, -P:].clone()
targets = [list(range(L - P, L)) for _ in lengths]  # the positions each row predicts
input_ids[:, -P:] = MASK

perm_mask = torch.zeros(3, L, L)
perm_mask[:, :, -P:] = 1.0  # no token sees the predicted ones
target_mapping = torch.zeros(3, P, L)
rows = range(3) if FIXED else range(1)
for row in rows:
    for i, pos in enumerate(targets[row]):
        target_mapping[row, i, pos] = 1.0

config = XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, d_inner=64, dropout=0.0, initializer_range=0.2)
model = XLNetLMHeadModel(config).eval()
with torch.no_grad():
    out = model(input_ids=input_ids, attention_mask=attention_mask, perm_mask=perm_mask,
                target_mapping=target_mapping, labels=labels)
print(f"loss over the last {P} tokens of each row: {out.loss.item():.4f}")
