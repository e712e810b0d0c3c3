# Citation: pytorch/executorch examples/models/llama/attention.py (KVCache, SDPA, _create_causal_mask_for_ring_buffer,
#   CachePositionsManager.calculate_positions_and_update_indices, RingKVCache with a cache of 2 * window and
#   create_causal_mask_for_ring_buffer, AttentionMHA.forward: the ring mask replaces mask.narrow(0, start_pos, seqlen)
#   when kv_cache.is_ring_buffer), examples/models/llama/source_transformation/custom_kv_cache.py
#   (replace_kv_cache_with_ring_kv_cache / _replace_kv_cache_with_ring_kv_cache: a layer_sizes pattern repeated over
#   the layers, a RingKVCache of that window per layer), examples/models/llama/rope.py (precompute_freqs_cis,
#   apply_rotary_emb, Rope.get_freqs narrowing at input_pos[-1]) and llama_transformer.py (TransformerBlock,
#   Transformer.forward with attn_options={"input_pos": ...}), read at the version whose RingKVCache doubles its size.
# A Mistral-style model: every layer sliding (layer_sizes = [SLIDING_WINDOW], as the llama export's
# --local_global_attention option takes it), enable_dynamic_shape=True so input_pos is the one-element start
# position. A batch of three prompts of the same length (ExecuTorch's caches share input_pos across the batch, no
# padding) is prefilled in chunks no longer than the window, then decoded greedily one token a step; the ring of
# 2 * window slots wraps several times. Checked against a per-sequence, cache-free recompute whose mask is a double
# loop (j <= i and i - j < window): every chunk's full logits, every decode step's logits, and the greedy tokens.
import logging
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

SLIDING_WINDOW = 5


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = 2
    head_dim: Optional[int] = None
    vocab_size: int = 61
    hidden_dim: int = 64
    norm_eps: float = 1e-5
    max_batch_size: int = 3
    max_seq_len: int = 64
    max_context_len: int = 64
    rope_freq_base: float = 10000.0
    use_kv_cache: bool = True
    enable_dynamic_shape: bool = True
    generate_full_logits: bool = True

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads


# --- rope.py ---------------------------------------------------------------------------------------------------------


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    freqs_cos = torch.cos(freqs)
    freqs_sin = torch.sin(freqs)
    return freqs_cos, freqs_sin


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
    ndim = x.ndim
    # freqs_cis: (seq_len, head_dim // 2)
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(shape)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    xq_r, xq_i = xq.float().reshape(xq.shape[:-1] + (-1, 2)).unbind(-1)
    xk_r, xk_i = xk.float().reshape(xk.shape[:-1] + (-1, 2)).unbind(-1)

    freqs_cos = reshape_for_broadcast(freqs_cos, xq_r)
    freqs_sin = reshape_for_broadcast(freqs_sin, xq_r)

    xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin
    xq_out_i = xq_r * freqs_sin + xq_i * freqs_cos
    xk_out_r = xk_r * freqs_cos - xk_i * freqs_sin
    xk_out_i = xk_r * freqs_sin + xk_i * freqs_cos

    xq_out = torch.stack([xq_out_r, xq_out_i], dim=-1).flatten(3)
    xk_out = torch.stack([xk_out_r, xk_out_i], dim=-1).flatten(3)

    return xq_out.type_as(xq), xk_out.type_as(xk)


class RotaryEmbedding(torch.nn.Module):
    def forward(self, xq, xk, freqs_cos, freqs_sin):
        return apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)


