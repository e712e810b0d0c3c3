# Follows IDEA-Research/DINO models/dino/dn_components.py prepare_for_cdn (attn_mask, True = blocked): matching queries
# may not see any denoising query; each denoising group (positive+negative halves) sees itself and the matching
# queries, never another group. Used as tgt_mask of the decoder self-attention (deformable_transformer.py).
import torch
from torch import nn

torch.manual_seed(0)
D, H = 32, 4
num_queries, dn_number, num_gt = 6, 3, 2
single_pad = num_gt
pad_size = single_pad * 2 * dn_number
tgt_size = pad_size + num_queries

attn_mask = torch.ones(tgt_size, tgt_size) < 0
attn_mask[pad_size:, :pad_size] = True
for i in range(dn_number):
    if i == 0:
        attn_mask[single_pad * 2 * i:single_pad * 2 * (i + 1), single_pad * 2 * (i + 1):pad_size] = True
    if i == dn_number - 1:
        attn_mask[single_pad * 2 * i:single_pad * 2 * (i + 1), :single_pad * i * 2] = True
    else:
        attn_mask[single_pad * 2 * i:single_pad * 2 * (i + 1), single_pad * 2 * (i + 1):pad_size] = True
        attn_mask[single_pad * 2 * i:single_pad * 2 * (i + 1), :single_pad * 2 * i] = True

self_attn = nn.MultiheadAttention(D, H).double()
B = 2
tgt = torch.randn(tgt_size, B, D, dtype=torch.float64)  # [dn groups ..., matching queries]
qpos = torch.randn(tgt_size, B, D, dtype=torch.float64)
with torch.no_grad():
    q = k = tgt + qpos
    out = self_attn(q, k, tgt, attn_mask=attn_mask)[0]

    match = slice(pad_size, tgt_size)
    ref_match = self_attn((tgt + qpos)[match], (tgt + qpos)[match], tgt[match])[0]
    diff = (out[match] - ref_match).abs().max().item()
    for g in range(dn_number):
        grp = list(range(single_pad * 2 * g, single_pad * 2 * (g + 1)))
        idx = torch.tensor(grp + list(range(pad_size, tgt_size)))
        r = self_attn((tgt + qpos)[idx], (tgt + qpos)[idx], tgt[idx])[0]
        diff = max(diff, (out[grp] - r[:len(grp)]).abs().max().item())
print("max |masked decoder self-attn - matching alone / each dn group with matching| =", diff)
assert diff < 1e-12
