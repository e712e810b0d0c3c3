# A hand-written encoder-decoder (fairseq style: batch-first einsum attention, dataclass config) whose decoder
# self-attention masks nothing when `causal_decoder` is off: the decoder is trained inside its forward on labels,
# its inputs the labels shifted right behind a BOS, the padded labels ignored (-100). Buggy: the config leaves
# causal_decoder False, so each position sees the token it must predict. Fixed: the config turns it on.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class DecoderCfg:
    vocab: int = 40
    dim: int = 16
    heads: int = 2
    layers: int = 2
    bos: int = 1
    causal_decoder: bool = False


class SelfAttn(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h, self.qkv, self.out = cfg.heads, nn.Linear(cfg.dim, 3 * cfg.dim), nn.Linear(cfg.dim, cfg.dim)
        self.causal = cfg.causal_decoder

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).unbind(2)
        logits = torch.einsum("bqhd,bkhd->bhqk", q, k) / (d // self.h) ** 0.5
        if self.causal:
            logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        probs = logits.softmax(-1)
        return self.out(torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d))


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(SelfAttn(cfg) for _ in range(cfg.layers))
        self.memory_proj = nn.Linear(cfg.dim, cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, tokens, memory, labels):
        x = self.embed(tokens) + self.memory_proj(memory.mean(1, keepdim=True))
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


cfg = DecoderCfg(causal_decoder=FIXED)
model = Decoder(cfg)
labels = torch.randint(2, cfg.vocab, (3, 6))
labels[1, 4:] = -100
labels[2, 5:] = -100
tokens = torch.cat([torch.full((3, 1), cfg.bos), labels[:, :-1].clamp(min=0)], dim=1)
memory = torch.randn(3, 5, cfg.dim)
logits, loss = model(tokens, memory, labels)
print(f"causal_decoder={cfg.causal_decoder} loss={loss.item():.4f}")
