"""vLLM v1 FlashAttention: the KV cache group's sliding window applied to the group's global layers.

Citation: vllm-project/vllm#51756 ("[Bugfix] Take the sliding window from the layer, not the KV
cache group"), vllm/v1/attention/backends/flash_attn.py (FlashAttentionMetadataBuilder.build,
FlashAttentionImpl.forward) and vllm/v1/core/kv_cache_utils.py (_promote_local_kv_cache_specs).

The bug: with the hybrid KV cache manager disabled (``--disable-hybrid-kv-cache-manager``), a
Gemma-3 style model has its SlidingWindowSpec layers promoted to FullAttentionSpec (the spec keeps
``sliding_window``) and all layers land in one KV cache group whose merged spec records the window.
``FlashAttentionMetadataBuilder.build`` turns ``kv_cache_spec.sliding_window`` into
``attn_metadata.sliding_window = (w - 1, 0)`` and ``FlashAttentionImpl.forward`` prefers
``attn_metadata.sliding_window`` over the layer's own ``self.sliding_window``, so the global
layers in that group also attend only to the last w keys.

The fix: the layer's own window wins over the group's (``self.sliding_window``, symmetrized for
non-causal attention).

Trimmed port at toy sizes: one request, block_size 4, a paged KV cache written through
``slot_mapping`` (reshape_and_cache_flash) and read through ``block_table``; layer 0 is a
sliding layer (sliding_window 4), layer 1 a global one. ``flash_attn_varlen_func`` is a CPU
stand-in for vllm_flash_attn's kernel (paged keys, bottom-right causal, inclusive
``window_size=(left, right)``). A 10-token prompt is prefilled, then 4 greedy decode steps.
"""

import sys
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


# ---- vllm/v1/kv_cache_interface.py -------------------------------------------------------------
@dataclass(frozen=True)
class AttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    @classmethod
    def merge(cls, specs):
        sliding_window = set(
            spec.sliding_window for spec in specs if spec.sliding_window is not None
        )
        assert len(sliding_window) <= 1, "All sliding windows in a group must match"
        s = specs[0]
        return cls(
            block_size=s.block_size,
            num_kv_heads=s.num_kv_heads,
            head_size=s.head_size,
            dtype=s.dtype,
            sliding_window=sliding_window.pop() if sliding_window else None,
        )


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = 0

    @classmethod
    def merge(cls, specs):
        assert all(type(s) is cls and s == specs[0] for s in specs)
        return specs[0]


@dataclass
class KVCacheGroupSpec:
    layer_names: list
    kv_cache_spec: AttentionSpec


# ---- vllm/v1/core/kv_cache_utils.py ------------------------------------------------------------
def _promote_local_kv_cache_specs(kv_cache_spec):
    """Use full-attention allocation for local-attention cache specs.

    The returned specs affect KV cache management only. Attention modules keep
    their original sliding-window or chunked-local compute behavior.
    """
    promoted_specs = kv_cache_spec.copy()
    has_full_attention = any(isinstance(s, FullAttentionSpec) for s in kv_cache_spec.values())
    has_sliding_window = any(isinstance(s, SlidingWindowSpec) for s in kv_cache_spec.values())
    if has_full_attention and has_sliding_window:
        for layer_name, spec in kv_cache_spec.items():
            if isinstance(spec, SlidingWindowSpec):
                promoted_specs[layer_name] = FullAttentionSpec(
                    block_size=spec.block_size,
                    num_kv_heads=spec.num_kv_heads,
                    head_size=spec.head_size,
                    dtype=spec.dtype,
                    sliding_window=spec.sliding_window,
                )
    return promoted_specs


def get_kv_cache_groups(kv_cache_spec, disable_hybrid_kv_cache_manager):
    if disable_hybrid_kv_cache_manager:
        kv_cache_spec.update(_promote_local_kv_cache_specs(kv_cache_spec))
        layer_specs = list(kv_cache_spec.values())
        return [KVCacheGroupSpec(list(kv_cache_spec), type(layer_specs[0]).merge(layer_specs))]
    groups = {}
    for name, spec in kv_cache_spec.items():
        groups.setdefault(spec, []).append(name)
    return [KVCacheGroupSpec(names, spec) for spec, names in groups.items()]


