"""Cohere2 layer mix (3 sliding RoPE layers, then 1 global NoPE layer) on flash-attn's window convention.

Follows huggingface/transformers src/transformers/models/cohere2/modeling_cohere2.py + configuration_cohere2.py
(sliding_window_pattern=4: layer i is sliding unless (i + 1) % 4 == 0; rotary embedding only on sliding
layers) and the flash-attention call in src/transformers/modeling_flash_attention_utils.py, which passes
`window_size=(sliding_window - 1, sliding_window - 1)` together with causal=True. flash_attn's window_size
=(left, right) counts keys *besides* the query itself and aligns the query block bottom-right to the keys,
so with a KV cache a single decode query still gets exactly `sliding_window` keys. `flash_attn_func` below
is a torch reference of that kernel's semantics, called the way the model calls the real one.

Mask meant: sliding layers: query at absolute position p sees keys max(0, p-W+1) .. p (W keys counting
itself); global layers: causal over everything. Same rule in prefill and in the decode step.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

torch.manual_seed(0)


@dataclass
class Cohere2Config:
    hidden_size: int = 16
    num_attention_heads: int = 2
    num_hidden_layers: int = 4
    sliding_window: int = 4
    sliding_window_pattern: int = 4
    rope_theta: float = 10000.0


def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1)):
    """q: [b, sq, h, d], k/v: [b, sk, h, d]; query i sits at key position i + sk - sq (bottom-right)."""
    sq, sk = q.shape[1], k.shape[1]
    qi = torch.arange(sq)[:, None] + (sk - sq)
    kj = torch.arange(sk)[None, :]
    left, right = window_size
    if causal:
        right = 0
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        allowed &= kj >= qi - left
    if right >= 0:
        allowed &= kj <= qi + right
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed)
    return o.transpose(1, 2)


def apply_rotary(x, pos, theta):
    d = x.shape[-1] // 2
    ang = pos[:, None].float() / (theta ** (torch.arange(d) / d))
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    return torch.cat([x[..., :d] * cos - x[..., d:] * sin, x[..., :d] * sin + x[..., d:] * cos], -1)


class Cohere2Attention(torch.nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.is_sliding = (layer_idx + 1) % config.sliding_window_pattern != 0
        self.sliding_window = config.sliding_window if self.is_sliding else None
        self.qkv = torch.nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)

    def forward(self, hidden, position_ids, past_kv):
        b, s, _ = hidden.shape
        q, k, v = self.qkv(hidden).view(b, s, 3, self.config.num_attention_heads, -1).unbind(2)
        if self.is_sliding:  # global layers use no positional embedding
            q = apply_rotary(q, position_ids, self.config.rope_theta)
            k = apply_rotary(k, position_ids, self.config.rope_theta)
        if past_kv is not None:
            k, v = torch.cat([past_kv[0], k], 1), torch.cat([past_kv[1], v], 1)
        window = (-1, -1)
        if self.sliding_window is not None:
            window = (self.sliding_window - 1, self.sliding_window - 1)
        out = flash_attn_func(q, k, v, causal=True, window_size=window)
        return hidden + out.reshape(b, s, -1), (k, v)


def run(layers, x, position_ids, cache):
    new_cache = []
    for i, layer in enumerate(layers):
        x, kv = layer(x, position_ids, cache[i] if cache else None)
        new_cache.append(kv)
    return x, new_cache


def reference(layers, x, cfg):
    """Every layer at once over the full sequence, masks by a double loop over absolute positions."""
    n = x.shape[1]
    for layer in layers:
        allowed = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            for j in range(n):
                allowed[i, j] = j <= i and (not layer.is_sliding or i - j < cfg.sliding_window)
        q, k, v = layer.qkv(x).view(1, n, 3, cfg.num_attention_heads, -1).unbind(2)
        if layer.is_sliding:
            q, k = apply_rotary(q, torch.arange(n), cfg.rope_theta), apply_rotary(k, torch.arange(n), cfg.rope_theta)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed)
        x = x + o.transpose(1, 2).reshape(1, n, -1)
    return x


def main():
    cfg = Cohere2Config()
    layers = torch.nn.ModuleList(Cohere2Attention(cfg, i) for i in range(cfg.num_hidden_layers))
    prompt, steps = 7, 3
    x = torch.randn(1, prompt + steps, cfg.hidden_size)
    with torch.no_grad():
        out, cache = run(layers, x[:, :prompt], torch.arange(prompt), None)
        outs = [out]
        for t in range(prompt, prompt + steps):
            out, cache = run(layers, x[:, t:t + 1], torch.tensor([t]), cache)
            outs.append(out)
        got = torch.cat(outs, 1)
        ref = reference(layers, x, cfg)
    assert torch.allclose(got, ref, atol=1e-5)
    print("layer kinds:", ["sliding" if l.is_sliding else "global" for l in layers])


if __name__ == "__main__":
    main()
