# skyzh/tiny-llm commit ae06a7f ("fix bugs in continuous batching"), src/tiny_llm_ref/kv_cache.py
# (BatchingKvCache), qwen2_week2.py, attention.py and generate.py (batch_generate).
# Continuous batching: each prompt is prefilled alone into a TinyKvFullCache (chunked, mask "causal"), then
# BatchingKvCache.add_request copies its keys/values into row `id` of the batch cache, and all active requests
# decode together one token per step, each rotated at its own offset.
# Before the fix the batch cache was a zero-filled (max_active_requests, H, max_seq_len, D) ring with one shared
# head: a request's prompt keys were put just before the head, the rest of its row stayed zeros, update_and_fetch
# returned the whole max_seq_len row, and the model passed mask=None for every one-token step, so each decoding
# request also attended to the zero keys (score 0) of every slot it never wrote. Fix: keep each request's keys and
# values as its own entry, stack them right-aligned to the longest request, and return a per-request (B, L, S)
# mask, causal over the request's own S keys and -inf elsewhere; the model passes mask="causal" always and the
# cache's mask replaces it (the grouped attention reshapes it to (B, 1, 1, 1, L, S)).
# (Qwen2ModelWeek2 with tiny random float weights in torch instead of MLX and quantized layers; a character
# tokenizer stands in for the Qwen tokenizer.)
import sys
from typing import Optional

import torch

FIXED = "--fixed" in sys.argv


# ---- basics.py -------------------------------------------------------------------------------------------
def softmax(x: torch.Tensor, axis: int) -> torch.Tensor:
    return torch.softmax(x, dim=axis)


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    if bias is not None:
        return torch.matmul(x, w.T) + bias
    else:
        return torch.matmul(x, w.T)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


# ---- attention.py ----------------------------------------------------------------------------------------
def causal_mask(L: int, S: int, dtype: torch.dtype) -> torch.Tensor:
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

    if FIXED:
        query = query.reshape(*B, -1, H, n_repeats, L, D)
        key = key.reshape(*B, -1, H, 1, S, D)
        value = value.reshape(*B, -1, H, 1, S, D)
    else:
        query = query.reshape(-1, H, n_repeats, L, D)
        key = key.reshape(-1, H, 1, S, D)
        value = value.reshape(-1, H, 1, S, D)

    scores = torch.matmul(query, key.transpose(-2, -1)) * factor
    if mask is not None:
        if isinstance(mask, str) and mask == "causal":
            mask = causal_mask(L, S, scores.dtype)
            scores = scores + mask
        else:
            if FIXED:
                mask = mask.reshape(*B, 1, 1, 1, mask.shape[-2], mask.shape[-1])
            else:
                mask = mask.reshape(-1, H, n_repeats, mask.shape[-2], mask.shape[-1])
            scores = scores + mask
    result = torch.matmul(softmax(scores, axis=-1), value)
    return result.reshape(expected_shape)


# ---- positional_encoding.py ------------------------------------------------------------------------------
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

    def __call__(self, x: torch.Tensor, offset=None) -> torch.Tensor:
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
        real = torch.multiply(x1, cos_basis) - torch.multiply(x2, sin_basis)
        imag = torch.multiply(x2, cos_basis) + torch.multiply(x1, sin_basis)
        if self.traditional:
            y = torch.stack([real, imag], dim=-1)
            y = y.reshape(N, S, H, D)
        else:
            y = torch.cat([real, imag], dim=-1)
            y = y.reshape(N, S, H, D)
        return y.to(x.dtype)


