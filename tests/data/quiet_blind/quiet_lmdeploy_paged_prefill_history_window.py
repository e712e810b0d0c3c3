"""LMDeploy PyTorch-engine style packed prefill over a paged KV cache (tiny, CPU, torch only).

Ported from InternLM/lmdeploy @1263d5cd889b7ad500e85b8eb20401327a4516ab:
  lmdeploy/pytorch/backends/cuda/attention/default.py  (_forward_prefill: fill_kv_cache,
      flatten_kv_cache into packed K/V at kv_start_loc, then flash_attention_fwd with
      q_start_loc / q_seqlens / kv_start_loc / kv_seqlens, causal, window_size)
  lmdeploy/pytorch/kernels/cuda/fill_kv_cache.py     (new tokens written at history + i via block_offsets)
  lmdeploy/pytorch/kernels/cuda/flatten_kv_cache.py  (paged blocks gathered to a packed buffer)
  lmdeploy/pytorch/kernels/cuda/flashattention.py    (history_len = kv_seqlen - q_seqlen;
      causal: history_len + m >= n; window: n >= max(history_len + m - window_size, 0))
The Triton kernels are replaced by plain-torch stand-ins with the same tiling and masking
semantics. Requests are packed (no padding); each carries its own history length, so the causal
diagonal is shifted per request. Layer 1 uses a sliding window, layer 0 does not.

Reference: each full sequence run alone in one dense pass with a loop over positions.
"""
import math
import torch

torch.manual_seed(0)

HIDDEN, N_HEADS, N_KV, HEAD_DIM = 16, 4, 2, 4
N_LAYERS = 2
WINDOWS = [-1, 3]          # per-layer sliding window (-1: full causal)
BLOCK_SIZE = 4
NUM_BLOCKS = 16
VOCAB = 32
BLOCK_M, BLOCK_N = 4, 4


def rope(x, pos):  # x [T, H, D], pos [T]
    half = HEAD_DIM // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    ang = pos[:, None].float() * inv[None]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, (N_HEADS + 2 * N_KV) * HEAD_DIM)
        self.o = torch.nn.Linear(N_HEADS * HEAD_DIM, HIDDEN)
        self.mlp = torch.nn.Linear(HIDDEN, HIDDEN)

    def proj(self, h, pos):
        qkv = self.qkv(h).view(h.shape[0], N_HEADS + 2 * N_KV, HEAD_DIM)
        q, k, v = qkv[:, :N_HEADS], qkv[:, N_HEADS:N_HEADS + N_KV], qkv[:, N_HEADS + N_KV:]
        return rope(q, pos), rope(k, pos), v


emb = torch.nn.Embedding(VOCAB, HIDDEN)
layers = torch.nn.ModuleList([Layer() for _ in range(N_LAYERS)])


# ---- kernel stand-ins -------------------------------------------------------------------
def fill_kv_cache(k_states, v_states, k_cache, v_cache, q_start_loc, q_seqlens, kv_seqlens,
                  block_offsets):
    """New tokens of request b go to logical slots history_len .. kv_seqlen-1."""
    for b in range(q_seqlens.numel()):
        qs, ql, kl = int(q_start_loc[b]), int(q_seqlens[b]), int(kv_seqlens[b])
        history = kl - ql
        for i in range(ql):
            pos = history + i
            blk = int(block_offsets[b, pos // BLOCK_SIZE])
            k_cache[blk, pos % BLOCK_SIZE] = k_states[qs + i]
            v_cache[blk, pos % BLOCK_SIZE] = v_states[qs + i]


def flatten_kv_cache(k_cache, v_cache, kv_seqlens, block_offsets, start_loc, out_size):
    fk = k_cache.new_zeros(out_size, N_KV, HEAD_DIM)
    fv = v_cache.new_zeros(out_size, N_KV, HEAD_DIM)
    for b in range(kv_seqlens.numel()):
        s, l = int(start_loc[b]), int(kv_seqlens[b])
        for pos in range(l):
            blk = int(block_offsets[b, pos // BLOCK_SIZE])
            fk[s + pos] = k_cache[blk, pos % BLOCK_SIZE]
            fv[s + pos] = v_cache[blk, pos % BLOCK_SIZE]
    return fk, fv


def flash_attention_fwd(q, k, v, q_start_loc, q_seqlens, kv_start_loc, kv_seqlens, causal,
                        window_size):
    """Same semantics as lmdeploy's _flash_prefill_fwd_kernel (online softmax over BLOCK_N tiles)."""
    o = torch.zeros_like(q)
    group = N_HEADS // N_KV
    scale = 1.0 / math.sqrt(HEAD_DIM)
    for b in range(q_seqlens.numel()):
        qs, ql = int(q_start_loc[b]), int(q_seqlens[b])
        ks, kl = int(kv_start_loc[b]), int(kv_seqlens[b])
        history_len = kl - ql
        for head_id in range(N_HEADS):
            kv_head_id = head_id // group
            for start_m in range(0, ql, BLOCK_M):
                offs_m = torch.arange(start_m, min(start_m + BLOCK_M, ql))
                qb = q[qs + offs_m, head_id].float()
                if causal:
                    history_mask = history_len + offs_m
                else:
                    history_mask = torch.full_like(offs_m, kl - 1)
                kv_min_loc = (history_len + offs_m - window_size).clamp(min=0)
                m_i = torch.full((len(offs_m),), float('-inf'))
                l_i = torch.zeros(len(offs_m))
                acc = torch.zeros(len(offs_m), HEAD_DIM)
                for start_n in range(0, kl, BLOCK_N):
                    offs_n = torch.arange(start_n, min(start_n + BLOCK_N, kl))
                    kb = k[ks + offs_n, kv_head_id].float()
                    vb = v[ks + offs_n, kv_head_id].float()
                    qk = (qb @ kb.T) * scale
                    qk_mask = history_mask[:, None] >= offs_n[None, :]
                    if window_size > 0:
                        qk_mask = qk_mask & (offs_n[None, :] >= kv_min_loc[:, None])
                    qk = torch.where(qk_mask, qk, torch.full_like(qk, float('-inf')))
                    m_new = torch.maximum(m_i, qk.max(dim=1).values)
                    # a tile can be fully masked for a row; keep m finite-safe like the kernel
                    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                    p = torch.exp(qk - m_safe[:, None])
                    alpha = torch.exp(m_i - m_safe)
                    l_i = l_i * alpha + p.sum(1)
                    acc = acc * alpha[:, None] + p @ vb
                    m_i = m_new
                o[qs + offs_m, head_id] = (acc / l_i[:, None]).to(o.dtype)
    return o


# ---- engine step ---------------------------------------------------------------------
k_caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, N_KV, HEAD_DIM) for _ in range(N_LAYERS)]
v_caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, N_KV, HEAD_DIM) for _ in range(N_LAYERS)]


