# skyzh/tiny-llm#65 (commit 1fc0752, "fix simple kv cache decoding"); the bug came in with tiny-llm#46 (commit
# 4cddec2, "fix: Add flash attention option and fix token offset"): src/tiny_llm_ref/generate.py,
# simple_generate_with_kv_cache.
#
# The week-2 Qwen2 model takes (inputs, offset, cache) and rotates its queries and keys at positions
# [offset, offset + L) before appending the keys to a TinyKvFullCache. Before the fix the loop started with
# `offset = tokens.size` and, after #46, advanced it with `offset += token.size` (the size of the one token just
# sampled). The prompt was therefore rotated at [P, 2P) while the first decoded token was rotated at P + 1, the second
# at P + 2, ...: every decoded query and key is numbered inside the prompt instead of after it. The fix starts at
# `offset = 0` and advances with `offset += tokens.size` (the prefill length on the first step, 1 afterwards).
#
# Ported from src/tiny_llm_ref at 1fc0752^ (generate.simple_generate_with_kv_cache, qwen2_week2.Qwen2MultiHeadAttention
# / Qwen2MLP / Qwen2TransformerBlock / Qwen2ModelWeek2.__call__, kv_cache.TinyKvFullCache, positional_encoding.RoPE,
# attention.causal_mask / scaled_dot_product_attention_grouped) from MLX to torch, with tiny sizes and random
# float weights in place of the quantized mlx_lm checkpoint; the tokenizer is a list of ids and the detokenizer a list.
import sys
from typing import Any, Optional

import torch

FIXED = "--fixed" in sys.argv


# ---- attention.py ----
def softmax(x, axis):
    return torch.softmax(x, dim=axis)


def causal_mask(L: int, S: int, dtype) -> torch.Tensor:
    mask = torch.tril(torch.ones((L, S)), diagonal=(S - L))
    mask = torch.where(mask.bool(), torch.tensor(0.0), torch.tensor(-torch.inf)).to(dtype)
    return mask


def scaled_dot_product_attention_grouped(query, key, value, scale=None, mask=None):
    factor = torch.rsqrt(torch.tensor(float(query.shape[-1]))) if scale is None else torch.tensor(scale)
    factor = factor.to(query.dtype)
    expected_shape = query.shape

    H_q, L, D = query.shape[-3:]
    H, S, _ = key.shape[-3:]
    B = query.shape[:-3]
    assert H_q % H == 0
    n_repeats = H_q // H

    query = query.reshape(*B, -1, H, n_repeats, L, D)
    key = key.reshape(*B, -1, H, 1, S, D)
    value = value.reshape(*B, -1, H, 1, S, D)

    scores = torch.matmul(query, key.transpose(-2, -1)) * factor
    if mask is not None:
        if isinstance(mask, str) and mask == "causal":
            mask = causal_mask(L, S, scores.dtype)
            scores = scores + mask
        else:
            mask = torch.broadcast_to(mask, (*B, H_q, L, S))
            mask = mask.reshape(*B, 1, H, n_repeats, L, S)
            scores = scores + mask
    result = torch.matmul(softmax(scores, axis=-1), value)
    return result.reshape(expected_shape)


# ---- positional_encoding.py ----
class RoPE:
    def __init__(self, dims: int, seq_len: int, base: int = 10000, traditional: bool = False):
        assert dims % 2 == 0, "dims must be even"
        self.dims = dims
        self.seq_len = seq_len
        half_dims = dims // 2
        inner = torch.arange(0, half_dims, dtype=torch.float32) / half_dims
        freqs = torch.pow(torch.tensor(float(base)), -inner)
        t = torch.arange(seq_len, dtype=torch.float32)
        freqs = torch.outer(t, freqs)
        self.cos_freqs = torch.cos(freqs)
        self.sin_freqs = torch.sin(freqs)
        self.base = base
        self.half_dims = half_dims
        self.traditional = traditional

    def __call__(self, x, offset=None):
        N, S, H, D = x.shape
        if offset is not None:
            if isinstance(offset, slice):
                assert offset.stop - offset.start == S, f"offset must be of length {S}"
            elif isinstance(offset, list):
                assert len(offset) == N, f"offsets must have the same length as batch size {N}"
                for o in offset:
                    assert o.stop - o.start == S, f"offset must be of length {S}"
                offset = torch.tensor([list(range(i.start, i.stop)) for i in offset])
        cos_basis = self.cos_freqs[:S, :] if offset is None else self.cos_freqs[offset, :]
        sin_basis = self.sin_freqs[:S, :] if offset is None else self.sin_freqs[offset, :]
        if self.traditional:
            x = x.reshape(N, S, H, self.half_dims, 2)
            x1 = x[..., 0]
            x2 = x[..., 1]
        else:
            x1 = x[..., 0 : self.half_dims]
            x2 = x[..., self.half_dims : self.dims]
        cos_basis = cos_basis.reshape(-1, S, 1, self.half_dims)
        sin_basis = sin_basis.reshape(-1, S, 1, self.half_dims)
        real = x1 * cos_basis - x2 * sin_basis
        imag = x2 * cos_basis + x1 * sin_basis
        if self.traditional:
            y = torch.stack([real, imag], dim=-1)
            y = y.reshape(N, S, H, D)
        else:
            y = torch.cat([real, imag], dim=-1)
            y = y.reshape(N, S, H, D)
        return y.to(x.dtype)