# ---- layer_norm.py / embedding.py ------------------------------------------------------------------------
class RMSNorm:
    def __init__(self, dim: int, weight: torch.Tensor, eps: float = 1e-5):
        self.dim = dim
        self.eps = eps
        self.weight = weight.to(torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        return (self.weight * x * torch.rsqrt(torch.mean(torch.square(x), dim=-1, keepdim=True) + self.eps)).to(
            orig_dtype
        )


class Embedding:
    def __init__(self, vocab_size: int, embedding_dim: int, weight: torch.Tensor):
        self.vocab_size = vocab_size
        self.embedding_dim = embedding_dim
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight[x, :]

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


# ---- kv_cache.py -----------------------------------------------------------------------------------------
class TinyKvCache:
    def update_and_fetch(self, key, value, q_L=None):
        pass


if not FIXED:

    class BatchingKvCache(TinyKvCache):
        def __init__(self, max_active_requests: int, max_seq_len: int):
            self.max_active_requests = max_active_requests
            self.max_seq_len = max_seq_len
            self.key_values = None
            self.head_offsets = torch.tensor([0] * max_active_requests)
            self.head = 0

        def update_and_fetch(self, key, value, q_L=None):
            B, H, L, D = key.shape
            assert key.shape == value.shape
            assert L <= self.max_seq_len
            keys, values = self.key_values
            if self.head + L <= self.max_seq_len:
                keys[:, :, self.head : self.head + L, :] = key
                values[:, :, self.head : self.head + L, :] = value
                self.head += L
                self.head_offsets += L
            else:
                fill_size = self.max_seq_len - self.head
                keys[:, :, self.head : self.max_seq_len, :] = key[:, :, :fill_size, :]
                values[:, :, self.head : self.max_seq_len, :] = value[:, :, :fill_size, :]
                remaining_size = L - fill_size
                keys[:, :, :remaining_size, :] = key[:, :, fill_size:, :]
                values[:, :, :remaining_size, :] = value[:, :, fill_size:, :]
                self.head = remaining_size
                self.head_offsets += L
            self.key_values = (keys, values)

            before_keys = keys[:, :, self.head :, :]
            before_values = values[:, :, self.head :, :]
            after_keys = keys[:, :, : self.head, :]
            after_values = values[:, :, : self.head, :]
            keys = torch.cat([after_keys, before_keys], dim=2)
            values = torch.cat([after_values, before_values], dim=2)
            return keys, values, self.head_offsets, None

        def add_request(self, prefilled: TinyKvCache, id: int):
            if id >= self.max_active_requests:
                raise ValueError(f"Request id {id} is out of range")
            keys, values = prefilled.key_values
            B, H, L, D = keys.shape
            assert B == 1
            if self.key_values is None:
                self.key_values = (
                    torch.zeros((self.max_active_requests, H, self.max_seq_len, D)),
                    torch.zeros((self.max_active_requests, H, self.max_seq_len, D)),
                )
            if L > self.max_seq_len:
                keys = keys[:, :, -self.max_seq_len :, :]
                values = values[:, :, -self.max_seq_len :, :]
                take_size = self.max_seq_len
            else:
                take_size = L
            cached_keys, cached_values = self.key_values
            # Firstly, fill the cache with zeros
            cached_keys[id, :, :, :] = 0
            cached_values[id, :, :, :] = 0
            # Then, fill the cache with the prefilled values up to self.head (may wrap)
            start_pos = (self.head - take_size + self.max_seq_len) % self.max_seq_len
            if start_pos + take_size <= self.max_seq_len:
                cached_keys[id, :, start_pos : start_pos + take_size, :] = keys[0, :, :, :]
                cached_values[id, :, start_pos : start_pos + take_size, :] = values[0, :, :, :]
            else:
                cached_keys[id, :, start_pos : self.max_seq_len, :] = keys[0, :, : self.max_seq_len - start_pos, :]
                cached_values[id, :, start_pos : self.max_seq_len, :] = values[
                    0, :, : self.max_seq_len - start_pos, :
                ]
                cached_keys[id, :, : take_size - (self.max_seq_len - start_pos), :] = keys[
                    0, :, self.max_seq_len - start_pos :, :
                ]
                cached_values[id, :, : take_size - (self.max_seq_len - start_pos), :] = values[
                    0, :, self.max_seq_len - start_pos :, :
                ]
            self.head_offsets[id] = L
            self.key_values = (cached_keys, cached_values)

        def remove_request(self, id: int):
            if self.key_values is None:
                raise ValueError(f"Request id {id} is not in the cache")
            cached_keys, cached_values = self.key_values
            cached_keys[id, :, :, :] = 0
            cached_values[id, :, :, :] = 0

else:

    class BatchingKvCache(TinyKvCache):
        def __init__(self, max_active_requests: int, max_seq_len: int):
            self.max_active_requests = max_active_requests
            self.max_seq_len = max_seq_len
            self.key_values = [None] * max_active_requests
            self.real_seq_len = [0] * max_active_requests
            self.HD = None

        def update_and_fetch(self, key, value, q_L=None):
            B, H, S, D = key.shape
            assert key.shape == value.shape
            assert S <= self.max_seq_len
            assert self.HD == (H, D), f"expect {self.HD} but got {H, D}"
            assert B == self.max_active_requests
            # Step 1: append the result to the cache
            for b in range(B):
                if self.key_values[b] is None:
                    continue
                cached_keys, cached_values = self.key_values[b]
                keys, values = key[b], value[b]
                keys = torch.cat([cached_keys, keys], dim=1)
                values = torch.cat([cached_values, values], dim=1)
                self.key_values[b] = (keys, values)
                self.real_seq_len[b] += S
            # Step 2: compute seq_len of this batch
            seq_len = max(self.real_seq_len)
            # Step 3: generate masks and a single array of keys and values
            keys = torch.zeros((self.max_active_requests, H, seq_len, D), dtype=key.dtype)
            values = torch.zeros((self.max_active_requests, H, seq_len, D), dtype=value.dtype)
            masks = torch.full((self.max_active_requests, q_L, seq_len), -torch.inf, dtype=key.dtype)
            for b in range(B):
                if self.key_values[b] is None:
                    # for some reasons we need to do this, otherwise it will cause wrong output?
                    # maybe precision issues?
                    masks[b, :, :] = causal_mask(q_L, seq_len, dtype=key.dtype)
                    continue
                cached_keys, cached_values = self.key_values[b]
                S = self.real_seq_len[b]
                keys[b, :, seq_len - S : seq_len, :] = cached_keys
                values[b, :, seq_len - S : seq_len, :] = cached_values
                masks[b, :, seq_len - S : seq_len] = causal_mask(q_L, S, dtype=key.dtype)
            return keys, values, None, masks

        def add_request(self, prefilled: TinyKvCache, id: int):
            if id >= self.max_active_requests:
                raise ValueError(f"Request id {id} is out of range")
            keys, values = prefilled.key_values
            B, H, L, D = keys.shape
            assert B == 1
            if self.HD is None:
                self.HD = (H, D)
            else:
                assert self.HD == (H, D)
            self.real_seq_len[id] = L
            self.key_values[id] = (keys[0], values[0])

        def remove_request(self, id: int):
            if self.key_values is None:
                raise ValueError(f"Request id {id} is not in the cache")
            self.key_values[id] = None
            self.real_seq_len[id] = 0


class TinyKvFullCache(TinyKvCache):
    def __init__(self):
        self.key_values = None
        self.offset = 0

    def update_and_fetch(self, key, value, q_L=None):
        if self.key_values is None:
            assert self.offset == 0
            self.key_values = (key, value)
            B, H, S, D = key.shape
            self.offset = S
            return key, value, 0, None
        else:
            B, H, S, D = key.shape
            assert key.shape == value.shape
            prev_keys, prev_values = self.key_values
            assert prev_keys.shape == (B, H, self.offset, D)
            assert prev_values.shape == (B, H, self.offset, D)
            new_keys = torch.cat([prev_keys, key], dim=2)
            new_values = torch.cat([prev_values, value], dim=2)
            self.key_values = (new_keys, new_values)
            start_offset = self.offset
            self.offset += S
            return new_keys, new_values, start_offset, None


# ---- qwen2_week2.py --------------------------------------------------------------------------------------
class Qwen2MultiHeadAttention:
    def __init__(self, hidden_size, num_heads, num_kv_heads, wq, wk, wv, wo, bq, bk, bv, max_seq_len=32768,
                 theta=1000000):
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        assert hidden_size % num_heads == 0
        assert num_heads % num_kv_heads == 0
        self.head_dim = hidden_size // num_heads
        self.scale = float(self.head_dim) ** -0.5
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.bq, self.bk, self.bv = bq, bk, bv
        self.rope = RoPE(self.head_dim, max_seq_len, theta)

    def __call__(self, x, offsets, cache: TinyKvCache, mask=None):
        B, L, _ = x.shape
        projection_q = linear(x, self.wq, bias=self.bq).reshape(B, L, self.num_heads, self.head_dim)
        projection_k = linear(x, self.wk, bias=self.bk).reshape(B, L, self.num_kv_heads, self.head_dim)
        projection_v = linear(x, self.wv, bias=self.bv).reshape(B, L, self.num_kv_heads, self.head_dim)
        if isinstance(offsets, int):
            offset_slice = [slice(int(offsets), int(offsets + L))]
        else:
            offset_slice = [slice(int(i), int(i + L)) for i in offsets]
        projection_q = self.rope(projection_q, offset=offset_slice)
        projection_k = self.rope(projection_k, offset=offset_slice)
        projection_q = projection_q.transpose(1, 2)
        projection_k = projection_k.transpose(1, 2)
        projection_v = projection_v.transpose(1, 2)
        projection_k, projection_v, _, kv_cache_mask = cache.update_and_fetch(projection_k, projection_v, q_L=L)
        if kv_cache_mask is not None:
            mask = kv_cache_mask
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
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down

    def __call__(self, x):
        return linear(silu(linear(x, self.w_gate)) * linear(x, self.w_up), self.w_down)


class Qwen2TransformerBlock:
    def __init__(self, num_attention_heads, num_kv_heads, hidden_size, intermediate_size, rms_norm_eps, wq, wk, wv,
                 wo, bq, bk, bv, w_gate, w_up, w_down, w_input_layernorm, w_post_attention_layernorm,
                 max_seq_len=32768, theta=1000000):
        self.mlp = Qwen2MLP(hidden_size, intermediate_size, w_gate, w_up, w_down)
        self.input_layernorm = RMSNorm(hidden_size, w_input_layernorm, eps=rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, w_post_attention_layernorm, eps=rms_norm_eps)
        self.self_attn = Qwen2MultiHeadAttention(
            num_heads=num_attention_heads, hidden_size=hidden_size, num_kv_heads=num_kv_heads,
            wq=wq, wk=wk, wv=wv, wo=wo, bq=bq, bk=bk, bv=bv, max_seq_len=max_seq_len, theta=theta,
        )

    def __call__(self, x, offset, cache, mask=None):
        r = self.self_attn(self.input_layernorm(x), offset, cache, mask)
        h = x + r
        r = self.mlp(self.post_attention_layernorm(h))
        return h + r


class ModelArgs:
    num_hidden_layers = 2
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    intermediate_size = 128
    vocab_size = 96
    rms_norm_eps = 1e-6
    max_position_embeddings = 256
    rope_theta = 10000
    tie_word_embeddings = False


class Qwen2ModelWeek2:
    def __init__(self, args: ModelArgs, seed: int = 0):
        g = torch.Generator().manual_seed(seed)

        def w(*shape, std=0.08):
            return torch.randn(*shape, generator=g) * std

        self.num_hidden_layers = args.num_hidden_layers
        self.hidden_size = args.hidden_size
        self.vocab_size = args.vocab_size
        hd = args.hidden_size // args.num_attention_heads
        kv = args.num_key_value_heads * hd
        self.embedding = Embedding(args.vocab_size, args.hidden_size, w(args.vocab_size, args.hidden_size, std=1.0))
        self.layers_inner = []
        for _ in range(args.num_hidden_layers):
            self.layers_inner.append(
                Qwen2TransformerBlock(
                    num_attention_heads=args.num_attention_heads,
                    num_kv_heads=args.num_key_value_heads,
                    hidden_size=args.hidden_size,
                    intermediate_size=args.intermediate_size,
                    rms_norm_eps=args.rms_norm_eps,
                    wq=w(args.hidden_size, args.hidden_size, std=0.15),
                    wk=w(kv, args.hidden_size, std=0.15),
                    wv=w(kv, args.hidden_size, std=0.3),
                    wo=w(args.hidden_size, args.hidden_size, std=0.3),
                    bq=w(args.hidden_size),
                    bk=w(kv),
                    bv=w(kv),
                    w_gate=w(args.intermediate_size, args.hidden_size),
                    w_up=w(args.intermediate_size, args.hidden_size),
                    w_down=w(args.hidden_size, args.intermediate_size),
                    w_input_layernorm=torch.ones(args.hidden_size),
                    w_post_attention_layernorm=torch.ones(args.hidden_size),
                    max_seq_len=args.max_position_embeddings,
                    theta=args.rope_theta,
                )
            )
        self.norm = RMSNorm(args.hidden_size, weight=torch.ones(args.hidden_size), eps=args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.w_lm_head = w(args.vocab_size, args.hidden_size, std=0.3)
        else:
            self.w_lm_head = None

    def __call__(self, inputs, offset, cache):
        h = self.embedding(inputs)
        for layer in range(self.num_hidden_layers):
            if FIXED:
                h = self.layers_inner[layer](h, offset, cache[layer], mask="causal")
            else:
                h = self.layers_inner[layer](h, offset, cache[layer], mask="causal" if h.shape[1] > 1 else None)
        h = self.norm(h)
        if self.w_lm_head is not None:
            return linear(h, self.w_lm_head)
        else:
            return self.embedding.as_linear(h)


# ---- tokenizer stand-in ----------------------------------------------------------------------------------
class CharDetokenizer:
    def __init__(self):
        self.tokens = []

    def add_token(self, token: int):
        self.tokens.append(token)

    @property
    def text(self):
        return "".join(chr(ord(" ") + t) for t in self.tokens)


class CharTokenizer:
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False):
        return [ord(c) - ord(" ") for c in text]

    def new_detokenizer(self):
        return CharDetokenizer()


# ---- generate.py -----------------------------------------------------------------------------------------
def _step(model, y, offsets, kv_cache):
    logits = model(y, offsets, kv_cache)
    logits = logits[:, -1, :]
    logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    sampler = lambda x: torch.argmax(x, dim=-1)
    y = sampler(logprobs)
    return y


class _PrefillRequest:
    def __init__(self, model, tokenizer, prompt: str, max_step: int = 128):
        self.prompt = prompt
        self.kv_cache = [TinyKvFullCache() for _ in range(model.num_hidden_layers)]
        self.model = model
        self.prefill_tokens = torch.tensor(tokenizer.encode(prompt, add_special_tokens=False))
        self.offset = 0
        self.max_step = max_step

    def prefill(self):
        # returns None if prefill is not done
        tokens_to_prefill = min(self.max_step, self.prefill_tokens.numel() - self.offset)
        token = _step(
            self.model,
            self.prefill_tokens[self.offset : self.offset + tokens_to_prefill][None],
            [self.offset],
            self.kv_cache,
        )
        self.offset += tokens_to_prefill
        if self.offset == self.prefill_tokens.numel():
            return token, self.kv_cache, self.offset
        else:
            return None


def batch_generate(model, tokenizer, prompts: list[str], max_seq_len=512, batch_size=5, prefill_step=128):
    is_idle = [True] * batch_size
    prompt_idx = [0] * batch_size
    next_tokens = torch.tensor([0] * batch_size)
    offsets = torch.tensor([0] * batch_size)
    detokenizers = [None] * batch_size
    kv_cache = [
        BatchingKvCache(max_active_requests=batch_size, max_seq_len=max_seq_len)
        for _ in range(model.num_hidden_layers)
    ]
    result = []
    pending_prefill_requests = None

    print(f"Processing {len(prompts)} prompts")
    prompts = enumerate(prompts)
    more_prompts = True
    while True:
        if not more_prompts and all(is_idle):
            break
        # prefill until no idle slots
        while any(is_idle) and more_prompts and pending_prefill_requests is None:
            try:
                idx, prompt = next(prompts)
            except StopIteration:
                more_prompts = False
                break
            pending_prefill_requests = _PrefillRequest(model, tokenizer, prompt, prefill_step)
            break

        if pending_prefill_requests is not None:
            res = pending_prefill_requests.prefill()
            if res is not None:
                pending_prefill_requests = None
                token, prefill_kv_cache, offset = res

                if token.item() == tokenizer.eos_token_id:
                    # if the first token is eos, we skip this prompt
                    continue

                for i in range(batch_size):
                    if is_idle[i]:
                        detokenizers[i] = tokenizer.new_detokenizer()
                        detokenizers[i].add_token(token.item())
                        prompt_idx[i] = idx
                        is_idle[i] = False
                        for prefill_cache, batch_cache in zip(prefill_kv_cache, kv_cache):
                            batch_cache.add_request(prefill_cache, i)
                        next_tokens[i] = token
                        offsets[i] = offset
                        break

        if not all(is_idle):
            next_tokens = torch.as_tensor(next_tokens)
            # decode
            next_tokens = _step(model, next_tokens.reshape(-1, 1), offsets, kv_cache)
            offsets += 1
            for i in range(batch_size):
                if not is_idle[i]:
                    detokenizers[i].add_token(next_tokens[i].item())
                    remove_due_to_eos = next_tokens[i].item() == tokenizer.eos_token_id
                    remove_due_to_max_seq_len = offsets[i] >= max_seq_len
                    if remove_due_to_eos or remove_due_to_max_seq_len:
                        reason = "EOS" if remove_due_to_eos else "Max Seq Len"
                        result.append((prompt_idx[i], detokenizers[i].tokens))
                        print(f"Removing request {i} due to {reason}", flush=True)
                        batch_cache.remove_request(i)
                        is_idle[i] = True
                        continue
    return result


def main():
    torch.manual_seed(0)
    model = Qwen2ModelWeek2(ModelArgs(), seed=0)
    tokenizer = CharTokenizer()
    prompts = [
        "Shanghai is a city",
        "What is MLX?",
        "Tell me a short story about a cat",
        "2+2=",
        "The Yangtze River flows",
    ]
    result = batch_generate(model, tokenizer, prompts, max_seq_len=40, batch_size=3, prefill_step=8)
    for prompt_idx, tokens in sorted(result):
        print(f"--- {prompt_idx} ---")
        print(f"Q: {prompts[prompt_idx]}")
        print(f"A: {tokens}")


if __name__ == "__main__":
    main()
