"""Qwen3 embedder (MLXEmbedders) discards the caller's attentionMask: left pads are attended.

Citation: ml-explore/mlx-swift-lm#418 "Qwen3 embedder: honor attentionMask instead of silently
ignoring it" (merged). Read from the PR description only; the Swift diff itself was not read.

Bug: `Qwen3Model.callAsFunction` in MLXEmbedders accepts an `attentionMask` but always runs the
backbone with a plain causal mask. Qwen3-Embedding pools the last token and its reference
tokenizer pads on the left, so every real token of a short (left-padded) text attends to the pad
tokens before it, corrupting the pooled embedding.
Fix: when a `[B, L]` mask is given, fold it into the causal mask (causal AND key-not-padding,
broadcast to `[B, 1, L, L]`); with no mask the behaviour is unchanged.

This program is a torch port of the embedder (RMSNorm'd q/k, RoPE, grouped-query attention,
SDPA) with random weights: a left-padded batch of two texts with last-token pooling. Buggy: the
mask argument is dropped and SDPA gets only the causal mask; `--fixed`: the padding mask is folded
into the causal mask.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Qwen3Configuration:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    vocab_size: int = 100
    rope_theta: float = 1000000.0
    pad_token_id: int = 0


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def create_causal_mask(n, offset=0):
    rinds = torch.arange(offset + n)
    linds = torch.arange(offset, offset + n) if offset else rinds
    return linds[:, None] >= rinds[None]


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    def rope(self, x):
        pos = torch.arange(x.shape[2]).float()
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return x * emb.cos() + rotate_half(x) * emb.sin()

    def forward(self, x, mask):
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).view(B, L, self.n_heads, -1)).transpose(1, 2)
        keys = self.k_norm(self.k_proj(x).view(B, L, self.n_kv_heads, -1)).transpose(1, 2)
        values = self.v_proj(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2)
        queries, keys = self.rope(queries), self.rope(keys)
        repeats = self.n_heads // self.n_kv_heads
        keys = keys.repeat_interleave(repeats, dim=1)
        values = values.repeat_interleave(repeats, dim=1)
        output = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        return self.o_proj(output.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask):
        h = x + self.self_attn(self.input_layernorm(x), mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3Model(nn.Module):
    def __init__(self, args: Qwen3Configuration):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.num_hidden_layers)])
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, position_ids=None, token_type_ids=None, attention_mask=None):
        h = self.embed_tokens(inputs)
        L = h.shape[1]
        mask = create_causal_mask(L)
        if FIXED and attention_mask is not None:
            # causal AND key-not-padding, broadcast to [B, 1, L, L]
            mask = mask[None, None] & attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            h = layer(h, mask)
        return self.norm(h)


def last_token_pool(hidden, attention_mask):
    # left padding: the last column is every text's last real token
    return hidden[:, -1]


def main():
    torch.manual_seed(0)
    config = Qwen3Configuration()
    model = Qwen3Model(config).eval()
    texts = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23]]
    L = max(len(t) for t in texts)
    input_ids = torch.tensor([[config.pad_token_id] * (L - len(t)) + t for t in texts])
    attention_mask = torch.tensor([[0] * (L - len(t)) + [1] * len(t) for t in texts])
    with torch.no_grad():
        hidden = model(input_ids, attention_mask=attention_mask)
        emb = F.normalize(last_token_pool(hidden, attention_mask), dim=-1)
        alone = F.normalize(model(torch.tensor([texts[1]]))[:, -1], dim=-1)
    print("short text vs. unbatched:", round(float((emb[1] * alone[0]).sum()), 5))


if __name__ == "__main__":
    main()