# ---- vllm/v1/attention/backends/flash_attn.py --------------------------------------------------
@dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True


@dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    sliding_window: tuple | None = None


def _maybe_symmetrize_window(window, causal):
    non_causal = isinstance(causal, torch.Tensor) or causal is False
    if window is not None and window[0] >= 0 and window[1] == 0 and non_causal:
        return (window[0], window[0])
    return window


class FlashAttentionMetadataBuilder:
    def __init__(self, kv_cache_spec, layer_names):
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names

    def build(self, common_prefix_len, common_attn_metadata):
        causal = common_attn_metadata.causal
        # Symmetrize the spec's sliding_window for non-causal attention
        group_sliding_window = getattr(self.kv_cache_spec, "sliding_window", None)
        base_window = (
            (-1, -1) if group_sliding_window is None else (group_sliding_window - 1, 0)
        )
        effective_sliding_window = _maybe_symmetrize_window(base_window, causal)
        return FlashAttentionMetadata(
            num_actual_tokens=common_attn_metadata.num_actual_tokens,
            max_query_len=common_attn_metadata.max_query_len,
            query_start_loc=common_attn_metadata.query_start_loc,
            max_seq_len=common_attn_metadata.max_seq_len,
            seq_lens=common_attn_metadata.seq_lens,
            block_table=common_attn_metadata.block_table_tensor,
            slot_mapping=common_attn_metadata.slot_mapping,
            causal=causal,
            sliding_window=effective_sliding_window,
        )


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    block_size = key_cache.shape[1]
    n = slot_mapping.shape[0]
    blk, off = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blk, off] = key[:n]
    value_cache[blk, off] = value[:n]


def flash_attn_varlen_func(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
                           softmax_scale, causal, window_size, block_table):
    # CPU stand-in for vllm_flash_attn: paged K/V, bottom-right aligned causal mask and an
    # inclusive (left, right) window; -1 means unbounded.
    block_size = k.shape[1]
    left, right = window_size
    for i in range(cu_seqlens_q.shape[0] - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        lq, lk = qe - qs, int(seqused_k[i])
        nblk = (lk + block_size - 1) // block_size
        blocks = block_table[i, :nblk]
        ki = k[blocks].reshape(-1, k.shape[2], k.shape[3])[:lk]
        vi = v[blocks].reshape(-1, v.shape[2], v.shape[3])[:lk]
        qi = q[qs:qe]
        rep = qi.shape[1] // ki.shape[1]
        ki, vi = ki.repeat_interleave(rep, dim=1), vi.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * softmax_scale
        qpos = torch.arange(lq)[:, None] + (lk - lq)
        kpos = torch.arange(lk)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            allowed &= kpos <= qpos
        elif right >= 0:
            allowed &= kpos <= qpos + right
        if left >= 0:
            allowed &= kpos >= qpos - left
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi)
    return out


class FlashAttentionImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads, sliding_window):
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        if sliding_window is None:
            self.sliding_window = (-1, -1)
        else:
            self.sliding_window = (sliding_window - 1, 0)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        num_actual_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        reshape_and_cache_flash(key, value, key_cache, value_cache, attn_metadata.slot_mapping)

        if FIXED:
            # The layer's own window wins over the group's: one KV cache group can hold
            # both windowed and global layers.
            window = _maybe_symmetrize_window(self.sliding_window, attn_metadata.causal)
        else:
            window = (
                attn_metadata.sliding_window
                if attn_metadata.sliding_window is not None
                else self.sliding_window
            )
        sliding_window_size = list(window) if window is not None else None

        flash_attn_varlen_func(
            q=query[:num_actual_tokens],
            k=key_cache,
            v=value_cache,
            out=output[:num_actual_tokens],
            cu_seqlens_q=attn_metadata.query_start_loc,
            max_seqlen_q=attn_metadata.max_query_len,
            seqused_k=attn_metadata.seq_lens,
            max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=attn_metadata.causal,
            window_size=sliding_window_size,
            block_table=attn_metadata.block_table,
        )
        return output


# ---- a Gemma-3 style toy model (layer 0 sliding, layer 1 global) -------------------------------
class Config:
    vocab_size = 50
    hidden_size = 32
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 8
    sliding_window = 4
    layer_types = ["sliding_attention", "full_attention"]


