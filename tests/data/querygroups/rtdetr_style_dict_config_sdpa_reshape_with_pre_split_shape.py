# The Group-DETR split undone by a reshape with the pre-split shape, written as a sequence-first DAB/RT-DETR-style port:
# the decoder layer keeps its settings as a plain dict (`self.cfg`, group_detr and num_queries), the queries are
# (N, B, E), the groups are split along N onto the batch axis in training (N / G, B * G, E), and the self-attention,
# which runs F.scaled_dot_product_attention, reshapes q/k/v with the (N, B) read before the split: each image's row
# then holds its G groups interleaved, every query attending the other groups. A batch of 4 images and 2 groups (the
# rows a multiple of the groups). The fix reads (n, b) off the split tensor.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

CFG = {"hidden_dim": 32, "nheads": 4, "num_queries": 6, "group_detr": 2, "dim_feedforward": 64}


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, shape):
        n, b = shape  # the (length, batch) the caller says the queries have
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(n, b, self.heads, self.hd).permute(1, 2, 0, 3) for t in (q, k, v))  # (B, H, N, D)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.permute(2, 0, 1, 3).reshape(n, b, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        dim = cfg["hidden_dim"]
        self.self_attn = SelfAttention(dim, cfg["nheads"])
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, cfg["dim_feedforward"]), nn.ReLU(), nn.Linear(cfg["dim_feedforward"], dim))

    def forward(self, tgt, pos):
        N, B, _ = tgt.shape
        x = tgt + pos
        groups = self.cfg["group_detr"] if self.training else 1
        if groups > 1:
            x = torch.cat(x.split(N // groups, dim=0), dim=1)  # (N / G, B * G, E): each group its own batch rows
        shape = x.shape[:2] if FIXED else (N, B)
        out = self.self_attn(x, shape)
        if groups > 1:
            out = torch.cat(out.split(B, dim=1), dim=0) if FIXED else out  # back to (N, B, E)
        tgt = self.norm1(tgt + out)
        return self.norm2(tgt + self.ffn(tgt))


class Decoder(nn.Module):
    def __init__(self, cfg, layers=2):
        super().__init__()
        self.cfg = cfg
        queries = cfg["num_queries"] * cfg["group_detr"]
        self.query = nn.Embedding(queries, cfg["hidden_dim"])
        self.pos = nn.Embedding(queries, cfg["hidden_dim"])
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(layers))
        self.head = nn.Linear(cfg["hidden_dim"], 3)

    def forward(self, images):
        b = images.shape[0]
        n = self.cfg["num_queries"] * (self.cfg["group_detr"] if self.training else 1)
        tgt = self.query.weight[:n, None].expand(n, b, -1)
        pos = self.pos.weight[:n, None].expand(n, b, -1)
        for layer in self.layers:
            tgt = layer(tgt, pos)
        return self.head(tgt)


model = Decoder(CFG)
model.train()
images = torch.randn(4, 3, 16, 16)
logits = model(images)
loss = logits.square().mean()
loss.backward()
model.eval()
with torch.no_grad():
    model(images)
print(f"loss {loss.item():.5f}")
