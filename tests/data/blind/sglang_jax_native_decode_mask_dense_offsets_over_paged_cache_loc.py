# Citation: sgl-project/sglang-jax#1297 ("native attention backend: garbage/empty output ..."),
#   fixed by PR sgl-project/sglang-jax#1557 (re-submission of #1502); decode half is commit bf4ede6b
#   ("fix(attention): page-align native decode mask boundaries (#1297)").
# Upstream: python/sgl_jax/srt/layers/attention/native_backend.py (NativeAttention.__call__,
#   forward_attention, _apply_extend_mask, _apply_decode_mask) and
#   python/sgl_jax/srt/managers/schedule_batch.py (ScheduleBatch._merge_cache_loc).
#   JAX code ported to torch, tiny sizes; the serving loop (per-request prefill, batched decode)
#   is written here in the scheduler's shape.
# Bug: decode `cache_loc` is laid out page-aligned per request (request i occupies
#   ceil(seq_len_i / page_size) * page_size slots at offset cumsum(aligned_lens)), but
#   _apply_decode_mask rebuilt each request's key range from a dense cumsum(seq_lens). With
#   page_size > 1 and several running requests, every request after the first gets a window that
#   slides onto the previous request's page tail and loses its own newest keys.
# Fix: pass page_size in and step seq_starts by the aligned lengths
#   (aligned = ceil(seq_len / page_size) * page_size), keeping each span at the real seq_len.
import sys
import math
import enum

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ForwardMode(enum.Enum):
    EXTEND = 1
    DECODE = 2

    def is_extend(self):
        return self == ForwardMode.EXTEND


# ---------------------------------------------------------------- KV pool (paged)
class MHATokenToKVPool:
    def __init__(self, num_pages, page_size, num_layers, kv_heads, head_dim):
        self.page_size = page_size
        size = num_pages * page_size
        self.k_buffer = [torch.zeros(size, kv_heads, head_dim) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(size, kv_heads, head_dim) for _ in range(num_layers)]

    def set_kv_buffer(self, layer_id, loc, k, v):
        self.k_buffer[layer_id][loc] = k
        self.v_buffer[layer_id][loc] = v

    def get_kv_buffer(self, layer_id):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]


class PagedTokenToKVPoolAllocator:
    """Page 0 is reserved (slot 0 is the padding slot), pages are handed out from 1."""

    def __init__(self, num_pages, page_size):
        self.page_size = page_size
        self.free_pages = list(range(1, num_pages))

    def alloc_extend(self, seq_len):
        n = (seq_len + self.page_size - 1) // self.page_size
        pages = [self.free_pages.pop(0) for _ in range(n)]
        slots = torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages])
        return slots[:seq_len]

    def alloc_decode(self, last_loc, seq_len_before):
        # next slot in the last page, or a fresh page when the last one is full
        if seq_len_before % self.page_size == 0:
            return self.free_pages.pop(0) * self.page_size
        return int(last_loc) + 1


# ---------------------------------------------------------------- attention backend
def forward_attention(
    q,
    k_cache,
    v_cache,
    seq_lengths,
    loc,
    extend_prefix_lens,
    extend_seq_lens,
    num_heads,
    num_kv_heads,
    scale=None,
    is_causal=True,
    mode=ForwardMode.DECODE,
    sliding_window_size=None,
    page_size=1,
):
    cache_size = k_cache.shape[0]
    safe_loc = torch.where(loc > 0, loc, torch.full_like(loc, cache_size))
    # jnp .at[].get(mode="fill", fill_value=0): out-of-range rows read as zeros
    k_cache = torch.cat([k_cache, torch.zeros_like(k_cache[:1])])[safe_loc]
    v_cache = torch.cat([v_cache, torch.zeros_like(v_cache[:1])])[safe_loc]

    num_tokens, hidden_size = q.shape
    head_dim = hidden_size // num_heads
    q_heads = q.reshape(num_tokens, num_heads, head_dim)
    k_heads, v_heads = k_cache, v_cache
    if num_kv_heads != num_heads:
        num_copies = num_heads // num_kv_heads
        k_heads = torch.repeat_interleave(k_heads, num_copies, dim=1)
        v_heads = torch.repeat_interleave(v_heads, num_copies, dim=1)

    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    attn_logits = torch.einsum("qhd,khd->qhk", q_heads, k_heads) * scale
    neg_inf = torch.finfo(attn_logits.dtype).min
    is_valid = loc > 0
    attn_logits = torch.where(is_valid[None, None, :], attn_logits, torch.tensor(neg_inf))

    if mode == ForwardMode.EXTEND:
        attn_logits = _apply_extend_mask(
            attn_logits, seq_lengths, extend_prefix_lens, extend_seq_lens, is_causal, sliding_window_size
        )
    else:
        if FIXED:
            attn_logits = _apply_decode_mask(attn_logits, seq_lengths, page_size, sliding_window_size)
        else:
            attn_logits = _apply_decode_mask(attn_logits, seq_lengths, sliding_window_size)

    max_logit = attn_logits.max(dim=-1, keepdim=True).values
    exp_logits = torch.exp(attn_logits - max_logit)
    attn_weights = exp_logits / exp_logits.sum(dim=-1, keepdim=True)
    attn_output = torch.einsum("qhk,khd->qhd", attn_weights, v_heads)
    return attn_output.reshape(num_tokens, num_heads * v_heads.shape[-1])


