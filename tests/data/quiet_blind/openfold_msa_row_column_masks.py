# Follows aqlaboratory/openfold openfold/model/msa.py (MSAAttention._prep_inputs, MSARowAttentionWithPairBias,
# MSAColumnAttention): mask_bias = inf * (msa_mask - 1) broadcast as [*, S, 1, 1, N_res] plus a pair bias; the
# column module transposes S and N_res and reuses the same code.  Padded MSA rows / residues are 0 in msa_mask.
import torch

torch.manual_seed(0)
dt = torch.float64
S, N, C, Hh, c = 6, 9, 16, 2, 8
INF = 1e9
n_seq, n_res = 4, 7                                    # real MSA depth / residues, rest is padding
m = torch.randn(S, N, C, dtype=dt)
z = torch.randn(N, N, 8, dtype=dt)
msa_mask = torch.zeros(S, N, dtype=dt)
msa_mask[:n_seq, :n_res] = 1.0
msa_mask[2, 5] = 0.0                                   # a gap inside a real row (OpenFold masks these too)
Wq, Wk, Wv = (torch.randn(C, Hh * c, dtype=dt) / 4 for _ in range(3))
Wz = torch.randn(8, Hh, dtype=dt) / 3


def attention(x, mask, bias=None):
    # x [S, N, C], mask [S, N]: attention along N for every row s (OpenFold Attention with biases list)
    q = (x @ Wq).view(*x.shape[:2], Hh, c).transpose(-2, -3) / c ** 0.5   # [S, H, N, c]
    k = (x @ Wk).view(*x.shape[:2], Hh, c).transpose(-2, -3)
    v = (x @ Wv).view(*x.shape[:2], Hh, c).transpose(-2, -3)
    mask_bias = (INF * (mask - 1))[..., :, None, None, :]                 # [S, 1, 1, N]
    a = q @ k.transpose(-1, -2) + mask_bias
    if bias is not None:
        a = a + bias
    a = torch.softmax(a, -1)
    return (a @ v).transpose(-2, -3).reshape(*x.shape[:2], Hh * c)


pair_bias = (z @ Wz).permute(2, 0, 1)[None]           # [1, H, N, N]
row = attention(m, msa_mask, pair_bias)
col = attention(m.transpose(0, 1), msa_mask.transpose(0, 1)).transpose(0, 1)


def ref_row(s, i):
    keys = [j for j in range(N) if msa_mask[s, j] == 1]
    x = m[s, keys]
    q = (m[s, i] @ Wq).view(Hh, c) / c ** 0.5
    k = (x @ Wk).view(len(keys), Hh, c)
    v = (x @ Wv).view(len(keys), Hh, c)
    outs = []
    for h in range(Hh):
        lg = k[:, h] @ q[h] + pair_bias[0, h, i, keys]
        outs.append(lg.softmax(-1) @ v[:, h])
    return torch.cat(outs)


def ref_col(s, i):
    keys = [t for t in range(S) if msa_mask[t, i] == 1]
    x = m[keys, i]
    q = (m[s, i] @ Wq).view(Hh, c) / c ** 0.5
    k = (x @ Wk).view(len(keys), Hh, c)
    v = (x @ Wv).view(len(keys), Hh, c)
    return torch.cat([(k[:, h] @ q[h]).softmax(-1) @ v[:, h] for h in range(Hh)])


diff = 0.0
for s in range(n_seq):
    for i in range(n_res):                              # only real queries are read downstream
        diff = max(diff, (row[s, i] - ref_row(s, i)).abs().max().item())
        if any(msa_mask[t, i] == 1 for t in range(S)):
            diff = max(diff, (col[s, i] - ref_col(s, i)).abs().max().item())
assert torch.isfinite(row).all() and torch.isfinite(col).all()   # fully padded rows/cols stay finite
print("max |masked row/col attention - per-query loop over real keys| =", diff)
assert diff < 1e-12
