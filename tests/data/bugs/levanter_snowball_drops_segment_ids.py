"""Levanter Snowball LM: packed-example segment ids dropped before attention (torch port).

Citation: marin-community/marin#9029 "[levanter] Snowball ignores packed-example attention
boundaries" (bug label; correction in commit dfd8a1518f, lib/levanter/src/levanter/models/
snowball.py:716). I read the issue text only, not the commit diff.

Levanter packs several documents into one training row. ``LmExample`` carries an attention
mask built as ``AttentionMask.causal().with_segment_ids(segment_ids)``, so a token may only see
earlier tokens of its own segment. ``SnowballLMHeadModel.activations`` threw the segment ids away
and ran its transformer under a plain causal mask: tokens of one packed conversation attended to
the conversation packed before it (the issue measured every checked hidden state of the second
segment changing when a token of the first segment changed). The fix forwards the example's mask,
segment ids included, to the transformer.

This program ports the pieces to torch: Levanter's ``AttentionMask`` (causal flag + segment ids,
materialized into a boolean [q, k] mask), ``LmExample.causal``, and an LM head model named after
Snowball whose layers are a generic pre-norm decoder (I did not read snowball.py's layers); its
attention is an explicit softmax over ``q @ k^T`` with the materialized mask applied.
One packed row holds two segments (5 + 3 tokens); buggy, the second segment sees the first.
"""
import sys
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


@dataclass(frozen=True)
class AttentionMask:
    """Levanter's structured mask: causal flag, optional segment ids, optional sliding window."""

    is_causal: bool = False
    segment_ids: Optional[torch.Tensor] = None  # [batch, pos]
    sliding_window: Optional[int] = None

    @staticmethod
    def causal(sliding_window: Optional[int] = None) -> "AttentionMask":
        return AttentionMask(is_causal=True, sliding_window=sliding_window)

    def with_segment_ids(self, segment_ids: torch.Tensor) -> "AttentionMask":
        return replace(self, segment_ids=segment_ids)

    def materialize(self, q_len: int, k_len: int) -> torch.Tensor:
        q_pos = torch.arange(q_len)[:, None]
        k_pos = torch.arange(k_len)[None, :]
        mask = torch.ones(q_len, k_len, dtype=torch.bool)
        if self.is_causal:
            mask = mask & (k_pos <= q_pos)
        if self.sliding_window is not None:
            mask = mask & (q_pos - k_pos < self.sliding_window)
        mask = mask[None]  # [1, q, k]
        if self.segment_ids is not None:
            seg = self.segment_ids
            mask = mask & (seg[:, :, None] == seg[:, None, :])
        return mask


@dataclass
class LmExample:
    tokens: torch.Tensor
    loss_weight: torch.Tensor
    attn_mask: AttentionMask

    @staticmethod
    def causal(tokens, *, segment_ids=None, block_cross_document_attention=True):
        attn_mask = AttentionMask.causal()
        if block_cross_document_attention and segment_ids is not None:
            attn_mask = attn_mask.with_segment_ids(segment_ids)
        loss_weight = torch.ones_like(tokens, dtype=torch.float32)
        loss_weight[:, -1] = 0
        return LmExample(tokens=tokens, loss_weight=loss_weight, attn_mask=attn_mask)


@dataclass(frozen=True)
class SnowballConfig:
    vocab_size: int = 64
    hidden_dim: int = 32
    num_heads: int = 4
    num_layers: int = 2


def dot_product_attention(q, k, v, mask: AttentionMask):
    # q, k, v: [batch, heads, pos, head_dim]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    allowed = mask.materialize(q.shape[-2], k.shape[-2])[:, None]
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) @ v


class SnowballAttention(nn.Module):
    def __init__(self, config: SnowballConfig):
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.hidden_dim, 3 * config.hidden_dim, bias=False)
        self.o_proj = nn.Linear(config.hidden_dim, config.hidden_dim, bias=False)

    def forward(self, x, mask: AttentionMask):
        B, T, D = x.shape
        H = self.config.num_heads
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        out = dot_product_attention(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, D))


class SnowballBlock(nn.Module):
    def __init__(self, config: SnowballConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden_dim)
        self.attn = SnowballAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden_dim)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_dim, 4 * config.hidden_dim), nn.SiLU(),
                                 nn.Linear(4 * config.hidden_dim, config.hidden_dim))

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class SnowballLMHeadModel(nn.Module):
    def __init__(self, config: SnowballConfig):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_dim)
        self.layers = nn.ModuleList([SnowballBlock(config) for _ in range(config.num_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_dim)
        self.lm_head = nn.Linear(config.hidden_dim, config.vocab_size, bias=False)

    def activations(self, input_ids, attn_mask: Optional[AttentionMask] = None):
        if FIXED:
            mask = attn_mask if attn_mask is not None else AttentionMask.causal()
        else:
            mask = AttentionMask.causal()
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, mask)
        return self.ln_f(x)

    def forward(self, input_ids, attn_mask=None):
        return self.lm_head(self.activations(input_ids, attn_mask))


def main():
    torch.manual_seed(0)
    model = SnowballLMHeadModel(SnowballConfig()).eval()
    tokens = torch.randint(0, 64, (1, 8))
    segment_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
    example = LmExample.causal(tokens, segment_ids=segment_ids)
    with torch.no_grad():
        logits = model(example.tokens, attn_mask=example.attn_mask)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], example.tokens[0, 1:], reduction="none")
    print("loss:", round(float((loss * example.loss_weight[0, :-1]).sum() / example.loss_weight.sum()), 4))


if __name__ == "__main__":
    main()