def _apply_extend_mask(attn_weights, seq_lengths, extend_prefix_lens, extend_seq_lens,
                       is_causal=True, sliding_window_size=None):
    query_len, _, key_len = attn_weights.shape
    q_valid_mask = torch.arange(query_len) < extend_seq_lens.sum()
    k_valid_mask = torch.arange(key_len) < seq_lengths.sum()

    q_starts = torch.cumsum(extend_seq_lens, 0) - extend_seq_lens
    q_batch_indicators = torch.zeros(query_len, dtype=torch.long)
    q_batch_indicators[q_starts] = 1
    q_batch_ids = torch.cumsum(q_batch_indicators, 0) - 1

    full_seq_lens = seq_lengths
    k_starts = torch.cumsum(full_seq_lens, 0) - full_seq_lens
    k_batch_indicators = torch.zeros(key_len, dtype=torch.long)
    k_batch_indicators[k_starts] = 1
    k_batch_ids = torch.cumsum(k_batch_indicators, 0) - 1

    final_mask = q_batch_ids[:, None] == k_batch_ids[None, :]
    if is_causal or sliding_window_size is not None:
        q_relative_positions = torch.arange(query_len) - q_starts[q_batch_ids]
        q_actual_positions = extend_prefix_lens[q_batch_ids] + q_relative_positions
        k_relative_positions = torch.arange(key_len) - k_starts[k_batch_ids]
        if is_causal:
            final_mask = final_mask & (q_actual_positions[:, None] >= k_relative_positions[None, :])
        if sliding_window_size is not None:
            final_mask = final_mask & (
                q_actual_positions[:, None] - k_relative_positions[None, :] < sliding_window_size
            )
    final_mask = final_mask & q_valid_mask[:, None] & k_valid_mask[None, :]
    mask_value = torch.finfo(attn_weights.dtype).min
    return torch.where(final_mask[:, None, :], attn_weights, torch.tensor(mask_value))


