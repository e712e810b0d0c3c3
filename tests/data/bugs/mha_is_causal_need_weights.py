"""pytorch/pytorch#99282: nn.MultiheadAttention's is_causal=True is only a hint about attn_mask; with need_weights=True
(the default) MHA applies attn_mask itself and the hint is ignored, so a model that passed is_causal=True beside a
key padding attn_mask attended to later tokens. The fix passes the causal mask merged with the padding."""

import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
mha = nn.MultiheadAttention(embed_dim=8, num_heads=2, batch_first=True).eval()
x = torch.randn(2, 5, 8)
lengths = torch.tensor([5, 3])
padding = torch.arange(5)[None, :] >= lengths[:, None]  # True = a padding key (MHA's polarity)
mask = padding[:, None, :].expand(2, 5, 5).repeat_interleave(2, dim=0)  # (batch * heads, L, S)
if FIXED:
    mask = mask | nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.bool)
with torch.no_grad():
    out, weights = mha(x, x, x, attn_mask=mask, is_causal=True)
