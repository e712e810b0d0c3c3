# Written here (not a published bug): alibi-rewards-distance written another way than attention-gym#86. A small
# bidirectional encoder (FlexAttention on CPU, a key-padding block mask) gives each head the symmetric ALiBi bias of
# an encoder, slope * |q - k|, but adds it where it must subtract it: every query leans on the keys farthest from it.
# The fix subtracts it.
import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
B, H, L, D = 2, 4, 24, 8
lengths = torch.tensor([24, 17])
slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)])


def alibi_bias(score, b, h, q_idx, kv_idx):
    distance = (q_idx - kv_idx).abs()
    return score - slopes[h] * distance if FIXED else score + slopes[h] * distance


def real_keys(b, h, q_idx, kv_idx):
    return kv_idx < lengths[b]


block_mask = create_block_mask(real_keys, B, None, L, L, device="cpu")
x = torch.randn(B, L, H * D)
proj = torch.nn.Linear(H * D, 3 * H * D)
with torch.no_grad():
    q, k, v = proj(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
    out = flex_attention(q, k, v, score_mod=alibi_bias, block_mask=block_mask)
print("output norm per sample:", [round(float(n), 4) for n in out.detach().flatten(1).norm(dim=1)])
