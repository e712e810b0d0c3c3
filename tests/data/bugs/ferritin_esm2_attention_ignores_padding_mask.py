"""ferritin ESM2: the padding mask reaches the embeddings but never the self-attention (ferritin#199).

Citation: ferritin-bio/ferritin#199 ("Make ESM2 self-attention honor the padding mask
(ferritin-100.12 step 1)", merged). ferritin is a Rust (candle) port of ESM2; this is a torch
rendering of the structure the PR describes. I read the PR description, not the Rust diff.

Bug: ``ESM2::forward(x, attention_mask)`` used the mask only for ESM2's token-dropout
compensation in ``ESM2Embeddings::forward``; the layer loop called ``layer.forward(&xs)``
without it, ``ESM2Layer::forward`` took no mask and ``ESM2Attention::forward`` went straight
from ``attention_scores`` to softmax, so padded positions were attended by the real residues.

Fix: thread an additive bias built from the (batch, seq_len), 1-is-real mask through
``ESM2Layer::forward`` into ``ESM2Attention::forward`` and add it to the scores before softmax.

Reproduction: a two-layer ESM2 (pre-LN, rotary q/k, token-dropout rescaling, config as a
dataclass like ferritin's ESM2Config) on two protein sequences of 7 and 4 residues
(<cls> ... <eos>, <pad> = 1) batched with the 1-is-real attention_mask.
"""
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class ESM2Config:
    vocab_size: int = 33
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 64
    pad_token_id: int = 1
    mask_token_id: int = 32
    token_dropout: bool = True
    layer_norm_eps: float = 1e-5


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, q, k):
        t = torch.arange(k.shape[-2], dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class ESM2Embeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_dropout = config.token_dropout
        self.mask_token_id = config.mask_token_id

    def forward(self, input_ids, attention_mask):
        embeddings = self.word_embeddings(input_ids)
        if self.token_dropout:
            embeddings = embeddings.masked_fill((input_ids == self.mask_token_id).unsqueeze(-1), 0.0)
            mask_ratio_train = 0.15 * 0.8
            src_lengths = attention_mask.sum(-1)
            mask_ratio_observed = (input_ids == self.mask_token_id).sum(-1).float() / src_lengths
            embeddings = (embeddings * (1 - mask_ratio_train) / (1 - mask_ratio_observed)[:, None, None]).to(embeddings.dtype)
        return embeddings * attention_mask.unsqueeze(-1).to(embeddings.dtype)


class ESM2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.rotary_embeddings = RotaryEmbedding(self.head_dim)

    def forward(self, xs, attention_bias=None):
        b, l, _ = xs.shape
        q = self.query(xs).view(b, l, self.num_heads, self.head_dim).transpose(1, 2) * self.head_dim ** -0.5
        k = self.key(xs).view(b, l, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.value(xs).view(b, l, self.num_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary_embeddings(q, k)
        attention_scores = torch.matmul(q, k.transpose(-1, -2))
        if attention_bias is not None:
            attention_scores = attention_scores + attention_bias
        attention_probs = F.softmax(attention_scores, dim=-1)
        context = torch.matmul(attention_probs, v).transpose(1, 2).reshape(b, l, -1)
        return self.dense(context)


class ESM2Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = ESM2Attention(config)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, xs, attention_bias=None):
        xs = xs + self.attention(self.attention_layer_norm(xs), attention_bias)
        return xs + self.output(F.gelu(self.intermediate(self.layer_norm(xs))))


class ESM2(nn.Module):
    def __init__(self, config: ESM2Config):
        super().__init__()
        self.config = config
        self.embeddings = ESM2Embeddings(config)
        self.layers = nn.ModuleList(ESM2Layer(config) for _ in range(config.num_hidden_layers))
        self.emb_layer_norm_after = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x, attention_mask):
        xs = self.embeddings(x, attention_mask)
        if FIXED:
            # (batch, seq_len), 1 = real -> additive (batch, 1, 1, seq_len) bias on the key axis
            attention_bias = (1.0 - attention_mask[:, None, None, :].to(xs.dtype)) * torch.finfo(xs.dtype).min
            for layer in self.layers:
                xs = layer(xs, attention_bias)
        else:
            for layer in self.layers:
                xs = layer(xs)
        return self.emb_layer_norm_after(xs)


ALPHABET = {a: i + 4 for i, a in enumerate("LAGVSERTIDPKQNFYMHWC")}


def batch_tokens(seqs, cls=0, eos=2, pad=1):
    rows = [[cls] + [ALPHABET[a] for a in s] + [eos] for s in seqs]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    return ids, (ids != pad).long()


def main():
    torch.manual_seed(0)
    model = ESM2(ESM2Config()).eval()
    input_ids, attention_mask = batch_tokens(["MKTAYIA", "GSHM"])
    with torch.no_grad():
        out = model(input_ids, attention_mask)
    print("out", tuple(out.shape), "row1 <cls> sum", round(float(out[1, 0, :8].sum()), 4))


if __name__ == "__main__":
    main()