def cumsum0(x):
    return torch.cat([x.new_zeros(1), x.cumsum(0)[:-1]])


@torch.no_grad()
def forward_step(chunks, history_lens, block_offsets):
    """chunks: list of 1-D token tensors (new tokens per request); packed with no padding."""
    q_seqlens = torch.tensor([len(c) for c in chunks])
    history_lens = torch.tensor(history_lens)
    kv_seqlens = q_seqlens + history_lens
    q_start_loc = cumsum0(q_seqlens)
    kv_start_loc = cumsum0(kv_seqlens)
    position_ids = torch.cat([h + torch.arange(l) for h, l in zip(history_lens.tolist(),
                                                                 q_seqlens.tolist())])
    h = emb(torch.cat(chunks))
    for li, layer in enumerate(layers):
        q, k, v = layer.proj(h, position_ids)
        fill_kv_cache(k, v, k_caches[li], v_caches[li], q_start_loc, q_seqlens, kv_seqlens,
                      block_offsets)
        fk, fv = flatten_kv_cache(k_caches[li], v_caches[li], kv_seqlens, block_offsets,
                                  kv_start_loc, int(kv_seqlens.sum()))
        attn = flash_attention_fwd(q, fk, fv, q_start_loc, q_seqlens, kv_start_loc, kv_seqlens,
                                   causal=True, window_size=WINDOWS[li])
        h = h + layer.o(attn.flatten(1))
        h = h + torch.tanh(layer.mlp(h))
    return h, q_start_loc, q_seqlens


@torch.no_grad()
def reference(tokens):
    """One sequence alone, dense, loop over query positions."""
    T = len(tokens)
    h = emb(tokens)
    pos = torch.arange(T)
    group = N_HEADS // N_KV
    for li, layer in enumerate(layers):
        q, k, v = layer.proj(h, pos)
        out = torch.zeros(T, N_HEADS, HEAD_DIM)
        for i in range(T):
            lo = 0 if WINDOWS[li] <= 0 else max(0, i - WINDOWS[li])
            for hh in range(N_HEADS):
                kk, vv = k[lo:i + 1, hh // group], v[lo:i + 1, hh // group]
                w = torch.softmax(q[i, hh] @ kk.T / math.sqrt(HEAD_DIM), dim=-1)
                out[i, hh] = w @ vv
        h = h + layer.o(out.flatten(1))
        h = h + torch.tanh(layer.mlp(h))
    return h


full = [torch.randint(0, VOCAB, (n,)) for n in (6, 9, 7)]
# request b owns these physical blocks (deliberately not contiguous / not in order)
block_offsets = torch.tensor([[3, 11, 0], [7, 2, 14], [9, 5, 12]])

# step 1: first chunks (requests 1 and 2 get a history; request 0 has none yet)
first = [full[0][:0], full[1][:5], full[2][:3]]
active = [b for b in range(3) if len(first[b]) > 0]
forward_step([first[b] for b in active], [0 for _ in active], block_offsets[active])
# step 2: the rest of every prompt, each request with its own history length
hist = [len(first[b]) for b in range(3)]
rest = [full[b][hist[b]:] for b in range(3)]
out, q_start_loc, q_seqlens = forward_step(rest, hist, block_offsets)

ok = True
for b in range(3):
    ref = reference(full[b])[hist[b]:]
    got = out[int(q_start_loc[b]):int(q_start_loc[b]) + int(q_seqlens[b])]
    err = (ref - got).abs().max().item()
    print(f"request {b}: history={hist[b]} new={int(q_seqlens[b])} max|diff|={err:.2e}")
    ok &= err < 1e-4
print("matches reference:", ok)
assert ok