if FIXED:

    def _apply_decode_mask(attn_weights, seq_lengths, page_size, sliding_window_size=None):
        """Create a sequence mask that ensures tokens only attend within their sequence and window."""
        query_len, _, key_len = attn_weights.shape
        num_seqs = len(seq_lengths)

        def create_decode_sequence_mask():
            total_prefix_len = key_len
            # `cache_loc` blocks are page-aligned per request (_merge_cache_loc), so the offsets
            # step by aligned lengths while each span stays at the real length.
            aligned_lengths = ((seq_lengths + page_size - 1) // page_size) * page_size
            seq_starts = torch.cumsum(torch.cat([torch.tensor([0]), aligned_lengths[:-1]]), 0)
            seq_ends = seq_starts + seq_lengths
            all_positions = torch.arange(total_prefix_len)
            seq_mask = (all_positions[None, :] >= seq_starts[:, None]) & (
                all_positions[None, :] < seq_ends[:, None]
            )
            if sliding_window_size is not None:
                seq_mask = seq_mask & (all_positions[None, :] >= (seq_ends[:, None] - sliding_window_size))
            return seq_mask

        per_sequence_mask = create_decode_sequence_mask()
        final_mask = torch.zeros((query_len, key_len), dtype=torch.bool)
        final_mask[:num_seqs, :] = per_sequence_mask
        mask_value = torch.finfo(attn_weights.dtype).min
        return torch.where(final_mask[:, None, :], attn_weights, torch.tensor(mask_value))

else:

    def _apply_decode_mask(attn_weights, seq_lengths, sliding_window_size=None):
        """Create a sequence mask that ensures tokens only attend within their sequence and window."""
        query_len, _, key_len = attn_weights.shape
        num_seqs = len(seq_lengths)

        def create_decode_sequence_mask():
            total_prefix_len = key_len
            seq_starts = torch.cumsum(torch.cat([torch.tensor([0]), seq_lengths[:-1]]), 0)
            seq_ends = seq_starts + seq_lengths
            all_positions = torch.arange(total_prefix_len)
            seq_mask = (all_positions[None, :] >= seq_starts[:, None]) & (
                all_positions[None, :] < seq_ends[:, None]
            )
            if sliding_window_size is not None:
                seq_mask = seq_mask & (all_positions[None, :] >= (seq_ends[:, None] - sliding_window_size))
            return seq_mask

        per_sequence_mask = create_decode_sequence_mask()
        final_mask = torch.zeros((query_len, key_len), dtype=torch.bool)
        final_mask[:num_seqs, :] = per_sequence_mask
        mask_value = torch.finfo(attn_weights.dtype).min
        return torch.where(final_mask[:, None, :], attn_weights, torch.tensor(mask_value))


class ForwardBatch:
    def __init__(self, forward_mode, input_ids, positions, seq_lens, out_cache_loc, cache_loc,
                 extend_prefix_lens=None, extend_seq_lens=None):
        self.forward_mode = forward_mode
        self.input_ids = input_ids
        self.positions = positions
        self.seq_lens = seq_lens
        self.out_cache_loc = out_cache_loc
        self.cache_loc = cache_loc
        self.extend_prefix_lens = extend_prefix_lens
        self.extend_seq_lens = extend_seq_lens


class NativeAttention:
    def __init__(self, num_attn_heads, num_kv_heads):
        self.num_heads = num_attn_heads
        self.num_kv_heads = num_kv_heads

    def __call__(self, q, k, v, layer, forward_batch, token_to_kv_pool):
        token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buffer, v_buffer = token_to_kv_pool.get_kv_buffer(layer.layer_id)
        scale = 1.0 / math.sqrt(layer.head_dim)
        is_causal = forward_batch.forward_mode != ForwardMode.DECODE
        kwargs = dict(page_size=token_to_kv_pool.page_size) if FIXED else {}
        return forward_attention(
            q, k_buffer, v_buffer,
            forward_batch.seq_lens, forward_batch.cache_loc,
            forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens,
            self.num_heads, self.num_kv_heads, scale, is_causal, forward_batch.forward_mode,
            sliding_window_size=None, **kwargs,
        )


# ---------------------------------------------------------------- tiny Qwen-like model
def rope(x, positions, head_dim, base=10000.0):
    # x: [T, H, D]
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RadixAttention(nn.Module):
    def __init__(self, layer_id, hidden, num_heads, num_kv_heads):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = hidden // num_heads
        self.q_head_num, self.kv_head_num = num_heads, num_kv_heads
        self.q_proj = nn.Linear(hidden, num_heads * self.head_dim)
        self.k_proj = nn.Linear(hidden, num_kv_heads * self.head_dim)
        self.v_proj = nn.Linear(hidden, num_kv_heads * self.head_dim)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x, forward_batch, pool, backend):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.q_head_num, self.head_dim)
        k = self.k_proj(x).view(T, self.kv_head_num, self.head_dim)
        v = self.v_proj(x).view(T, self.kv_head_num, self.head_dim)
        q = rope(q, forward_batch.positions, self.head_dim)
        k = rope(k, forward_batch.positions, self.head_dim)
        out = backend(q.reshape(T, -1), k, v, self, forward_batch, pool)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, layer_id, hidden, heads, kv_heads):
        super().__init__()
        self.ln1 = nn.RMSNorm(hidden)
        self.ln2 = nn.RMSNorm(hidden)
        self.self_attn = RadixAttention(layer_id, hidden, heads, kv_heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.SiLU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x, fb, pool, backend):
        x = x + self.self_attn(self.ln1(x), fb, pool, backend)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, hidden=32, heads=4, kv_heads=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([DecoderLayer(i, hidden, heads, kv_heads) for i in range(layers)])
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, fb, pool, backend):
        x = self.embed(fb.input_ids)
        for layer in self.layers:
            x = layer(x, fb, pool, backend)
        return self.lm_head(self.norm(x))


# ---------------------------------------------------------------- scheduler side
PAGE_SIZE = 4
CACHE_LOC_PADDINGS = [64, 128]
BS_PADDINGS = [4, 8]


def pad_to_bucket(n, buckets):
    for i, b in enumerate(buckets):
        if n <= b:
            return b, i
    return buckets[-1], len(buckets) - 1