class Rope(torch.nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        self.params = params
        freqs_cos, freqs_sin = precompute_freqs_cis(
            self.params.head_dim, self.params.max_seq_len, self.params.rope_freq_base
        )
        self.register_buffer("freqs_cos", freqs_cos, persistent=False)
        self.register_buffer("freqs_sin", freqs_sin, persistent=False)
        self.apply_rotary_emb = RotaryEmbedding()

    def forward(self, q, k, freqs_cos, freqs_sin):
        return self.apply_rotary_emb(q, k, freqs_cos, freqs_sin)

    def get_freqs(self, input_pos: Optional[torch.Tensor], seq_len: int):
        if self.params.use_kv_cache:
            assert input_pos is not None, "input_pos must be provided when use_kv_cache is True"

            if self.params.enable_dynamic_shape:
                # when KV cache is used, seqlen is most likely 1. We want to slice from the start_pos.
                input_pos_item = input_pos[-1].item()
                torch._check_is_size(input_pos_item)
                torch._check(input_pos_item < self.params.max_seq_len)
                freqs_cos = self.freqs_cos.narrow(0, input_pos_item, seq_len)
                freqs_sin = self.freqs_sin.narrow(0, input_pos_item, seq_len)
            else:
                freqs_cos = self.freqs_cos[input_pos]
                freqs_sin = self.freqs_sin[input_pos]
        else:
            assert input_pos is None, "input_pos is unused when use_kv_cache is False"
            freqs_cos = self.freqs_cos[:seq_len]
            freqs_sin = self.freqs_sin[:seq_len]
        return freqs_cos, freqs_sin


# --- norm.py ---------------------------------------------------------------------------------------------------------


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


# --- attention.py ----------------------------------------------------------------------------------------------------


class KVCache(nn.Module):
    def __init__(
        self,
        max_batch_size: int,
        max_context_length: int,
        n_heads: int,
        head_dim: int,
        enable_dynamic_shape: bool,
        dtype=torch.float32,
    ):
        super().__init__()
        self.max_context_length = max_context_length
        cache_shape = (max_batch_size, n_heads, max_context_length, head_dim)

        self.max_batch_size = max_batch_size
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.enable_dynamic_shape = enable_dynamic_shape
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype, device="cpu"))
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype, device="cpu"))

    def update(
        self, input_pos: torch.Tensor, k_val: torch.Tensor, v_val: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        # input_pos: [S], k_val: [B, H, S, D]
        if self.enable_dynamic_shape:
            start_pos = input_pos[0].item()
            torch._check_is_size(start_pos)
            torch._check(start_pos < self.max_context_length)
            dim_to_slice = 2
            seq_length = k_val.size(dim_to_slice)
            indices = torch.arange(seq_length) + start_pos
            self.k_cache.index_copy_(dim_to_slice, indices, k_val)
            self.v_cache.index_copy_(dim_to_slice, indices, v_val)
            return self.k_cache, self.v_cache
        else:
            k_out = self.k_cache
            v_out = self.v_cache
            k_out[:, :, input_pos] = k_val
            v_out[:, :, input_pos] = v_val

            return k_out, v_out


class SDPA(nn.Module):
    def __init__(self, dim: int, head_dim: int, n_rep: int, max_context_len: int):
        super().__init__()
        self.dim = dim
        self.head_dim = head_dim
        self.n_rep = n_rep
        self.max_context_len = max_context_len

    def forward(
        self,
        input_pos: torch.Tensor,
        q: torch.Tensor,  # Already have rotary embeddings. (bs, n_local_heads, seqlen, head_dim)
        k: torch.Tensor,  # Already have rotary embeddings. (bs, n_local_kv_heads, seqlen, head_dim)
        v: torch.Tensor,  # (bs, n_local_kv_heads, seqlen, head_dim)
        bsz,
        seqlen,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)

        return y.transpose(1, 2).reshape(bsz, seqlen, self.dim)


def _create_causal_mask_for_ring_buffer(cache_positions, window_size, start_pos, seq_len):
    pos_q = start_pos + torch.arange(seq_len, dtype=torch.long).view(-1, 1)
    delta = pos_q - cache_positions
    attn_mask = (cache_positions >= 0) & (delta >= 0) & (delta < window_size)
    attn_mask = torch.where(attn_mask == True, 0, float("-inf"))  # noqa E712
    return attn_mask


class CacheUpdateStrategy(Enum):
    RING_BUFFER = "RingBuffer"
    INVALID = "Invalid"


class CachePositionsManager(nn.Module):
    def __init__(
        self,
        max_context_length: int,
        cache_update_strategy: CacheUpdateStrategy = CacheUpdateStrategy.RING_BUFFER,
    ):
        super().__init__()
        assert cache_update_strategy == CacheUpdateStrategy.RING_BUFFER, "Only RingBuffer is supported"
        self.max_context_length = max_context_length
        self.register_buffer(
            "cache_positions",
            torch.zeros((self.max_context_length), dtype=torch.long, device="cpu"),
        )

    def calculate_positions_and_update_indices(self, input_pos: torch.Tensor, seq_len):
        """
        Indices into k_cache / v_cache where the new keys go (position % cache size), and the cache_positions
        buffer updated to say which position each slot holds; a slot never written holds the sentinel -1.
        """
        start_pos = input_pos[0].item()
        torch._check_is_size(start_pos)
        orig_indices = torch.arange(seq_len, dtype=torch.long) + start_pos
        indices = orig_indices % self.max_context_length

        full_t = torch.full((self.max_context_length,), -1, dtype=torch.long)
        arange_tensor = torch.arange(self.max_context_length, dtype=torch.long)
        cache_positions = torch.where(arange_tensor < start_pos, self.cache_positions, full_t)
        self.cache_positions.copy_(cache_positions)
        self.cache_positions.index_copy_(0, indices, orig_indices)

        return indices


class RingKVCache(KVCache):
    def __init__(
        self,
        max_batch_size: int,
        max_context_length: int,
        n_heads: int,
        head_dim: int,
        enable_dynamic_shape: bool,
        dtype=torch.float32,
    ):
        self.window_size = max_context_length
        # The cache is twice the window so that a chunk written at start_pos does not evict the keys
        # [start_pos - window + 1, start_pos) its own first queries still need; the mask keeps the window.
        super().__init__(
            max_batch_size,
            max_context_length * 2,
            n_heads,
            head_dim,
            enable_dynamic_shape,
            dtype,
        )
        self.cache_positions_manager = CachePositionsManager(self.max_context_length)
        self.is_ring_buffer = True

    def create_causal_mask_for_ring_buffer(self, start_pos, seq_len):
        cache_positions = self.cache_positions_manager.cache_positions
        return _create_causal_mask_for_ring_buffer(cache_positions, self.window_size, start_pos, seq_len)

    def update(
        self, input_pos: torch.Tensor, k_val: torch.Tensor, v_val: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        # input_pos: [S], k_val: [B, H, S, D]
        seq_len = k_val.size(2)
        assert seq_len <= self.k_cache.size(
            2
        ), f"Update sequence length({seq_len}) for kv cache must be smaller than the cache size({self.k_cache.size(2)})"
        indices = self.cache_positions_manager.calculate_positions_and_update_indices(input_pos, seq_len)
        if self.enable_dynamic_shape:
            start_pos = input_pos[0].item()
            torch._check_is_size(start_pos)

            self.k_cache.index_copy_(2, indices, k_val)
            self.v_cache.index_copy_(2, indices, v_val)
        else:
            self.k_cache[:, :, indices] = k_val
            self.v_cache[:, :, indices] = v_val

        return self.k_cache, self.v_cache


class AttentionMHA(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, rope: Rope):
        super().__init__()
        self.use_kv_cache = args.use_kv_cache
        self.n_heads = args.n_heads
        self.n_kv_heads = self.n_heads if args.n_kv_heads is None else args.n_kv_heads
        assert self.n_heads % self.n_kv_heads == 0
        model_parallel_size = 1
        self.n_local_heads = self.n_heads // model_parallel_size
        self.n_local_kv_heads = self.n_kv_heads // model_parallel_size
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.head_dim
        self.max_batch_size = args.max_batch_size
        self.max_context_len = args.max_context_len
        self.dim = args.dim
        self.enable_dynamic_shape = args.enable_dynamic_shape

        self.wq = nn.Linear(self.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(self.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(self.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, self.dim, bias=False)

        self.layer_id = layer_id
        self.rope = rope

        causal_mask = torch.tril(
            torch.ones(self.max_context_len, self.max_context_len, dtype=torch.bool, device="cpu")
        )
        self.register_buffer("mask", causal_mask, persistent=False)

        if self.use_kv_cache:
            self.kv_cache = KVCache(
                args.max_batch_size,
                args.max_context_len,
                self.n_kv_heads,
                self.head_dim,
                args.enable_dynamic_shape,
            )
            self.SDPA = SDPA(
                dim=self.n_local_heads * self.head_dim,
                head_dim=self.head_dim,
                n_rep=self.n_rep,
                max_context_len=self.max_context_len,
            )

    def forward(
        self, x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, **kwargs
    ) -> Tuple[torch.Tensor, Optional[Any]]:
        input_pos = kwargs.get("input_pos")
        bsz, seqlen, _ = x.shape

        # QKV
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)

        # RoPE relative positional embeddings
        q, k = self.rope.forward(q, k, freqs_cos, freqs_sin)

        q = q.transpose(1, 2)  # (bs, n_local_heads, seqlen, head_dim)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)

        if self.use_kv_cache:
            assert input_pos is not None
            if self.enable_dynamic_shape:
                start_pos = input_pos[-1].item()
                torch._check_is_size(start_pos)
                torch._check(start_pos < self.max_context_len)
                seq_length = q.size(2)
                attn_mask = self.mask.narrow(0, start_pos, seq_length)
            else:
                # mask is always 2D
                attn_mask = self.mask[input_pos]
            k, v = self.kv_cache.update(input_pos, k, v)
            if getattr(self.kv_cache, "is_ring_buffer", False):
                attn_mask = self.kv_cache.create_causal_mask_for_ring_buffer(input_pos[0].item(), seqlen)
            output = self.SDPA(input_pos, q, k, v, bsz, seqlen, attn_mask)
            return self.wo(output), None

        # grouped multiquery attention: expand out keys and values
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)

        mask = self.mask[:seqlen, :seqlen]

        output = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        output = output.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(output), None


# --- llama_transformer.py --------------------------------------------------------------------------------------------


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, attention: AttentionMHA):
        super().__init__()
        self.use_kv_cache = args.use_kv_cache
        self.n_heads = args.n_heads
        self.dim = args.dim
        self.head_dim = args.head_dim
        self.attention = attention
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cos, freqs_sin, attn_options: Dict[str, Any]):  # x: 1xN
        h, attn_options_update = self.attention.forward(
            self.attention_norm(x), freqs_cos, freqs_sin, **attn_options
        )
        h = x + h
        out = h + self.feed_forward(self.ffn_norm(h))
        return out, attn_options_update


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs, layers: nn.ModuleList, rope: Rope):
        super().__init__()
        self.params = params
        self.vocab_size = params.vocab_size
        self.n_layers = params.n_layers
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = layers
        self.rope = rope
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        self.use_kv_cache = params.use_kv_cache
        self.generate_full_logits = params.generate_full_logits
        self.max_seq_len = params.max_seq_len

    def forward(
        self,
        tokens: Optional[torch.LongTensor] = None,
        attn_options: Optional[Dict[str, Any]] = None,
        h: Optional[torch.FloatTensor] = None,
    ) -> torch.Tensor:
        if (tokens is None) ^ (h is not None):
            raise ValueError("You cannot specify both tokens and h at the same time, and must specify either one")
        if tokens is not None and h is None:
            h = self.tok_embeddings(tokens)

        if attn_options is None:
            attn_options = {}
        seqlen = h.shape[1]
        freqs_cos, freqs_sin = self.rope.get_freqs(attn_options.get("input_pos"), seqlen)

        attn_options_update = None
        for layer in self.layers:
            h, attn_options_update = layer(h, freqs_cos, freqs_sin, attn_options)
            if attn_options_update is not None:
                attn_options.update(**attn_options_update)

        if not self.generate_full_logits:
            # Only the last logit is used for the new generated token
            h = h[:, -1, :]

        h = self.norm(h)
        logits = self.output(h)
        return logits


