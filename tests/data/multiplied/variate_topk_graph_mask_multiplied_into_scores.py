# Written another way (checks/multiplied.py): TimeFilter#13's filtered graph (a KNN keep-mask multiplied into the
# edge scores before their softmax), as an iTransformer-style encoder writes a sparse graph over variate tokens: each
# variate keeps the top-k variates it scores highest (`topk(..., largest=True)` scattered to a 1/0 float mask), over a
# batch of series with 6 and 4 variables, the second padded to 6 (its padded variates filled with -inf before the
# ranking). The bug multiplies the 1/0 top-k mask into the scores (`torch.einsum` scores, `F.softmax`), so every real
# variate outside the top-k sits at logit 0 and still takes exp(0) of the weight; the fix fills them with -inf.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SparseVariateAttention(nn.Module):
    def __init__(self, d_model: int = 16, n_heads: int = 2, top_k: int = 3):
        super().__init__()
        self.n_heads, self.top_k = n_heads, top_k
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.o = nn.Linear(d_model, d_model)

    def forward(self, tokens: torch.Tensor, variate_valid: torch.Tensor) -> torch.Tensor:
        b, n, d = tokens.shape
        split = lambda t: t.view(b, n, self.n_heads, d // self.n_heads)  # noqa: E731
        q, k, v = split(self.q(tokens)), split(self.k(tokens)), split(self.v(tokens))
        raw = torch.einsum("bnhe,bmhe->bhnm", q, k) / (d // self.n_heads) ** 0.5
        valid_key = variate_valid[:, None, None, :]
        ranked = raw.masked_fill(~valid_key, torch.finfo(raw.dtype).min)  # (padded variates never ranked)
        picked = ranked.topk(self.top_k, dim=-1, largest=True).indices
        graph = torch.zeros_like(raw).scatter(-1, picked, 1.0)  # 1 = an edge the graph keeps
        if FIXED:
            logits = ranked.masked_fill(graph == 0, float("-inf"))
        else:
            logits = (raw * graph).masked_fill(~valid_key, float("-inf"))
        weights = F.softmax(logits, dim=-1)
        return self.o(torch.einsum("bhnm,bmhe->bnhe", weights, v).reshape(b, n, d))


class VariateEncoder(nn.Module):
    def __init__(self, lookback: int = 24, d_model: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Linear(lookback, d_model)  # (one token per variate: its whole lookback window)
        self.blocks = nn.ModuleList(SparseVariateAttention(d_model) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))

    def forward(self, series: torch.Tensor, variate_valid: torch.Tensor) -> torch.Tensor:
        h = self.embed(series.transpose(1, 2))  # (B, T, N) -> (B, N, d)
        for block, norm in zip(self.blocks, self.norms):
            h = h + block(norm(h), variate_valid)
        return h


series = torch.randn(2, 24, 6).cumsum(1)
variate_valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
series[1, :, 4:] = 0.0  # (the second sample has 4 variables, padded to 6)
model = VariateEncoder().eval()
with torch.no_grad():
    out = model(series, variate_valid)
print(f"encoded variates: {tuple(out.shape)}, finite: {bool(torch.isfinite(out).all())}")
