"""Correct: zero keys a correct program attends (written here, for checks/zerokv.py to stay quiet on).

A decoder with a learned null key/value initialised to zero (x-transformers' `add_zero_kv`: one zero key in front,
so a query may attend to nothing) and a batched greedy decode whose first row finishes early and is then fed the pad
token, its zero embedding under bias-free projections: the finished row's keys end in zeros, seen only by its own
pad queries. Runs the same with or without --fixed.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Decoder(nn.Module):
    def __init__(self, vocab=40, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = nn.Embedding(64, dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.null_kv = nn.Parameter(torch.zeros(2, heads, 1, dim // heads))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        b, n = ids.shape
        # a finished row's pad tokens get no position: their input stays the pad embedding (zero)
        x = self.embed(ids) + self.pos(torch.arange(n))[None] * (ids != 0)[..., None]
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        k = torch.cat([self.null_kv[0].expand(b, -1, -1, -1), k], dim=2)
        v = torch.cat([self.null_kv[1].expand(b, -1, -1, -1), v], dim=2)
        causal = torch.ones(n, n + 1, dtype=torch.bool).tril(diagonal=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        return self.head(y.transpose(1, 2).reshape(b, n, -1))


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Decoder().eval()
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    done = torch.tensor([False, False])
    with torch.no_grad():
        for step in range(5):
            nxt = model(ids, done)[:, -1].argmax(-1)
            done = done | (step == 0) & torch.tensor([True, False])  # the first row stops after its first new token
            nxt = torch.where(done, torch.zeros_like(nxt), nxt.clamp(min=1))
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    print("ids", ids.tolist())
