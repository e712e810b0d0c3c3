# Follows octo-models/octo octo/model/components/block_transformer.py generate_attention_mask (task prefix sees
# itself; obs at t see prefix + obs <= t; readouts at t see prefix + obs <= t + own readout; nobody sees readouts)
# and generate_pad_attention_mask (timestep_pad_mask, left-padded history). True = attend, flipped for torch MHA.
import torch
torch.manual_seed(8); torch.set_default_dtype(torch.float64)
D, H, P, NO, NR, T = 32, 4, 3, 2, 1, 4
mha = torch.nn.MultiheadAttention(D, H, batch_first=True)

def layout(Tn, with_readouts=True):
    kind, ts = ["task"] * P, [-1] * P
    for t in range(Tn):
        kind += ["obs"] * NO + (["readout"] * NR if with_readouts else []); ts += [t] * (NO + (NR if with_readouts else 0))
    return kind, torch.tensor(ts)

def attention_mask(kind, ts):
    n = len(kind); m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            if kind[j] == "task": m[i, j] = True
            elif kind[i] == "task": m[i, j] = False
            elif kind[j] == "obs": m[i, j] = bool(ts[j] <= ts[i])
            else: m[i, j] = kind[i] == "readout" and bool(ts[j] == ts[i])
    return m

def run(x, kind, ts, timestep_pad):                     # timestep_pad: (B, Tn) True = real timestep
    m = attention_mask(kind, ts)[None]
    key_ok = torch.ones(x.shape[0], len(kind), dtype=torch.bool)
    key_ok[:, P:] = timestep_pad[:, ts[P:]]
    m = m & key_ok[:, None, :]
    return mha(x, x, x, attn_mask=(~m).repeat_interleave(H, 0), need_weights=False)[0]   # True = blocked

kind, ts = layout(T)
x = torch.randn(2, len(kind), D)
pad = torch.tensor([[True] * T, [False, False, True, True]])   # row 1: history shorter, left-padded
with torch.no_grad():
    out = run(x, kind, ts, pad)
    # (a) removing readout tokens changes nothing for task/obs tokens
    k2, t2 = layout(T, with_readouts=False)
    keep = torch.tensor([kk != "readout" for kk in kind])
    d_a = (run(x[:, keep], k2, t2, pad) - out[:, keep]).abs().max().item()
    # (b) padded row equals its real 2-timestep window alone
    k3, t3 = layout(2)
    sel = torch.tensor([tt == -1 or tt >= 2 for tt in ts.tolist()])
    alone = run(x[1:2, sel], k3, t3, torch.ones(1, 2, dtype=torch.bool))
    d_b = (alone[0] - out[1, sel]).abs().max().item()
print("max diff without readouts:", d_a, " padded window vs short window alone:", d_b)
assert d_a < 1e-12 and d_b < 1e-12
