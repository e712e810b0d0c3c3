"""Set Transformer (SAB encoder + PMA pooling) over a batch of point sets padded to one size.

Follows juho-lee/set_transformer modules.py (MAB, SAB, PMA: PMA = MAB(S.repeat(batch), X) with
learned seed vectors) and models.py (SetTransformer: enc = SAB, SAB; dec = PMA, SAB, Linear), with
the attention done by torch.nn.MultiheadAttention and the padded points given as key_padding_mask
(True = padding), as padded-set ports do (e.g. lucidrains/isab-pytorch, the PyTorch
set-transformer ports with masks). Padded point rows are garbage but never seen as keys, and the
pooled outputs ignore them. Reference: each set alone, unpadded, no mask; also checks the output is
invariant to permuting the real points.
"""
import torch
import torch.nn as nn

torch.manual_seed(0)
D, H, SEEDS, DIN = 32, 4, 2, 3


class MAB(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(D, H, batch_first=True)
        self.ln0, self.ln1 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.ff = nn.Sequential(nn.Linear(D, D), nn.ReLU())

    def forward(self, Q, K, key_padding_mask=None):
        h = Q + self.mha(Q, K, K, key_padding_mask=key_padding_mask, need_weights=False)[0]
        h = self.ln0(h)
        return self.ln1(h + self.ff(h))


class SetTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIN, D)
        self.sab1, self.sab2 = MAB(), MAB()
        self.S = nn.Parameter(torch.randn(1, SEEDS, D))
        self.pma, self.sab3 = MAB(), MAB()
        self.out = nn.Linear(D, 4)

    def forward(self, X, key_padding_mask=None):
        h = self.inp(X)
        h = self.sab1(h, h, key_padding_mask)
        h = self.sab2(h, h, key_padding_mask)
        p = self.pma(self.S.repeat(X.shape[0], 1, 1), h, key_padding_mask)
        p = self.sab3(p, p)  # the seeds are all real: no mask
        return self.out(p)


model = SetTransformer().double().eval()
sizes = [7, 3, 5, 1]
sets = [torch.randn(n, DIN, dtype=torch.float64) for n in sizes]
N = max(sizes)
X = torch.full((len(sets), N, DIN), 1e3, dtype=torch.float64)  # padding filled with junk on purpose
pad = torch.ones(len(sets), N, dtype=torch.bool)
for i, s in enumerate(sets):
    X[i, :len(s)] = s
    pad[i, :len(s)] = False

with torch.no_grad():
    out = model(X, key_padding_mask=pad)
    ref = torch.stack([model(s[None])[0] for s in sets])
    d = (out - ref).abs().max().item()
    perm = torch.stack([model(s[torch.randperm(len(s))][None])[0] for s in sets])
    dp = (perm - ref).abs().max().item()
print("max |padded batch with key_padding_mask - per-set unpadded| =", d, " permutation diff =", dp)
assert d < 1e-10 and dp < 1e-10
