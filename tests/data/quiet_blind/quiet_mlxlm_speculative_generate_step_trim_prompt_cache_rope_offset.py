"""mlx-lm's speculative decoding (draft model + target verify, batch 1), ported from MLX to torch.

Ported from ml-explore/mlx-lm @d78bf58e217c904ec282ed8da9b947491f78c022:
  mlx_lm/generate.py       speculative_generate_step (_step, _prefill, _rewind_cache,
                           _draft_generate, the accept loop); logits processors and KV
                           quantization left out
  mlx_lm/models/cache.py   KVCache (step-256 buffer, offset, update_and_fetch, trim,
                           make_mask), make_prompt_cache, can_trim_prompt_cache,
                           trim_prompt_cache, create_attention_mask(N, offset, ...)
  mlx_lm/models/base.py    create_causal_mask; the "causal" string mask as
                           quantized_scaled_dot_product_attention reads it (queries are the
                           last qL of kL keys: q_indices = arange(kL - qL, kL))
  mlx_lm/models/llama.py   Attention (rope(q/k, offset=cache.offset) before
                           update_and_fetch), TransformerBlock, LlamaModel, Model (lm_head or
                           tied embeddings, make_cache)

Each model keeps its own list of KVCache.  A forward over N new tokens gets RoPE positions
offset .. offset+N-1 from the cache length and, for N > 1, the "causal" mask aligned to the
bottom right of the (N, offset+N) score matrix; a single token gets no mask.  The target
verifies [last token, draft_1 .. draft_k] in one forward; on the first mismatch the target
cache is trimmed by the rejected drafts and the draft cache by the drafts it fed itself
past the accepted ones, so the next forward's positions follow from the shorter offset and
the stale slots of the buffer are overwritten.

Checks: the tokens and log-probabilities streamed equal plain greedy decoding of the target
with no cache (full sequence recomputed each step), for several draft lengths, with both
accepted and rejected drafts seen; after each run the kept cache slots of both models equal
a fresh no-cache prefill over the same tokens; and a second turn that reuses the caches
(trimmed to a common length) continues exactly like greedy decoding over the whole history.
"""

import copy
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


# ------------------------------------------------------------------ mlx_lm/models/base.py
@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params):
        import inspect

        return cls(**{k: v for k, v in params.items() if k in inspect.signature(cls).parameters})


def create_causal_mask(
    N: int,
    offset: int = 0,
    window_size: Optional[int] = None,
):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    return mask


def create_attention_mask(h, cache=None, window_size: Optional[int] = None, return_array: bool = False):
    N = h.shape[1]
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, window_size=window_size)
    return "causal"


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask):
    # mx.fast.scaled_dot_product_attention: the "causal" string means the queries are the
    # last qL positions of the kL keys (as the dense fallback in base.py spells it out).
    if isinstance(mask, str):
        qL, kL = queries.shape[-2], keys.shape[-2]
        q_indices = torch.arange(kL - qL, kL)
        k_indices = torch.arange(kL)
        mask = q_indices[:, None] >= k_indices[None]
    return F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )


# ------------------------------------------------------------------ mlx_lm/models/cache.py
def make_prompt_cache(model: nn.Module, max_kv_size: Optional[int] = None) -> List[Any]:
    if hasattr(model, "make_cache"):
        return model.make_cache()
    num_layers = len(model.layers)
    return [KVCache() for _ in range(num_layers)]


def can_trim_prompt_cache(cache: List[Any]) -> bool:
    return all(c.is_trimmable() for c in cache)


def trim_prompt_cache(cache: List[Any], num_tokens: int) -> List[Any]:
    if not can_trim_prompt_cache(cache) or len(cache) == 0:
        return 0
    return [c.trim(num_tokens) for c in cache][0]


def cache_create_attention_mask(N: int, offset: int, return_array: bool, window_size: Optional[int]):
    if window_size is not None:
        return create_causal_mask(N, offset, window_size=window_size)
    elif N == 1:
        return None
    elif return_array:
        return create_causal_mask(N, offset, window_size=window_size)
    else:
        return "causal"


