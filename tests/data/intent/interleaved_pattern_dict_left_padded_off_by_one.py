# The same kind of bug as NVIDIA-NeMo/Megatron-Bridge#5441, written another way: a Gemma-3-style model (five sliding
# layers, then one global) keeps its config as a plain dict held by the model (`self.cfg`), stating the period as
# Megatron's `interleaved_attn_pattern` (local, global). Its layer builder reads the period from a 0-based layer
# index as if it were 1-based (`(i + 1) % period != 0` written `i % period != 0`), so layer 0 is built global and
# layer 5 sliding. A left-padded batch, an additive float mask, a hand-written softmax.
# Fixed: `i % period < local`.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv

CFG = {"hidden_size": 32, "num_attention_heads": 4, "num_layers": 6, "window_size": 4,
       "interleaved_attn_pattern": [5, 1], "vocab_size": 80, "pad_token_id": 0}


def is_sliding(i, cfg):
    local, glob = cfg["interleaved_attn_pattern"]
    if FIXED:
        return i % (local + glob) < local
    return i % (local + glob) != 0


class Attention(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.h = cfg["num_attention_heads"]
        self.window = cfg["window_size"] if is_sliding(i, cfg) else None
        d = cfg["hidden_size"]
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x, keep):
        B, L, D = x.shape
        q, k, v = (w(x).view(B, L, self.h, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        pos = torch.arange(L)
        allowed = pos[None, :] <= pos[:, None]
        if self.window is not None:
            allowed = allowed & (pos[:, None] - pos[None, :] < self.window)
        allowed = allowed[None, None] & keep[:, None, None, :]
        bias = torch.zeros(B, 1, L, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)) + bias
        y = torch.softmax(scores, dim=-1) @ v
        return self.wo(y.transpose(1, 2).reshape(B, L, D))


class Block(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        d = cfg["hidden_size"]
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn = Attention(cfg, i)
        self.mlp = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))

    def forward(self, x, keep):
        x = x + self.attn(self.n1(x), keep)
        return x + self.mlp(self.n2(x))


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(cfg["num_layers"])])

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        keep = attention_mask.bool()
        for layer in self.layers:
            x = layer(x, keep)
        return x @ self.embed.weight.t()


def main():
    torch.manual_seed(0)
    model = Model(CFG).eval()
    rows = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [0, 0, 0, 21, 22, 23, 24, 25, 26, 27]]  # left-padded
    input_ids = torch.tensor(rows)
    attention_mask = (input_ids != CFG["pad_token_id"]).long()
    with torch.no_grad():
        logits = model(input_ids, attention_mask)
    print(f"last logits: {logits[:, -1].sum(-1).tolist()}")


if __name__ == "__main__":
    main()
