"""mlx-lm Gemma2: a (B, 1, L, S) batch mask broadcast against 5-D GQA scores lands on the kv-head axis.

Citation: ml-explore/mlx-lm#1903 ("Fix Gemma2 attention bug", PR with a regression test that
fails before and passes after). Same root cause as the merged ml-explore/mlx-lm#1467 in
quantized SDPA. Written from the PR text and mlx_lm/models/gemma2.py; ported from MLX to torch.

Bug: for GQA, Gemma2's Attention reshapes queries to (B, n_kv_heads, repeats, L, D) so its
soft-capped scores are 5-D, but the batched mask from create_attention_mask is (B, 1, L, S).
Right-aligned broadcasting reads it as (1, B, 1, L, S): batch row b's padding/causal mask is
applied to kv-head group b of *every* sequence. It raises when B != n_kv_heads and B != 1, and is
silently wrong when B == n_kv_heads.

Fix: give the mask the repeats axis before use (mask[:, :, None] -> (B, 1, 1, L, S)).

This program: batched generation of two left-padded prompts (lengths 7 and 4, so left_padding
[0, 3]) with n_kv_heads = 2 = B, n_heads = 4; prefill plus two decode steps through a batch KV
cache that carries left_padding and offset.
"""
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class ModelArgs:
    model_type: str = "gemma2"
    hidden_size: int = 32
    num_hidden_layers: int = 2
    intermediate_size: int = 64
    num_attention_heads: int = 4
    head_dim: int = 8
    rms_norm_eps: float = 1e-6
    vocab_size: int = 50
    num_key_value_heads: int = 2
    attn_logit_softcapping: float = 50.0
    final_logit_softcapping: float = 30.0
    query_pre_attn_scalar: float = 144.0


def create_causal_mask(N, offset=0, left_padding=None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    mask = linds[:, None] >= rinds[None]
    if left_padding is not None:
        mask = mask & (rinds >= left_padding[:, None, None, None])
    return mask


class BatchKVCache:
    def __init__(self, left_padding):
        self.left_padding = torch.tensor(left_padding)
        self.offset = 0
        self.keys = self.values = None

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        self.offset += keys.shape[2]
        return self.keys, self.values

    def make_mask(self, N):
        return create_causal_mask(N, offset=self.offset, left_padding=self.left_padding)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.repeats = n_heads // n_kv_heads
        self.head_dim = head_dim = args.head_dim
        self.scale = 1.0 / (args.query_pre_attn_scalar ** 0.5)
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.attn_logit_softcapping = args.attn_logit_softcapping

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        queries = queries * self.scale
        if self.repeats > 1:
            queries = queries.reshape(B, self.n_kv_heads, self.repeats, L, self.head_dim)
            keys = keys.unsqueeze(2)
            values = values.unsqueeze(2)
            if FIXED and mask is not None and mask.ndim == 4:
                mask = mask.unsqueeze(2)
        scores = queries @ keys.transpose(-1, -2)
        scores = torch.tanh(scores / self.attn_logit_softcapping)
        scores = scores * self.attn_logit_softcapping
        if mask is not None:
            if mask.dtype == torch.bool:
                scores = torch.where(mask, scores, torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype))
            else:
                scores = scores + mask
        scores = torch.softmax(scores.float(), dim=-1).to(scores.dtype)
        output = scores @ values
        if self.repeats > 1:
            output = output.reshape(B, self.n_heads, L, self.head_dim)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = nn.Sequential(nn.Linear(args.hidden_size, args.intermediate_size), nn.GELU(),
                                 nn.Linear(args.intermediate_size, args.hidden_size))
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), mask, cache))
        return h + self.mlp(h)


class GemmaModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.num_hidden_layers))
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, cache):
        h = self.embed_tokens(inputs) * (self.args.hidden_size ** 0.5)
        mask = cache[0].make_mask(h.shape[1])  # (B, 1, L, S) with left padding
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


def main():
    torch.manual_seed(0)
    args = ModelArgs()
    model = GemmaModel(args).eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
    max_len = max(len(p) for p in prompts)
    left_padding = [max_len - len(p) for p in prompts]
    inputs = torch.tensor([[0] * pad + p for p, pad in zip(prompts, left_padding)])
    cache = [BatchKVCache(left_padding) for _ in range(args.num_hidden_layers)]
    with torch.no_grad():
        h = model(inputs, cache)
        tokens = []
        for _ in range(2):
            y = (h[:, -1] @ model.embed_tokens.weight.T).argmax(-1)
            tokens.append(y.tolist())
            h = model(y[:, None], cache)
    print(f"left_padding {left_padding} generated {tokens}")


if __name__ == "__main__":
    main()