# ---- kv_cache.py ----
class TinyKvCache:
    def update_and_fetch(self, key, value, mask_length=None, mask=None):
        pass


class TinyKvFullCache(TinyKvCache):
    def __init__(self):
        self.key_values = None
        self.offset = 0

    def update_and_fetch(self, key, value, mask_length=None, mask=None):
        if self.key_values is None:
            assert self.offset == 0
            self.key_values = (key, value)
            B, H, S, D = key.shape
            self.offset = S
            return key, value, 0, mask
        else:
            B, H, S, D = key.shape
            assert key.shape == value.shape
            prev_keys, prev_values = self.key_values
            assert prev_keys.shape == (B, H, self.offset, D)
            assert prev_values.shape == (B, H, self.offset, D)
            new_keys = torch.cat([prev_keys, key], dim=2)
            new_values = torch.cat([prev_values, value], dim=2)
            self.key_values = (new_keys, new_values)
            self.offset += S
            return new_keys, new_values, self.offset, mask

    def get_offset(self):
        return self.offset


# ---- basics.py / layer_norm.py ----
def linear(x, w, bias=None):
    y = torch.matmul(x, w.T)
    if bias is not None:
        y = y + bias
    return y


def silu(x):
    return x * torch.sigmoid(x)


class RMSNorm:
    def __init__(self, dim: int, weight, eps: float = 1e-5):
        self.dim = dim
        self.eps = eps
        self.weight = weight

    def __call__(self, x):
        orig = x.dtype
        x = x.to(torch.float32)
        return (self.weight * x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)).to(orig)


# ---- qwen2_week2.py ----
class Qwen2MultiHeadAttention:
    def __init__(self, hidden_size, num_heads, num_kv_heads, wq, wk, wv, wo, bq, bk, bv,
                 max_seq_len: int = 32768, theta: int = 1000000, use_flash_attention: bool = False):
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        assert hidden_size % num_heads == 0
        assert num_heads % num_kv_heads == 0
        self.head_dim = hidden_size // num_heads
        self.scale = float(self.head_dim) ** -0.5
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.bq, self.bk, self.bv = bq, bk, bv
        self.rope = RoPE(self.head_dim, max_seq_len, theta, traditional=False)
        self.use_flash_attention = use_flash_attention

    def __call__(self, x, offsets, cache: TinyKvCache, mask=None):
        B, L, _ = x.shape
        projection_q = linear(x, self.wq, bias=self.bq).reshape(B, L, self.num_heads, self.head_dim)
        projection_k = linear(x, self.wk, bias=self.bk).reshape(B, L, self.num_kv_heads, self.head_dim)
        projection_v = linear(x, self.wv, bias=self.bv).reshape(B, L, self.num_kv_heads, self.head_dim)
        # todo: move offsets to kv cache
        if isinstance(offsets, int):
            offset_slice = [slice(int(offsets), int(offsets + L))]
        else:
            offset_slice = [slice(int(i), int(i + L)) for i in offsets]
        projection_q = self.rope(projection_q, offset=offset_slice)
        projection_k = self.rope(projection_k, offset=offset_slice)
        projection_q = projection_q.transpose(1, 2)
        projection_k = projection_k.transpose(1, 2)
        projection_v = projection_v.transpose(1, 2)
        projection_k, projection_v, _, mask = cache.update_and_fetch(
            projection_k, projection_v, mask_length=L, mask=mask
        )
        S = projection_k.shape[-2]
        if isinstance(mask, str) and mask == "causal":
            mask = causal_mask(L, S, torch.float32)
        x = scaled_dot_product_attention_grouped(
            projection_q.to(torch.float32),
            projection_k.to(torch.float32),
            projection_v.to(torch.float32),
            scale=self.scale,
            mask=mask,
        ).to(x.dtype)
        x = x.transpose(1, 2).reshape(B, L, self.hidden_size)
        return linear(x, self.wo)


class Qwen2MLP:
    def __init__(self, dim, hidden_dim, w_gate, w_up, w_down):
        self.dim = dim
        self.hidden_dim = hidden_dim
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down

    def __call__(self, x):
        return linear(silu(linear(x, self.w_gate)) * linear(x, self.w_up), self.w_down)


