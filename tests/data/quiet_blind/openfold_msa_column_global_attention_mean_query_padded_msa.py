# Follows OpenFold: openfold/model/msa.py MSAColumnGlobalAttention + GlobalAttention (one masked-mean query per column,
# bias = inf * (mask - 1) with finite inf=1e9, gated per-sequence output). Padded MSA rows are never keys; fully padded
# residue columns give a uniform (finite) softmax whose rows are discarded.
import torch
torch.manual_seed(7)
dt = torch.float64
c_in, c_hidden, H = 16, 8, 4
inf, eps = 1e9, 1e-10
lq = torch.nn.Linear(c_in, c_hidden * H, bias=False, dtype=dt)
lk = torch.nn.Linear(c_in, c_hidden, bias=False, dtype=dt)
lv = torch.nn.Linear(c_in, c_hidden, bias=False, dtype=dt)
lg = torch.nn.Linear(c_in, c_hidden * H, dtype=dt)
lo = torch.nn.Linear(c_hidden * H, c_in, dtype=dt)

def global_attention(m, mask):          # m [*, N_res, N_seq, C], mask [*, N_res, N_seq]
    q = torch.sum(m * mask.unsqueeze(-1), dim=-2) / (torch.sum(mask, dim=-1)[..., None] + eps)
    q = lq(q) * c_hidden ** (-0.5)
    q = q.view(q.shape[:-1] + (H, -1))  # [*, N_res, H, C]
    k, v = lk(m), lv(m)                 # [*, N_res, N_seq, C]
    bias = (inf * (mask - 1))[..., :, None, :]
    a = torch.matmul(q, k.transpose(-1, -2)) + bias
    a = torch.softmax(a, -1)
    o = torch.matmul(a, v)              # [*, N_res, H, C]
    g = torch.sigmoid(lg(m)).view(m.shape[:-1] + (H, -1))
    o = (o.unsqueeze(-3) * g).reshape(m.shape[:-1] + (-1,))
    return lo(o)

def msa_column_global_attention(m, mask):   # m [*, N_seq, N_res, C], mask [*, N_seq, N_res]
    m = m.transpose(-2, -3); mask = mask.transpose(-1, -2)
    m = global_attention(m, mask)
    return m.transpose(-2, -3)

sizes = [(5, 12), (3, 7)]   # (N_seq, N_res) per protein
S, R = 6, 12                # padded MSA depth / length
m = torch.zeros(len(sizes), S, R, c_in, dtype=dt)
mask = torch.zeros(len(sizes), S, R, dtype=dt)
raw = []
for i, (s, r) in enumerate(sizes):
    x = torch.randn(s, r, c_in, dtype=dt)
    raw.append(x); m[i, :s, :r] = x; mask[i, :s, :r] = 1
out = msa_column_global_attention(m, mask)
assert torch.isfinite(out).all()

diff = 0.0
for i, (s, r) in enumerate(sizes):
    ref = msa_column_global_attention(raw[i], torch.ones(s, r, dtype=dt))
    diff = max(diff, (out[i, :s, :r] - ref).abs().max().item())
print("max diff", diff)
assert diff < 1e-12
