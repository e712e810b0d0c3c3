"""A Gemma-style embedding model ported by hand: its config, a dict held on `self.cfg`, states
use_bidirectional_attention="all" (every token both ways, Gemma 4's word), and the batch is left-padded with the pad id;
the attention is an eager softmax whose additive mask was copied from the decoder (a causal triangle beside the
padding). --fixed: the additive padding mask alone."""

import sys

import torch

FIXED = "--fixed" in sys.argv

CFG = {"dim": 8, "n_heads": 2, "n_layers": 2, "pad_token_id": 0, "use_bidirectional_attention": "all"}


class SelfAttention(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.qkv = torch.nn.Linear(cfg["dim"], 3 * cfg["dim"])

    def forward(self, x, bias):
        b, n, d = x.shape
        h = self.cfg["n_heads"]
        q, k, v = (t.view(b, n, h, d // h).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / (d // h) ** 0.5 + bias
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)


class Encoder(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = torch.nn.Embedding(16, cfg["dim"], padding_idx=cfg["pad_token_id"])
        self.blocks = torch.nn.ModuleList(SelfAttention(cfg) for _ in range(cfg["n_layers"]))

    def forward(self, ids):
        n = ids.shape[1]
        neg = torch.finfo(torch.float32).min
        bias = torch.zeros(ids.shape[0], 1, n, n).masked_fill((ids == self.cfg["pad_token_id"])[:, None, None, :], neg)
        if not FIXED:
            bias = bias.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), neg)
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x, bias)
        return x[:, -1]


torch.manual_seed(0)
with torch.no_grad():
    Encoder(CFG)(torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 9, 10, 11, 12]]))