def construct_transformer(model_args: ModelArgs) -> Transformer:
    rope = Rope(model_args)
    layers = torch.nn.ModuleList()
    for layer_id in range(model_args.n_layers):
        attention = AttentionMHA(model_args, layer_id, rope)
        layers.append(TransformerBlock(model_args, attention))
    return Transformer(model_args, layers, rope)


# --- source_transformation/custom_kv_cache.py ------------------------------------------------------------------------


def _replace_kv_cache_with_ring_kv_cache(attention, layer_size):
    sliding_window_size = layer_size
    assert getattr(attention, "kv_cache", None) is not None, "Attention module must have kv_cache module"
    kv_cache = attention.kv_cache
    if isinstance(kv_cache, KVCache):
        attention.kv_cache = RingKVCache(
            kv_cache.max_batch_size,
            sliding_window_size,
            kv_cache.n_heads,
            kv_cache.head_dim,
            kv_cache.enable_dynamic_shape,
            kv_cache.k_cache.dtype,
        )


def replace_kv_cache_with_ring_kv_cache(module, layer_sizes):
    assert len(module.layers) >= len(
        layer_sizes
    ), f"Length of layer sizes {len(layer_sizes)} must match the number of layers in the module {len(module.layers)}."
    multiplier = len(module.layers) // len(layer_sizes)
    modulo = len(module.layers) % len(layer_sizes)
    assert modulo == 0, (
        "num layers specified must be multiple of model layers in order to specify pattern. "
        f"pattern: {layer_sizes} model's num layers {len(module.layers)}"
    )
    layer_sizes = layer_sizes * multiplier
    logging.info(f"Applying local sliding window attention with following pattern {layer_sizes}.")
    assert len(layer_sizes) == len(
        module.layers
    ), f"Length of layer sizes {len(layer_sizes)} must match the number of layers in the module {len(module.layers)}."
    for i, transformer_block in enumerate(module.layers):
        sliding_window_size = layer_sizes[i]
        if sliding_window_size == 0:
            continue
        attention = transformer_block.attention
        _replace_kv_cache_with_ring_kv_cache(attention, sliding_window_size)
    return module


