# A script that keeps its batch's lengths at its top level and builds nn.TransformerEncoder's src_key_padding_mask
# True on the real tokens (`arange < lengths`), where MHA reads True = padding; --fixed builds it True on the padding.
# Training mode (MHA's slow path: the whole row's empty rows come back 0, not NaN).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 2)
encoder.train()
lengths = [6, 4, 5]
x = torch.randn(len(lengths), max(lengths), 16)
real = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
out = encoder(x, src_key_padding_mask=~real if FIXED else real)
alone = encoder(x[1:2, :4], src_key_padding_mask=torch.zeros(1, 4, dtype=torch.bool))
print("row 1 against itself alone:", float((out[1, :4] - alone[0]).abs().max().detach()))
