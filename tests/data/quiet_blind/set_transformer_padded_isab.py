# Follows juho-lee/set_transformer modules.py (MAB, ISAB, PMA) with a key-padding mask added for padded set batches.
# 16 inducing points (queries) attend to sets of 2..6 elements (keys; pads hidden); the padded rows of X are
# computed then discarded, and PMA's single seed attends to the real elements only. pad mask: True = padding.
import torch, math
torch.manual_seed(3)
torch.set_default_dtype(torch.float64)
D, NH, NI = 32, 4, 16

class MAB(torch.nn.Module):
    def __init__(s, dq, dk, dv):
        super().__init__()
        s.fc_q, s.fc_k, s.fc_v, s.fc_o = (torch.nn.Linear(dq, dv), torch.nn.Linear(dk, dv),
                                          torch.nn.Linear(dk, dv), torch.nn.Linear(dv, dv))
    def forward(s, Q, K, key_pad=None):
        Q, Kp, V = s.fc_q(Q), s.fc_k(K), s.fc_v(K)
        ds = D // NH
        Q_, K_, V_ = (torch.cat(t.split(ds, 2), 0) for t in (Q, Kp, V))
        A = Q_.bmm(K_.transpose(1, 2)) / math.sqrt(D)
        if key_pad is not None:
            A = A.masked_fill(key_pad.repeat(NH, 1)[:, None, :], float("-inf"))
        A = torch.softmax(A, 2)
        O = torch.cat((Q_ + A.bmm(V_)).split(Q.size(0), 0), 2)
        return O + torch.relu(s.fc_o(O))

class ISAB(torch.nn.Module):
    def __init__(s, di, do):
        super().__init__()
        s.I = torch.nn.Parameter(torch.randn(1, NI, do))
        s.mab0, s.mab1 = MAB(do, di, do), MAB(di, do, do)
    def forward(s, X, key_pad=None):
        H = s.mab0(s.I.repeat(X.size(0), 1, 1), X, key_pad)   # inducing points -> real elements only
        return s.mab1(X, H)                                   # every row (pads too) reads H; pad rows discarded

class PMA(torch.nn.Module):
    def __init__(s, d):
        super().__init__()
        s.S = torch.nn.Parameter(torch.randn(1, 1, d))
        s.mab = MAB(d, d, d)
    def forward(s, X, key_pad=None):
        return s.mab(s.S.repeat(X.size(0), 1, 1), X, key_pad)

enc1, enc2, pool = ISAB(3, D), ISAB(D, D), PMA(D)
def model(X, pad=None):
    return pool(enc2(enc1(X, pad), pad), pad)

lens = [6, 2, 4]
sets = [torch.randn(n, 3) for n in lens]
X = torch.zeros(len(lens), max(lens), 3)
pad = torch.ones(len(lens), max(lens), dtype=torch.bool)
for b, s_ in enumerate(sets):
    X[b, :len(s_)] = s_; pad[b, :len(s_)] = False
X[pad] = 1e3 * torch.randn(int(pad.sum()), 3)   # garbage in the pads must not leak
with torch.no_grad():
    out = model(X, pad)
    d = max((out[b] - model(s_[None])[0]).abs().max().item() for b, s_ in enumerate(sets))
    perm = torch.randperm(lens[0])  # permutation invariance of the pooled output, as a sanity check
    dp = (model(sets[0][perm][None]) - model(sets[0][None])).abs().max().item()
print("max diff padded batch vs each set alone:", d)
print("max diff under permutation:", dp)
assert d < 1e-12 and dp < 1e-12