class Attention(nn.Module):
    def __init__(self, config, prefix):
        super().__init__()
        self.layer_name = prefix
        h, hd = config.num_attention_heads, config.head_dim
        kvh = config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, h * hd, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kvh * hd, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kvh * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, config.hidden_size, bias=False)
        idx = int(prefix.split(".")[-2])
        self.sliding_window = (
            config.sliding_window if config.layer_types[idx] == "sliding_attention" else None
        )
        self.impl = FlashAttentionImpl(h, hd, hd ** -0.5, kvh, self.sliding_window)
        self.num_heads, self.num_kv_heads, self.head_size = h, kvh, hd
        self.kv_cache = None

    def get_kv_cache_spec(self, block_size):
        if self.sliding_window is not None:
            return SlidingWindowSpec(block_size, self.num_kv_heads, self.head_size,
                                     torch.float32, sliding_window=self.sliding_window)
        return FullAttentionSpec(block_size, self.num_kv_heads, self.head_size, torch.float32)

    def forward(self, x, attn_metadata):
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_size)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_size)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_size)
        out = torch.empty_like(q)
        self.impl.forward(self, q, k, v, self.kv_cache, attn_metadata[self.layer_name], out)
        return self.o_proj(out.reshape(n, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config, prefix):
        super().__init__()
        self.self_attn = Attention(config, prefix=f"{prefix}.self_attn")
        self.norm1 = nn.LayerNorm(config.hidden_size)
        self.norm2 = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.GELU(),
                                 nn.Linear(64, config.hidden_size))

    def forward(self, x, attn_metadata):
        x = x + self.self_attn(self.norm1(x), attn_metadata)
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, f"model.layers.{i}") for i in range(len(config.layer_types))
        )
        self.pos = nn.Embedding(64, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, attn_metadata):
        x = self.embed_tokens(input_ids) + self.pos(positions)
        for layer in self.layers:
            x = layer(x, attn_metadata)
        return self.lm_head(x)


# ---- a one-request model runner ----------------------------------------------------------------
def main():
    torch.manual_seed(0)
    config = Config()
    model = Model(config).eval()
    block_size, num_blocks = 4, 8
    attn_layers = {m.self_attn.layer_name: m.self_attn for m in model.layers}

    kv_cache_spec = {name: a.get_kv_cache_spec(block_size) for name, a in attn_layers.items()}
    groups = get_kv_cache_groups(kv_cache_spec, disable_hybrid_kv_cache_manager=True)
    builders = [FlashAttentionMetadataBuilder(g.kv_cache_spec, g.layer_names) for g in groups]
    for name, a in attn_layers.items():
        a.kv_cache = torch.zeros(2, num_blocks, block_size, a.num_kv_heads, a.head_size)

    block_table = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    prompt = torch.tensor([3, 17, 8, 42, 5, 11, 29, 2, 36, 14])
    tokens = prompt.tolist()
    num_computed = 0
    generated, last_logits = [], None
    with torch.no_grad():
        for step in range(5):
            new = torch.tensor(tokens[num_computed:])
            positions = torch.arange(num_computed, len(tokens))
            seq_len = len(tokens)
            common = CommonAttentionMetadata(
                query_start_loc=torch.tensor([0, len(new)], dtype=torch.int32),
                seq_lens=torch.tensor([seq_len], dtype=torch.int32),
                num_reqs=1,
                num_actual_tokens=len(new),
                max_query_len=len(new),
                max_seq_len=seq_len,
                block_table_tensor=block_table,
                slot_mapping=block_table[0, positions // block_size] * block_size
                + positions % block_size,
            )
            attn_metadata = {}
            for g, b in zip(groups, builders):
                md = b.build(0, common)
                for name in g.layer_names:
                    attn_metadata[name] = md
            logits = model(new, positions, attn_metadata)
            last_logits = logits[-1]
            nxt = int(last_logits.argmax())
            num_computed = seq_len
            tokens.append(nxt)
            generated.append(nxt)
    print("kv cache groups:", [(g.layer_names, g.kv_cache_spec.sliding_window) for g in groups])
    print("generated:", generated)
    print("last logits[:6]:", [round(x, 4) for x in last_logits[:6].tolist()])


if __name__ == "__main__":
    main()
