# The LFM2 bug (huggingface/transformers#41790: the conv layers handed the 4-D causal mask, which the padding helper's
# 2-D gate skips) written as a Griffin / RecurrentGemma-style model: one `mask` dict entry per layer kind, a temporal
# Conv1D of width 4 with dilation 1 written as nn.Conv1d(padding=3) trimmed to T, an RG-LRU-like gated recurrence,
# attention layers with an additive float mask over a hand-written softmax, and a right-aligned (left-padded) batch.
# Bug: the recurrent layers get the (B, 1, T, T) float mask, and `zero_padding` only applies a (B, T) mask, so the
# padded tokens keep their states; fix: they get the 2-D 0/1 mask.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(3)

CONFIG = {"vocab_size": 48, "hidden_size": 16, "lru_width": 16, "conv1d_width": 4, "num_heads": 2,
          "block_types": ("recurrent", "recurrent", "attention", "recurrent")}
PAD = 0


def zero_padding(x, mask):
    """States of padded tokens set to 0 before the temporal conv (only a (B, T) mask of 0/1 is read)."""
    if mask is not None and mask.dim() == 2:
        x = x * mask[..., None].to(x.dtype)
    return x


class RecurrentBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        w = c["lru_width"]
        self.linear_x = nn.Linear(c["hidden_size"], w)
        self.linear_y = nn.Linear(c["hidden_size"], w)
        self.conv_1d = nn.Conv1d(w, w, kernel_size=c["conv1d_width"], groups=w, padding=c["conv1d_width"] - 1)
        self.gate = nn.Linear(w, w)
        self.linear_out = nn.Linear(w, c["hidden_size"])

    def forward(self, x, mask):
        t = x.shape[1]
        y = F.gelu(self.linear_y(x))
        x = zero_padding(self.linear_x(x), mask)
        x = zero_padding(self.conv_1d(x.transpose(1, 2))[..., :t].transpose(1, 2), mask)  # (its bias too)
        a = torch.sigmoid(self.gate(x))
        h, out = torch.zeros_like(x[:, 0]), []
        for i in range(t):
            h = a[:, i] * h + (1 - a[:, i]) * x[:, i]
            out.append(h)
        return self.linear_out(torch.stack(out, 1) * y)


class LocalAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads = c["num_heads"]
        self.proj = nn.Linear(c["hidden_size"], 3 * c["hidden_size"])
        self.out = nn.Linear(c["hidden_size"], c["hidden_size"])

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, self.heads, -1).permute(0, 2, 1, 3) for z in self.proj(x).chunk(3, -1))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + mask
        weights = torch.softmax(scores, dim=-1)
        return self.out((weights @ v).permute(0, 2, 1, 3).reshape(b, t, d))


class Griffin(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.norms = nn.ModuleList(nn.LayerNorm(c["hidden_size"]) for _ in c["block_types"])
        self.blocks = nn.ModuleList(LocalAttention(c) if kind == "attention" else RecurrentBlock(c)
                                    for kind in c["block_types"])

    def forward(self, tokens, attention_mask):
        x = self.embed(tokens)
        t = tokens.shape[1]
        keep = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & attention_mask[:, None, None, :].bool()
        additive = torch.zeros(keep.shape).masked_fill(~keep, -1e30)
        masks = {"attention": additive, "recurrent": attention_mask if FIXED else additive}
        for kind, norm, block in zip(self.c["block_types"], self.norms, self.blocks):
            x = x + block(norm(x), masks[kind])
        return x


model = Griffin(CONFIG).eval()
rows = [[5, 9, 14, 3, 22, 40], [17, 8], [31, 6, 2, 44]]
width = max(map(len, rows))
tokens = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
attention_mask = (torch.arange(width)[None] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()

with torch.no_grad():
    batched = model(tokens, attention_mask)
    alone = model(torch.tensor([rows[2]]), torch.ones(1, len(rows[2]), dtype=torch.long))
diff = (batched[2, width - len(rows[2]):] - alone[0]).abs().max().item()
print(f"max |batched - alone| on the real tokens of row 2: {diff:.3e}")
