# DINO models/dino/dn_components.py prepare_for_cdn: attn_mask (True = cannot attend) of size pad_size+num_queries;
# matching queries can't see dn part, each dn group sees only itself. Checked by running every group separately.
import torch, torch.nn as nn
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, num_queries, single_pad, dn_number = 32, 5, 3, 3
pad_size = single_pad * dn_number
tgt_size = pad_size + num_queries
attn_mask = torch.ones(tgt_size, tgt_size) < 0
attn_mask[pad_size:, :pad_size] = True
for i in range(dn_number):
    if i == 0:
        attn_mask[single_pad * i:single_pad * (i + 1), single_pad * (i + 1):pad_size] = True
    if i == dn_number - 1:
        attn_mask[single_pad * i:single_pad * (i + 1), :single_pad * i] = True
    else:
        attn_mask[single_pad * i:single_pad * (i + 1), single_pad * (i + 1):pad_size] = True
        attn_mask[single_pad * i:single_pad * (i + 1), :single_pad * i] = True
sa = nn.MultiheadAttention(D, 4, dropout=0.0).eval()
tgt = torch.randn(tgt_size, 2, D)
out, _ = sa(tgt, tgt, tgt, attn_mask=attn_mask)
d = 0.0
for g in range(dn_number):   # dn group alone (it also may see matching queries per DINO: mask leaves [dn, match] open)
    idx = torch.cat([torch.arange(g * single_pad, (g + 1) * single_pad), torch.arange(pad_size, tgt_size)])
    t = tgt[idx]; m = torch.zeros(len(idx), len(idx), dtype=torch.bool); m[single_pad:, :single_pad] = True
    ref, _ = sa(t, t, t, attn_mask=m)
    d = max(d, (out[idx[:single_pad]] - ref[:single_pad]).abs().max().item())
m_only = tgt[pad_size:]; ref, _ = sa(m_only, m_only, m_only)           # matching part alone, no dn at all
d = max(d, (out[pad_size:] - ref).abs().max().item())
print("max diff grouped vs separate:", d); assert d < 1e-10
