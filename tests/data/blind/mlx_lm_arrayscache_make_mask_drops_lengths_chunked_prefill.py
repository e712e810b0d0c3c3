# ml-explore/mlx-lm#1736 ("Fix batched generation for hybrid-cache models"), MLX ported to torch.
# mlx_lm/models/cache.py ArraysCache: make_mask(N) returned only the left-padding mask whenever
# `left_padding` was set, and ArraysCache.merge always sets left_padding = [0] * B, so the `lengths`
# (right-padding) mask installed by prepare() for a chunked prefill was dropped. The pad tokens at the
# end of a short row's last chunk then ran through the recurrent (gated-delta / SSM) layer and
# updated its state. Fix: make_mask combines both, idx >= left_padding and idx < lengths.
# Hybrid model as mlx-lm's qwen3_next/qwen3.5 lay it: linear-attention layers with an ArraysCache
# (conv state + recurrent state), one full-attention layer with a KV cache every few layers.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ArraysCache:
    def __init__(self, size, left_padding=None):
        self.cache = [None] * size
        self.left_padding = torch.tensor(left_padding) if left_padding is not None else None
        self.lengths = None

    def __getitem__(self, i):
        return self.cache[i]

    def __setitem__(self, i, v):
        self.cache[i] = v

    @classmethod
    def merge(cls, caches):
        out = cls(len(caches[0].cache), left_padding=[0] * len(caches))
        return out

    def prepare(self, *, lengths=None, **kw):
        self.lengths = torch.tensor(lengths) if lengths is not None else None

    def advance(self, N):
        if self.lengths is not None:
            self.lengths = self.lengths - N
        if self.left_padding is not None:
            self.left_padding = self.left_padding - N

    def make_mask(self, N):
        idx = torch.arange(N)
        if FIXED:
            mask = None
            if self.left_padding is not None:
                mask = idx >= self.left_padding[:, None]
            if self.lengths is not None:
                lm = idx < self.lengths[:, None]
                mask = lm if mask is None else (mask & lm)
            return mask
        if self.left_padding is not None:
            return idx >= self.left_padding[:, None]
        elif self.lengths is not None:
            return idx < self.lengths[:, None]
        return None


class KVCache:
    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, k, v):
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
        self.offset += k.shape[2]
        return self.keys, self.values

    def make_mask(self, N):
        # causal over (offset + N) keys; padding at the tail of a row is never read by its real tokens
        q = torch.arange(self.offset, self.offset + N)[:, None]
        k = torch.arange(self.offset + N)[None]
        return k <= q


class GatedDeltaNet(nn.Module):
    def __init__(self, d, conv_kernel=4):
        super().__init__()
        self.in_proj = nn.Linear(d, 3 * d, bias=False)
        self.a_proj = nn.Linear(d, d)
        self.conv1d = nn.Conv1d(d, d, conv_kernel, groups=d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.k = conv_kernel
        self.d = d

    def __call__(self, x, mask=None, cache=None):
        B, S, D = x.shape
        qkv = self.in_proj(x)
        if mask is not None:
            qkv = torch.where(mask[..., None], qkv, 0.0)
        conv_state = cache[0] if cache[0] is not None else torch.zeros(B, self.k - 1, 3 * D)
        q, k, v = qkv.split(D, dim=-1)
        v_in = torch.cat([conv_state[..., 2 * D:], v], dim=1)
        cache[0] = torch.cat([conv_state, qkv], dim=1)[:, -(self.k - 1):]
        v = F.silu(self.conv1d(v_in.transpose(1, 2)).transpose(1, 2))
        g = torch.sigmoid(self.a_proj(x))
        state = cache[1] if cache[1] is not None else torch.zeros(B, D)
        outs = []
        for t in range(S):
            new = g[:, t] * state + (1 - g[:, t]) * v[:, t] * torch.sigmoid(k[:, t])
            if mask is not None:
                new = torch.where(mask[:, t, None], new, state)
            state = new
            outs.append(state * torch.sigmoid(q[:, t]))
        cache[1] = state
        return self.out_proj(torch.stack(outs, 1))


class Attention(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def __call__(self, x, mask=None, cache=None):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        k, v = cache.update_and_fetch(k, v)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None] if mask.ndim == 2 else mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, D))


class Model(nn.Module):
    def __init__(self, vocab=50, d=32, n_heads=4, layer_types=("linear", "linear", "full", "linear")):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layer_types = layer_types
        self.layers = nn.ModuleList(
            [GatedDeltaNet(d) if t == "linear" else Attention(d, n_heads) for t in layer_types]
        )
        self.norms = nn.ModuleList([nn.LayerNorm(d) for _ in layer_types])
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.fa_idx = layer_types.index("full")
        self.ssm_idx = layer_types.index("linear")

    def make_cache(self, B):
        return [ArraysCache.merge([ArraysCache(2)] * B) if t == "linear" else KVCache() for t in self.layer_types]

    def __call__(self, inputs, cache):
        h = self.embed_tokens(inputs)
        N = inputs.shape[1]
        fa_mask = cache[self.fa_idx].make_mask(N)
        ssm_mask = cache[self.ssm_idx].make_mask(N)
        for layer, norm, c, t in zip(self.layers, self.norms, cache, self.layer_types):
            h = h + layer(norm(h), mask=ssm_mask if t == "linear" else fa_mask, cache=c)
        for c in cache:
            if isinstance(c, ArraysCache):
                c.advance(N)
        return self.lm_head(h)


def batched_generate(model, prompts, prefill_step_size=4, max_tokens=4, pad_id=0):
    # right-pad the prompts; prefill in chunks with prepare(lengths=...) as the batch generator does
    B = len(prompts)
    L = max(len(p) for p in prompts)
    lengths = [len(p) for p in prompts]
    ids = torch.tensor([p + [pad_id] * (L - len(p)) for p in prompts])
    cache = model.make_cache(B)
    for c in cache:
        if isinstance(c, ArraysCache):
            c.prepare(lengths=lengths)
    logits = None
    for s in range(0, L, prefill_step_size):
        logits = model(ids[:, s:s + prefill_step_size], cache)
    # each row's next token from its own last real position
    last = torch.stack([logits[b, (lengths[b] - 1) % prefill_step_size] if lengths[b] > L - logits.shape[1]
                        else logits[b, -1] for b in range(B)])
    out = [last.argmax(-1)]
    for c in cache:
        if isinstance(c, ArraysCache):
            c.prepare(lengths=None)
    for _ in range(max_tokens - 1):
        logits = model(out[-1][:, None], cache)[:, -1]
        out.append(logits.argmax(-1))
    return torch.stack(out, 1), logits


model = Model().eval()
prompts = [[5, 9, 13, 2, 7, 31, 8, 4, 11], [3, 17, 22, 6, 40, 12, 19, 25, 33, 44, 9]]
with torch.no_grad():
    tokens, logits = batched_generate(model, prompts)
print("generated:", tokens.tolist())
print("row 0 logits[:5]:", [round(x, 4) for x in logits[0, :5].tolist()])
