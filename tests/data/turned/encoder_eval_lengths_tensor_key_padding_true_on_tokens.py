# A script that keeps its batch's lengths as a tensor at its top level and views them per batch row
# (`lengths[:, None]`) to build nn.TransformerEncoder's src_key_padding_mask True on the real tokens, where MHA reads
# True = padding; --fixed builds it True on the padding. Eval mode without grad (MHA's fast path: NaN rows).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
encoder = nn.TransformerEncoder(layer, num_layers=2).eval()
x = torch.randn(2, 6, 16)
lengths = torch.tensor([6, 4])
pad = torch.arange(6)[None, :] < lengths[:, None]
with torch.no_grad():
    y = encoder(x, src_key_padding_mask=~pad if FIXED else pad)
    alone = encoder(x[1:2, :4])
print("row 1 against itself alone:", float((y[1, :4] - alone[0]).abs().max()))