def _merge_cache_loc(req_to_token, req_pool_indices, seq_lens, page_size, mode):
    """ScheduleBatch._merge_cache_loc, dp_size = 1: each request's block starts page-aligned."""
    if mode.is_extend():
        total_cache_loc_size = CACHE_LOC_PADDINGS[-1]
    else:
        _, bs_index = pad_to_bucket(len(seq_lens), BS_PADDINGS)
        total_cache_loc_size = CACHE_LOC_PADDINGS[bs_index]
    cache_loc_cpu = torch.zeros(total_cache_loc_size, dtype=torch.long)
    aligned_lens = ((seq_lens + page_size - 1) // page_size) * page_size
    offsets = torch.zeros(len(seq_lens), dtype=torch.long)
    offsets[1:] = torch.cumsum(aligned_lens[:-1], 0)
    for r in range(len(seq_lens)):
        n_pages = int(aligned_lens[r]) // page_size
        for p in range(n_pages):
            page_start = req_to_token[int(req_pool_indices[r]), p * page_size]
            dst = int(offsets[r]) + p * page_size
            # PagedTokenToKVPoolAllocator writes page-contiguous slots: page tail is in the same page
            cache_loc_cpu[dst: dst + page_size] = page_start + torch.arange(page_size)
    return cache_loc_cpu


def main():
    model = TinyLM().eval()
    num_layers = len(model.layers)
    pool = MHATokenToKVPool(num_pages=32, page_size=PAGE_SIZE, num_layers=num_layers, kv_heads=2, head_dim=8)
    allocator = PagedTokenToKVPoolAllocator(num_pages=32, page_size=PAGE_SIZE)
    backend = NativeAttention(num_attn_heads=4, num_kv_heads=2)
    req_to_token = torch.zeros(4, 64, dtype=torch.long)

    prompts = [
        [3, 17, 22, 9, 41],            # 5 tokens -> 2 pages, 3 tail slots
        [5, 8, 13, 21, 34, 55, 1],     # 7 tokens -> 2 pages, 1 tail slot
        [12, 60, 7],                   # 3 tokens -> 1 page, 1 tail slot
    ]
    seq_lens = []
    outputs = [[] for _ in prompts]
    last_logits = []
    with torch.no_grad():
        # prefill each request on its own (a batch of one per EXTEND step)
        for r, p in enumerate(prompts):
            L = len(p)
            out_loc = allocator.alloc_extend(L)
            req_to_token[r, :L] = out_loc
            sl = torch.tensor([L])
            fb = ForwardBatch(
                ForwardMode.EXTEND, torch.tensor(p), torch.arange(L), sl, out_loc,
                _merge_cache_loc(req_to_token, torch.tensor([r]), sl, PAGE_SIZE, ForwardMode.EXTEND),
                extend_prefix_lens=torch.tensor([0]), extend_seq_lens=torch.tensor([L]),
            )
            logits = model(fb, pool, backend)
            outputs[r].append(int(logits[L - 1].argmax()))
            seq_lens.append(L)

        # batched decode of all running requests
        for step in range(6):
            bs = len(prompts)
            bs_pad, _ = pad_to_bucket(bs, BS_PADDINGS)
            input_ids = torch.zeros(bs_pad, dtype=torch.long)
            positions = torch.zeros(bs_pad, dtype=torch.long)
            out_loc = torch.zeros(bs_pad, dtype=torch.long)
            for r in range(bs):
                input_ids[r] = outputs[r][-1]
                positions[r] = seq_lens[r]
                slot = allocator.alloc_decode(req_to_token[r, seq_lens[r] - 1], seq_lens[r])
                req_to_token[r, seq_lens[r]] = slot
                out_loc[r] = slot
                seq_lens[r] += 1
            sl = torch.tensor(seq_lens)
            fb = ForwardBatch(
                ForwardMode.DECODE, input_ids, positions, sl, out_loc,
                _merge_cache_loc(req_to_token, torch.arange(bs), sl, PAGE_SIZE, ForwardMode.DECODE),
            )
            logits = model(fb, pool, backend)
            for r in range(bs):
                outputs[r].append(int(logits[r].argmax()))
            last_logits = logits[:bs]

    for r in range(len(prompts)):
        print(f"req {r}: prompt_len={len(prompts[r])} generated={outputs[r]}")
    print("final-step logits abs-sum per request:", [round(float(x), 4) for x in last_logits.abs().sum(-1)])
    print("final-step log-softmax of chosen tokens:",
          [round(float(F.log_softmax(last_logits[r], -1)[outputs[r][-1]]), 4) for r in range(len(prompts))])


if __name__ == "__main__":
    main()