# --- the runner: chunked prefill, then greedy decode ----------------------------------------------------------------


@torch.no_grad()
def generate(model: Transformer, prompt_tokens: torch.Tensor, max_new_tokens: int, prefill_chunk: int):
    """prompt_tokens: (B, T), all rows the same length. Returns the generated tokens and every forward's logits."""
    bsz, prompt_len = prompt_tokens.shape
    all_logits: List[torch.Tensor] = []
    pos = 0
    logits = None
    while pos < prompt_len:
        chunk = prompt_tokens[:, pos : pos + prefill_chunk]
        logits = model.forward(tokens=chunk, attn_options={"input_pos": torch.tensor([pos], dtype=torch.long)})
        all_logits.append(logits)
        pos += chunk.shape[1]

    generated = []
    next_token = torch.argmax(logits[:, -1, :], dim=-1)
    for _ in range(max_new_tokens):
        generated.append(next_token)
        logits = model.forward(
            tokens=next_token.view(bsz, 1),
            attn_options={"input_pos": torch.tensor([pos], dtype=torch.long)},
        )
        all_logits.append(logits)
        pos += 1
        next_token = torch.argmax(logits[:, -1, :], dim=-1)
    generated.append(next_token)
    return torch.stack(generated, dim=1), torch.cat(all_logits, dim=1)