class KVCache:
    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        prev = self.offset
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            v_head_dim = values.shape[3]
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            k_shape = (B, n_kv_heads, n_steps * self.step, k_head_dim)
            v_shape = (B, n_kv_heads, n_steps * self.step, v_head_dim)
            new_k = torch.zeros(k_shape, dtype=keys.dtype)
            new_v = torch.zeros(v_shape, dtype=values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v

        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def size(self):
        return self.offset

    @property
    def state(self):
        if self.offset == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(self, *args, **kwargs):
        return cache_create_attention_mask(*args, offset=self.offset, **kwargs)

    def empty(self):
        return self.keys is None


# ------------------------------------------------------------------ mlx_lm/models/llama.py
@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    head_dim: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float = 10000
    rope_traditional: bool = False
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads


class RoPE(nn.Module):
    """mlx.nn.RoPE(dims, traditional=False, base): rotates the two halves of each head."""

    def __init__(self, dims: int, traditional: bool = False, base: float = 10000, scale: float = 1.0):
        super().__init__()
        assert not traditional
        self.dims = dims
        self.base = base
        self.scale = scale

    def forward(self, x, offset: int = 0):
        L = x.shape[-2]
        half = self.dims // 2
        inv_freq = self.base ** (-torch.arange(0, half, dtype=torch.float32) / half)
        positions = (torch.arange(offset, offset + L, dtype=torch.float32) * self.scale)[:, None]
        theta = positions * inv_freq[None]
        cos, sin = theta.cos().to(x.dtype), theta.sin().to(x.dtype)
        x1, x2 = x[..., :half], x[..., half : self.dims]
        rx = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        if self.dims < x.shape[-1]:
            rx = torch.cat([rx, x[..., self.dims :]], dim=-1)
        return rx


def initialize_rope(dims, base, traditional, scaling_config=None, max_position_embeddings=None):
    return RoPE(dims, traditional=traditional, base=base, scale=1.0)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim or args.hidden_size // n_heads
        self.scale = head_dim**-0.5
        attention_bias = args.attention_bias

        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=attention_bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=attention_bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=attention_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=attention_bias)

        self.rope = initialize_rope(self.head_dim, args.rope_theta, args.rope_traditional)

    def forward(self, x, mask=None, cache: Optional[Any] = None):
        B, L, D = x.shape

        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)

        queries = queries.reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)

        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)

        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)

        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        hidden_dim = args.intermediate_size
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=args.mlp_bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=args.mlp_bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=args.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache: Optional[Any] = None):
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = x + r
        r = self.mlp(self.post_attention_layernorm(h))
        return h + r


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.num_hidden_layers)])
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, cache=None):
        h = self.embed_tokens(inputs)

        if cache is None:
            cache = [None] * len(self.layers)

        mask = create_attention_mask(h, cache[0])

        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)

        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs, cache=None):
        out = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            out = out @ self.model.embed_tokens.weight.T  # embed_tokens.as_linear
        else:
            out = self.lm_head(out)
        return out

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        return [KVCache() for _ in self.layers]


