"""Uni-Mol: molecule encoder with a Gaussian-kernel pair-distance bias added to attention, padded atoms.

Follows dptech-corp/Uni-Mol, unimol/models/unimol.py (UniMolModel.forward: padding_mask = src_tokens.eq(pad);
graph_attn_bias from GaussianLayer + NonLinearHead over pairwise distances, reshaped to (B*H, N, N)) and
unicore/modules/transformer_encoder_with_pair.py / softmax_dropout (the pair bias is filled with -inf on padded
keys: attn_mask.masked_fill(padding_mask.unsqueeze(1).unsqueeze(2), float('-inf')), then softmax).
Commit: not pinned. Plain torch, hand-written softmax with a float bias.
"""
import math
import torch

torch.manual_seed(0)
D, H, K = 32, 4, 8  # hidden, heads, gaussian kernels
PAD = 0


class GaussianLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.means = torch.nn.Parameter(torch.linspace(0, 4, K))
        self.stds = torch.nn.Parameter(torch.ones(K))

    def forward(self, dist):
        x = dist.unsqueeze(-1)
        return torch.exp(-0.5 * ((x - self.means) / self.stds) ** 2) / (math.sqrt(2 * math.pi) * self.stds)


class UniMolLite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, D, padding_idx=PAD)
        self.gbf = GaussianLayer()
        self.proj = torch.nn.Sequential(torch.nn.Linear(K, K), torch.nn.GELU(), torch.nn.Linear(K, H))
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.out = torch.nn.Linear(D, D)

    def forward(self, tokens, coords):
        B, N = tokens.shape
        padding_mask = tokens.eq(PAD)  # True on padded atoms
        dist = torch.cdist(coords, coords)
        bias = self.proj(self.gbf(dist)).permute(0, 3, 1, 2)  # (B,H,N,N)
        # padded keys get -inf; real query rows always have at least one real key
        bias = bias.masked_fill(padding_mask[:, None, None, :], float("-inf"))
        x = self.embed(tokens)
        q, k, v = self.qkv(x).view(B, N, 3, H, D // H).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D // H) + bias
        p = torch.softmax(scores, dim=-1)
        y = self.out((p @ v).transpose(1, 2).reshape(B, N, D))
        # padded rows are all -inf -> nan; zero them as the model does before pooling
        y = y.masked_fill(padding_mask.unsqueeze(-1), 0.0)
        n_real = (~padding_mask).sum(1, keepdim=True)
        return y, y.sum(1) / n_real


model = UniMolLite().eval().double()

mols = [[1, 2, 3, 4, 5], [6, 7], [3, 3, 8, 9]]
coords = [torch.randn(len(m), 3, dtype=torch.float64) for m in mols]

N = max(len(m) for m in mols)
tokens = torch.full((len(mols), N), PAD)
xyz = torch.zeros(len(mols), N, 3, dtype=torch.float64)
for i, (m, c) in enumerate(zip(mols, coords)):
    tokens[i, : len(m)] = torch.tensor(m)
    xyz[i, : len(m)] = c

with torch.no_grad():
    atoms, mol = model(tokens, xyz)
    # nan only arises in padded query rows and those were zeroed
    assert torch.isfinite(atoms).all()
    worst = 0.0
    for i, (m, c) in enumerate(zip(mols, coords)):
        a1, m1 = model(torch.tensor([m]), c[None])
        worst = max(worst, (atoms[i, : len(m)] - a1[0]).abs().max().item(), (mol[i] - m1[0]).abs().max().item())
print("max |padded batch - one molecule at a time| =", worst)
assert worst < 1e-10, worst
