# The optimum#1076 bug written another way: a hand-written encoder-decoder (nn.MultiheadAttention encoder over a
# left-padded source, eager-softmax decoder) exported through a positional-only "decoder step" wrapper, as one does
# for torch.jit.trace / torch.onnx.export. The wrapper's signature leaves out the source padding mask, so the exported
# decoder's cross-attention (src_attn) attends to the source's pad positions; the fix threads the mask through.
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Seq2SeqConfig:
    vocab: int = 40
    d_model: int = 32
    n_heads: int = 4
    layers: int = 2
    pad_id: int = 0
    bos_id: int = 1


class EncoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(cfg.d_model, cfg.n_heads, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.ff = nn.Sequential(nn.Linear(cfg.d_model, 64), nn.ReLU(), nn.Linear(64, cfg.d_model))

    def forward(self, x, src_pad):  # src_pad: (B, S) True at a pad position
        h = self.norm1(x)
        x = x + self.self_attn(h, h, h, key_padding_mask=src_pad, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


class Attention(nn.Module):
    """Eager attention: scores, masked_fill(-inf) where the mask says blocked, softmax, weights @ values."""

    def __init__(self, cfg):
        super().__init__()
        self.h, self.dk = cfg.n_heads, cfg.d_model // cfg.n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(4))

    def forward(self, x, memory, blocked=None):
        B, T, _ = x.shape
        S = memory.shape[1]
        q = self.q(x).view(B, T, self.h, self.dk).transpose(1, 2)
        k = self.k(memory).view(B, S, self.h, self.dk).transpose(1, 2)
        v = self.v(memory).view(B, S, self.h, self.dk).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.dk)
        if blocked is not None:
            scores = scores.masked_fill(blocked, float("-inf"))
        w = scores.softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(B, T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn, self.src_attn = Attention(cfg), Attention(cfg)
        self.n1, self.n2, self.n3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))
        self.ff = nn.Sequential(nn.Linear(cfg.d_model, 64), nn.ReLU(), nn.Linear(64, cfg.d_model))

    def forward(self, y, memory, src_blocked, tgt_blocked):
        h = self.n1(y)
        y = y + self.self_attn(h, h, tgt_blocked)
        y = y + self.src_attn(self.n2(y), memory, src_blocked)
        return y + self.ff(self.n3(y))


class Seq2Seq(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model, padding_idx=cfg.pad_id)
        self.pos = nn.Embedding(32, cfg.d_model)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.out = nn.Linear(cfg.d_model, cfg.vocab)

    def encode(self, src):
        src_pad = src.eq(self.cfg.pad_id)
        positions = (~src_pad).long().cumsum(-1).sub(1).clamp(min=0)  # left padding: positions count real tokens
        x = self.embed(src) + self.pos(positions)
        for layer in self.encoder:
            x = layer(x, src_pad)
        return x

    def decode(self, tgt, memory, src_pad=None):
        T = tgt.shape[1]
        y = self.embed(tgt) + self.pos(torch.arange(T))
        tgt_blocked = torch.ones(T, T, dtype=torch.bool).triu(1)[None, None]
        src_blocked = None if src_pad is None else src_pad[:, None, None, :]
        for layer in self.decoder:
            y = layer(y, memory, src_blocked, tgt_blocked)
        return self.out(y)


class DecoderStepForExport(nn.Module):
    """Positional inputs only (torch.onnx.export / jit.trace): what the exported decoder graph takes."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    if FIXED:
        def forward(self, tgt, memory, src_pad):
            return self.model.decode(tgt, memory, src_pad)[:, -1]
    else:
        def forward(self, tgt, memory):
            return self.model.decode(tgt, memory)[:, -1]


cfg = Seq2SeqConfig()
model = Seq2Seq(cfg).eval()
step = DecoderStepForExport(model).eval()

# left-padded sources (the pad id on the left, as a left-padding tokenizer gives them)
src = torch.tensor([[0, 0, 0, 7, 12, 5, 9, 3],
                    [4, 8, 15, 16, 23, 11, 6, 2],
                    [0, 0, 0, 0, 0, 21, 13, 2]])
src_pad = src.eq(cfg.pad_id)
with torch.no_grad():
    memory = model.encode(src)
    tgt = torch.full((3, 1), cfg.bos_id)
    diff = 0.0
    for _ in range(4):
        logits = step(tgt, memory, src_pad) if FIXED else step(tgt, memory)
        ref = model.decode(tgt, memory, src_pad)[:, -1]
        diff = max(diff, (logits - ref).abs().max().item())
        tgt = torch.cat([tgt, ref.argmax(-1, keepdim=True)], 1)
print(f"max |exported step logits - eager logits|: {diff:.6f}")