# ------------------------------------------------------------------ mlx_lm/generate.py
def speculative_generate_step(
    prompt: torch.Tensor,
    model: nn.Module,
    draft_model: nn.Module,
    *,
    num_draft_tokens: int = 2,
    max_tokens: int = 256,
    sampler=None,
    prompt_cache: Optional[Any] = None,
    prefill_step_size: int = 512,
):
    """Yields (token, logprobs, from_draft) like mlx_lm.generate.speculative_generate_step."""
    y = prompt.to(torch.long)

    if prompt_cache is None:
        model_cache = make_prompt_cache(model)
        draft_cache = make_prompt_cache(draft_model)
    else:
        model_cache = prompt_cache[: len(model.layers)]
        draft_cache = prompt_cache[len(model.layers) :]

    if not can_trim_prompt_cache(model_cache):
        types = {type(c).__name__ for c in model_cache if not c.is_trimmable()}
        raise ValueError(f"Speculative decoding requires a trimmable prompt cache (got {types}).")

    sampler = sampler or (lambda x: torch.argmax(x, dim=-1))

    def _process_and_sample(tokens, logits):
        logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        y = sampler(logprobs)
        return y, logprobs

    def _step(model, cache, y, n_predict=1):
        logits = model(y[None], cache=cache)
        logits = logits[:, -n_predict:, :]
        return _process_and_sample(None, logits.squeeze(0))

    def _prefill(model, cache, y):
        while y.numel() > 1:
            n_to_process = min(prefill_step_size, y.numel() - 1)
            model(y[:n_to_process][None], cache=cache)
            y = y[n_to_process:]
        return y

    def _rewind_cache(num_draft, num_accept):
        trim_prompt_cache(model_cache, num_draft - num_accept)
        trim_prompt_cache(draft_cache, max(num_draft - num_accept - 1, 0))

    def _draft_generate(y, num_draft):
        if num_draft == 0:
            return torch.tensor([], dtype=torch.long)
        ys = []
        for _ in range(num_draft):
            y, _ = _step(draft_model, draft_cache, y)
            ys.append(y)
        return torch.cat(ys)

    draft_y = _prefill(draft_model, draft_cache, y)
    y = _prefill(model, model_cache, y)

    ntoks = 0
    # Set these so the finally block doesn't raise
    num_draft = 0
    n = 0
    try:
        while True:
            num_draft = min(max_tokens - ntoks, num_draft_tokens)
            draft_tokens = _draft_generate(draft_y, num_draft)
            y = torch.cat([y, draft_tokens])
            tokens, logprobs = _step(model, model_cache, y, num_draft + 1)
            draft_tokens = draft_tokens.tolist()
            tokens = tokens.tolist()
            n = 0
            while n < num_draft:
                tn, dtn, lpn = tokens[n], draft_tokens[n], logprobs[n]
                if tn != dtn:
                    break
                n += 1
                ntoks += 1
                yield tn, lpn, True
                if ntoks == max_tokens:
                    break
            if ntoks < max_tokens:
                ntoks += 1
                yield tokens[n], logprobs[n], False

            if ntoks == max_tokens:
                break

            y = torch.tensor([tokens[n]], dtype=torch.long)
            draft_y = y

            # If we accepted all the draft tokens, include the last
            # draft token in the next draft step since it hasn't been
            # processed yet by the draft model
            if n == num_draft:
                draft_y = torch.cat([torch.tensor(draft_tokens[-1:], dtype=torch.long), draft_y])

            _rewind_cache(num_draft, n)
    finally:
        _rewind_cache(num_draft, n)


# ------------------------------------------------------------------ checks
def greedy_reference(model, tokens: List[int], max_tokens: int):
    """Plain greedy decoding, the whole sequence recomputed with no cache at every step."""
    tokens = list(tokens)
    out, lps = [], []
    for _ in range(max_tokens):
        logits = model(torch.tensor([tokens]))[0, -1]
        lp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        t = int(lp.argmax())
        out.append(t)
        lps.append(lp)
        tokens.append(t)
    return out, lps


def prefill_kv(model, tokens: List[int]):
    """Per-layer (keys, values) after RoPE of a fresh no-cache forward over tokens."""
    kv = []
    h = model.model.embed_tokens(torch.tensor([tokens]))
    mask = create_attention_mask(h, None)
    for layer in model.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        B, L, _ = x.shape
        k = attn.rope(attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(1, 2))
        v = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(1, 2)
        kv.append((k, v))
        h = layer(h, mask)
    return kv