# --- reference: one sequence at a time, no cache, the window as a double loop -----------------------------------------


@torch.no_grad()
def reference_logits(model: Transformer, tokens: torch.Tensor, window: int) -> torch.Tensor:
    """tokens: (T,). Logits (T, vocab) for every position, attending keys j with j <= i and i - j < window."""
    T = tokens.shape[0]
    params = model.params
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            allowed[i, j] = j <= i and i - j < window
    freqs_cos, freqs_sin = model.rope.freqs_cos[:T], model.rope.freqs_sin[:T]
    h = model.tok_embeddings(tokens)[None]
    for layer in model.layers:
        attn = layer.attention
        x = layer.attention_norm(h)
        q = attn.wq(x).view(1, T, params.n_heads, params.head_dim)
        k = attn.wk(x).view(1, T, params.n_kv_heads, params.head_dim)
        v = attn.wv(x).view(1, T, params.n_kv_heads, params.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cos, freqs_sin)
        out = torch.zeros(T, params.n_heads, params.head_dim)
        for hd in range(params.n_heads):
            kv = hd // (params.n_heads // params.n_kv_heads)
            for i in range(T):
                js = allowed[i].nonzero().flatten()
                scores = (k[0, js, kv] @ q[0, i, hd]) / params.head_dim**0.5
                out[i, hd] = torch.softmax(scores, dim=0) @ v[0, js, kv]
        h = h + attn.wo(out.reshape(1, T, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h))[0]


def main():
    params = ModelArgs()
    model = construct_transformer(params)
    model.eval()
    # Mistral-style: every layer slides over the same window.
    replace_kv_cache_with_ring_kv_cache(model, [SLIDING_WINDOW])
    for block in model.layers:
        assert isinstance(block.attention.kv_cache, RingKVCache)
        assert block.attention.kv_cache.k_cache.shape[2] == 2 * SLIDING_WINDOW

    prompt_len, max_new_tokens = 17, 14
    prompts = torch.randint(1, params.vocab_size, (params.max_batch_size, prompt_len))
    generated, logits = generate(model, prompts, max_new_tokens, prefill_chunk=SLIDING_WINDOW)
    total = prompt_len + max_new_tokens
    assert logits.shape == (params.max_batch_size, total, params.vocab_size)

    worst = 0.0
    for b in range(params.max_batch_size):
        sequence = torch.cat([prompts[b], generated[b, :-1]])
        ref = reference_logits(model, sequence, SLIDING_WINDOW)
        err = (logits[b] - ref).abs().max().item()
        worst = max(worst, err)
        assert err < 1e-4, (b, err)
        assert torch.equal(ref[prompt_len - 1 :].argmax(-1), generated[b]), b
    print(
        f"batch {params.max_batch_size} x prompt {prompt_len} prefilled in chunks of {SLIDING_WINDOW}, "
        f"{max_new_tokens} decode steps, ring of {2 * SLIDING_WINDOW} slots: "
        f"max |logit - reference| = {worst:.2e}"
    )
    print("generated:", generated.tolist())


if __name__ == "__main__":
    main()
