# The same kind of bug as joeynmt 7ac46a9, written another way: a seq2seq model (SDPA, an additive float mask filled
# with finfo.min, a dataclass config, pad id 0) that builds its decoder's padding mask from the shifted *output*
# `tgt_output` (what the loss reads) and lays it on the query axis, (B, 1, T, 1), ANDed with its causal mask. The last
# real input token of each shorter row (its EOS input, whose next token is padding) sees no key at all: its row is all
# finfo.min, so softmax spreads it evenly over every key, later ones and padding included. --fixed: the mask is built
# from the decoder input `tgt_input`, on the key axis (B, 1, 1, T).
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Seq2SeqConfig:
    vocab_size: int = 24
    d_model: int = 16
    n_heads: int = 2
    pad_idx: int = 0
    bos_idx: int = 1
    eos_idx: int = 2


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h = cfg.n_heads
        self.q, self.kv, self.o = nn.Linear(cfg.d_model, cfg.d_model), nn.Linear(cfg.d_model, 2 * cfg.d_model), \
            nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x, memory, bias):
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.h, -1).transpose(1, 2)
        k, v = (t.view(b, memory.shape[1], self.h, -1).transpose(1, 2) for t in self.kv(memory).chunk(2, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return x + self.o(out.transpose(1, 2).reshape(b, n, d))


class Seq2Seq(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.src_pad_idx = self.tgt_pad_idx = cfg.pad_idx
        self.src_embedding = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_idx)
        self.tgt_embedding = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_idx)
        self.encoder_attn, self.decoder_self_attn, self.decoder_cross_attn = (Attention(cfg) for _ in range(3))
        self.generator = nn.Linear(cfg.d_model, cfg.vocab_size)

    @staticmethod
    def additive(keep, dtype):
        return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)

    def forward(self, src, tgt_input, tgt_output):
        src_keep = (src != self.src_pad_idx)[:, None, None, :]
        memory = self.encoder_attn(self.src_embedding(src), self.src_embedding(src), self.additive(src_keep, torch.float))
        t = tgt_input.shape[1]
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        if FIXED:
            tgt_keep = (tgt_input != self.tgt_pad_idx)[:, None, None, :] & causal
        else:
            tgt_keep = (tgt_output != self.tgt_pad_idx)[:, None, :, None] & causal
        y = self.tgt_embedding(tgt_input)
        y = self.decoder_self_attn(y, y, self.additive(tgt_keep, y.dtype))
        y = self.decoder_cross_attn(y, memory, self.additive(src_keep, y.dtype))
        logits = self.generator(y)
        return F.cross_entropy(logits.flatten(0, 1), tgt_output.flatten(), ignore_index=self.tgt_pad_idx)


cfg = Seq2SeqConfig()
model = Seq2Seq(cfg)
src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, 0, 0], [11, 12, 13, 2, 0]])
tgt = torch.tensor([[1, 14, 15, 16, 17, 2], [1, 18, 2, 0, 0, 0], [1, 19, 20, 21, 2, 0]])  # <s> ... </s> <pad>*
loss = model(src, tgt[:, :-1], tgt[:, 1:])
loss.backward()
print("loss %.4f" % loss.item())