class Qwen2TransformerBlock:
    def __init__(self, num_attention_heads, num_kv_heads, hidden_size, intermediate_size, rms_norm_eps,
                 wq, wk, wv, wo, bq, bk, bv, w_gate, w_up, w_down, w_input_layernorm, w_post_attention_layernorm,
                 max_seq_len: int = 32768, theta: int = 1000000, use_flash_attention: bool = False):
        self.num_attention_heads = num_attention_heads
        self.hidden_size = hidden_size
        self.mlp = Qwen2MLP(hidden_size, intermediate_size, w_gate, w_up, w_down)
        self.input_layernorm = RMSNorm(hidden_size, w_input_layernorm, eps=rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, w_post_attention_layernorm, eps=rms_norm_eps)
        self.self_attn = Qwen2MultiHeadAttention(
            num_heads=num_attention_heads, hidden_size=hidden_size, num_kv_heads=num_kv_heads,
            wq=wq, wk=wk, wv=wv, wo=wo, bq=bq, bk=bk, bv=bv,
            max_seq_len=max_seq_len, theta=theta, use_flash_attention=use_flash_attention,
        )

    def __call__(self, x, offset: int, cache: TinyKvCache, mask=None):
        r = self.self_attn(self.input_layernorm(x), offset, cache, mask)
        h = x + r
        r = self.mlp(self.post_attention_layernorm(h))
        out = h + r
        return out


class Args:
    # stands in for mlx_lm's ModelArgs of a (tiny) Qwen2 checkpoint
    num_hidden_layers = 2
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    intermediate_size = 128
    vocab_size = 97
    rms_norm_eps = 1e-6
    max_position_embeddings = 256
    rope_theta = 10000
    tie_word_embeddings = True


class Qwen2ModelWeek2:
    def __init__(self, args: Any, enable_flash_attn: bool = False):
        g = torch.Generator().manual_seed(0)

        def w(*shape, std=0.2):
            return torch.randn(*shape, generator=g) * std

        self.num_hidden_layers = args.num_hidden_layers
        self.hidden_size = args.hidden_size
        self.vocab_size = args.vocab_size
        hd = args.hidden_size // args.num_attention_heads
        kv = args.num_key_value_heads * hd
        self.embedding_weight = w(args.vocab_size, args.hidden_size, std=1.0)
        self.layers_inner = []
        for i in range(args.num_hidden_layers):
            layer = Qwen2TransformerBlock(
                num_attention_heads=args.num_attention_heads,
                num_kv_heads=args.num_key_value_heads,
                hidden_size=args.hidden_size,
                intermediate_size=args.intermediate_size,
                rms_norm_eps=args.rms_norm_eps,
                wq=w(args.hidden_size, args.hidden_size), wk=w(kv, args.hidden_size), wv=w(kv, args.hidden_size),
                wo=w(args.hidden_size, args.hidden_size),
                bq=w(args.hidden_size, std=0.1), bk=w(kv, std=0.1), bv=w(kv, std=0.1),
                w_gate=w(args.intermediate_size, args.hidden_size), w_up=w(args.intermediate_size, args.hidden_size),
                w_down=w(args.hidden_size, args.intermediate_size),
                w_input_layernorm=torch.ones(args.hidden_size),
                w_post_attention_layernorm=torch.ones(args.hidden_size),
                max_seq_len=args.max_position_embeddings,
                theta=args.rope_theta,
                use_flash_attention=enable_flash_attn,
            )
            self.layers_inner.append(layer)
        self.norm = RMSNorm(args.hidden_size, weight=torch.ones(args.hidden_size), eps=args.rms_norm_eps)

    def __call__(self, inputs, offset: int, cache: list):
        h = self.embedding_weight[inputs]
        for layer in range(self.num_hidden_layers):
            h = self.layers_inner[layer](h, offset, cache[layer], mask="causal")
        h = self.norm(h)
        return torch.matmul(h, self.embedding_weight.T)


# ---- generate.py ----
def simple_generate_with_kv_cache(model: Qwen2ModelWeek2, prompt_ids: list, eos_token_id: int, max_new: int):
    kv_cache = [TinyKvFullCache() for _ in range(model.num_hidden_layers)]

    def _step(model, y, offset, kv_cache):
        logits = model(y[None], offset, kv_cache)
        logits = logits[:, -1, :]
        logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        sampler = lambda x: torch.argmax(x, dim=-1)
        y = sampler(logprobs)
        return y, logprobs.squeeze(0)

    # prefill with the prompt
    tokens = torch.tensor(prompt_ids)
    out = []
    last_logprobs = []
    if FIXED:
        offset = 0
    else:
        offset = tokens.numel()
    # generate/decode
    while True:
        token, logprobs = _step(model, tokens, offset, kv_cache)
        if token.item() == eos_token_id:
            break
        out.append(token.item())
        last_logprobs.append(logprobs.max().item())
        if len(out) == max_new:
            break
        if FIXED:
            # The first iteration of this loop is prefill. We want to add the offset to the prefilled token size.
            # Otherwise, we add the decoded token size (which is always 1).
            offset += tokens.numel()
        else:
            offset += token.numel()
        tokens = token
    return out, last_logprobs


def main():
    torch.manual_seed(0)
    model = Qwen2ModelWeek2(Args())
    prompt_ids = [5, 17, 42, 8, 23, 61, 3, 77, 12, 30]
    out, lps = simple_generate_with_kv_cache(model, prompt_ids, eos_token_id=0, max_new=12)
    print("generated:", out)
    print("top logprobs:", [round(x, 4) for x in lps])


if __name__ == "__main__":
    main()
