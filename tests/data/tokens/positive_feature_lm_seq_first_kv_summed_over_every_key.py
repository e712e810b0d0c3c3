# The bug of MIDI-Transformer#1 written another way: a word-level language model in the layout of PyTorch's
# word_language_model example (ids (L, B), sequence first, targets = the ids one position on, pad id 0 as the loss's
# ignore_index), its layers a linear attention of a positive exponential feature map (Performer-style
# φ(x) = exp(x - max x), the padded keys' φ(k) zeroed), picked from a config dict. The config says
# {"attention": "linear"}: the keys' summary einsum('lbhd,lbhe->bhde') sums over every position, so each word sees
# the words after it, the very word it is trained to predict. --fixed: {"attention": "causal-linear"}: a prefix sum
# over the positions (cumsum, the causal form of linear attention).
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

CONFIG = {"vocab": 50, "d_model": 32, "heads": 2, "layers": 2, "pad": 0,
          "attention": "causal-linear" if FIXED else "linear"}


class LinearAttention(nn.Module):
    def __init__(self, d_model, heads, kind):
        super().__init__()
        self.heads, self.kind = heads, kind
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x, pad):  # x (L, B, E); pad (L, B) True at padding
        L, B, E = x.shape
        q, k, v = self.qkv(x).view(L, B, 3, self.heads, E // self.heads).unbind(2)
        q = (q - q.amax(dim=-1, keepdim=True)).exp()
        k = (k - k.amax(dim=-1, keepdim=True)).exp().masked_fill(pad[:, :, None, None], 0.0)
        if self.kind == "linear":
            context = torch.einsum("lbhd,lbhe->bhde", k, v)
            norm = torch.einsum("lbhd,bhd->lbh", q, k.sum(dim=0))
            out = torch.einsum("lbhd,bhde->lbhe", q, context) / norm[..., None]
        else:
            context = torch.einsum("lbhd,lbhe->lbhde", k, v).cumsum(dim=0)
            norm = torch.einsum("lbhd,lbhd->lbh", q, k.cumsum(dim=0)).clamp_min(1e-6)
            out = torch.einsum("lbhd,lbhde->lbhe", q, context) / norm[..., None]
        return self.out(out.reshape(L, B, E))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn = LinearAttention(config["d_model"], config["heads"], config["attention"])
        self.ff = nn.Sequential(nn.Linear(config["d_model"], 64), nn.GELU(), nn.Linear(64, config["d_model"]))
        self.n1, self.n2 = nn.LayerNorm(config["d_model"]), nn.LayerNorm(config["d_model"])

    def forward(self, x, pad):
        x = self.n1(x + self.attn(x, pad))
        return self.n2(x + self.ff(x))


class WordLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.encoder = nn.Embedding(config["vocab"], config["d_model"], padding_idx=config["pad"])
        self.pos = nn.Embedding(64, config["d_model"])
        self.blocks = nn.ModuleList(Block(config) for _ in range(config["layers"]))
        self.decoder = nn.Linear(config["d_model"], config["vocab"])

    def forward(self, src):  # src (L, B)
        pad = src == self.config["pad"]
        x = self.encoder(src) + self.pos(torch.arange(src.shape[0]))[:, None]
        for block in self.blocks:
            x = block(x, pad)
        return self.decoder(x)


def batchify(sentences, pad):
    """(L + 1, B): each sentence a column, right-padded with the pad id."""
    longest = max(len(s) for s in sentences)
    return torch.tensor([[s[i] if i < len(s) else pad for s in sentences] for i in range(longest)])


if __name__ == "__main__":
    model = WordLM(CONFIG)
    g = torch.Generator().manual_seed(1)
    sentences = [torch.randint(1, CONFIG["vocab"], (n,), generator=g).tolist() for n in (9, 6, 8)]
    source = batchify(sentences, CONFIG["pad"])
    data, targets = source[:-1], source[1:]  # get_batch: the target of position i is the word at i + 1
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    output = model(data)
    loss = F.cross_entropy(output.view(-1, CONFIG["vocab"]), targets.reshape(-1), ignore_index=CONFIG["pad"])
    opt.zero_grad()
    loss.backward()
    opt.step()

    model.eval()
    with torch.no_grad():
        full = model(data)
        prefix = model(data[:3])
    print("attention:", CONFIG["attention"])
    print(f"loss {loss.item():.4f}; |logits(all)[:3] - logits(first 3)|: {(full[:3] - prefix).abs().max().item():.3e}")