def check_cache(model, cache, tokens: List[int], what: str):
    ref = prefill_kv(model, tokens[: cache[0].offset])
    for c, (k, v) in zip(cache, ref):
        ck, cv = c.state
        assert ck.shape == k.shape, (what, ck.shape, k.shape)
        torch.testing.assert_close(ck, k, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what} keys: {m}")
        torch.testing.assert_close(cv, v, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what} values: {m}")


def run_turn(model, draft_model, prompt_ids, history_in_cache, max_tokens, num_draft_tokens, prompt_cache):
    """One generation call; history_in_cache are the tokens the prompt_cache already holds."""
    got, got_lps, from_draft = [], [], []
    for tok, lp, fd in speculative_generate_step(
        torch.tensor(prompt_ids),
        model,
        draft_model,
        num_draft_tokens=num_draft_tokens,
        max_tokens=max_tokens,
        prompt_cache=prompt_cache,
        prefill_step_size=5,
    ):
        got.append(tok)
        got_lps.append(lp)
        from_draft.append(fd)
    full = history_in_cache + prompt_ids
    ref, ref_lps = greedy_reference(model, full, max_tokens)
    assert got == ref, (num_draft_tokens, got, ref)
    for a, b in zip(got_lps, ref_lps):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    return full + got, from_draft


def count_rounds(from_draft: List[bool], num_draft_tokens: int):
    """(rounds whose drafts were all accepted, rounds cut short by a rejected draft)."""
    full = cut = 0
    run = 0
    for fd in from_draft:
        if fd:
            run += 1
            continue
        if run == num_draft_tokens:
            full += 1
        else:
            cut += 1
        run = 0
    return full, cut


def main():
    torch.set_num_threads(1)  # tiny single-sequence ops: threading only adds overhead
    torch.manual_seed(0)
    args = ModelArgs.from_dict(
        dict(
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=3,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=96,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        )
    )
    model = Model(args).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.1)
    # The draft: the target with its weights perturbed, so it agrees often but not always.
    draft_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft_model.parameters():
            p.add_(0.1 * p.abs().mean() * torch.randn(p.shape, generator=g))

    prompt = torch.randint(0, args.vocab_size, (13,), generator=g).tolist()
    all_accepted = rejected = 0
    with torch.inference_mode():
        for num_draft_tokens, max_tokens in [(1, 17), (2, 24), (3, 25), (5, 31)]:
            model_cache = make_prompt_cache(model)
            draft_cache = make_prompt_cache(draft_model)
            prompt_cache = model_cache + draft_cache

            history, from_draft = run_turn(model, draft_model, prompt, [], max_tokens, num_draft_tokens, prompt_cache)
            full, cut = count_rounds(from_draft, num_draft_tokens)
            all_accepted += full
            rejected += cut
            # After the generator's finally the caches hold a prefix of prompt + output.
            assert model_cache[0].offset <= len(history) and draft_cache[0].offset <= len(history)
            check_cache(model, model_cache, history, f"target k={num_draft_tokens}")
            check_cache(draft_model, draft_cache, history, f"draft k={num_draft_tokens}")

            # Second turn reusing the caches: trim both to a common length, feed the rest.
            common = min(model_cache[0].offset, draft_cache[0].offset)
            trim_prompt_cache(model_cache, model_cache[0].offset - common)
            trim_prompt_cache(draft_cache, draft_cache[0].offset - common)
            user = torch.randint(0, args.vocab_size, (4,), generator=g).tolist()
            history2, from_draft = run_turn(
                model, draft_model, history[common:] + user, history[:common], 12, num_draft_tokens, prompt_cache
            )
            full, cut = count_rounds(from_draft, num_draft_tokens)
            all_accepted += full
            rejected += cut
            check_cache(model, model_cache, history2, f"target turn 2 k={num_draft_tokens}")
            check_cache(draft_model, draft_cache, history2, f"draft turn 2 k={num_draft_tokens}")

    assert all_accepted > 0 and rejected > 0, (all_accepted, rejected)
    print(f"speculative decoding matches greedy: {all_accepted} rounds took every draft, {rejected} rejected one")


if __name__ == "__main__":
    main()
