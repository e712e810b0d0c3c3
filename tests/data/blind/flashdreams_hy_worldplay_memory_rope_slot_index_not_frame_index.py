# NVIDIA/flashdreams#318 (hy_worldplay recipe, HyWorldPlay transformer: prefill_memory_kv_cache).
# Memory frames re-selected from the clean-latent history were prefilled into the memory KV cache RoPE'd at their
# buffer-slot index arange(K) instead of their true frame index, so cached keys sit at the wrong frame offset.
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

DIM, HEADS = 32, 2
HD = DIM // HEADS
H, W = 2, 2
TOKENS_PER_FRAME = H * W      # cache.hy_tokens_per_frame
LEN_T = 2                     # latent frames per AR chunk


class RotaryPositionEmbedding3D:
    """t/h/w rotary table (Wan split of the head dim)."""

    def __init__(self, head_dim, len_t, theta=10000.0):
        self.d_t = head_dim - 4 * (head_dim // 6)
        self.d_s = 2 * (head_dim // 6)
        self.len_t = len_t
        self.theta = theta
        self.device = "cpu"

    def _inv(self, d):
        return 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))

    def _freq_components(self, seq_t):
        freqs_t = seq_t[:, None] * self._inv(self.d_t)[None]
        freqs_h = torch.arange(H, dtype=torch.float64)[:, None] * self._inv(self.d_s)[None]
        freqs_w = torch.arange(W, dtype=torch.float64)[:, None] * self._inv(self.d_s)[None]
        return freqs_t, freqs_h, freqs_w

    def _cat_freqs(self, freqs_t, freqs_h, freqs_w):
        T = freqs_t.shape[0]
        ang = torch.cat([freqs_t[:, None, None].expand(T, H, W, -1),
                         freqs_h[None, :, None].expand(T, H, W, -1),
                         freqs_w[None, None, :].expand(T, H, W, -1)], -1).reshape(T * H * W, -1)
        return torch.polar(torch.ones_like(ang), ang)

    def shift_t(self, autoregressive_index):
        seq_t = autoregressive_index * self.len_t + torch.arange(self.len_t, dtype=torch.float64)
        return self._cat_freqs(*self._freq_components(seq_t))

    def is_context_parallel_enabled(self):
        return False


def apply_rope_freqs(x, freqs):
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[None, :, None, :]).flatten(-2)


class MemoryKV:
    def __init__(self):
        self.reset()

    def reset(self):
        self.k = None
        self.v = None


class SelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(DIM, DIM)
        self.k = torch.nn.Linear(DIM, DIM)
        self.v = torch.nn.Linear(DIM, DIM)
        self.o = torch.nn.Linear(DIM, DIM)

    def kv(self, x, rope_freqs):
        B, L, _ = x.shape
        return apply_rope_freqs(self.k(x).view(B, L, HEADS, HD), rope_freqs), self.v(x).view(B, L, HEADS, HD)

    def forward(self, x, rope_freqs, memory):
        B, L, _ = x.shape
        q = apply_rope_freqs(self.q(x).view(B, L, HEADS, HD), rope_freqs)
        k, v = self.kv(x, rope_freqs)
        if memory.k is not None:                      # memory K/V are prepended to the chunk's own K/V
            k, v = torch.cat([memory.k, k], 1), torch.cat([memory.v, v], 1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o(out.transpose(1, 2).reshape(B, L, DIM))


class HyWorldPlayWanDiTNetwork(torch.nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.blocks = torch.nn.ModuleList([SelfAttention() for _ in range(depth)])
        self.mlps = torch.nn.ModuleList([torch.nn.Linear(DIM, DIM) for _ in range(depth)])

    def prefill_memory_kv_cache(self, x, cache, rope_freqs):
        for blk, mlp, mem in zip(self.blocks, self.mlps, cache.memory):
            mem.k, mem.v = blk.kv(x, rope_freqs)
            x = x + blk(x, rope_freqs, MemoryKV())      # memory frames attend among themselves
            x = x + torch.tanh(mlp(x))

    def forward(self, x, rope_freqs, cache):
        for blk, mlp, mem in zip(self.blocks, self.mlps, cache.memory):
            x = x + blk(x, rope_freqs, mem)
            x = x + torch.tanh(mlp(x))
        return x


class HyWorldPlayWan21TransformerCache:
    def __init__(self, depth):
        self.rope_adapter = RotaryPositionEmbedding3D(HD, LEN_T)
        self.hy_tokens_per_frame = TOKENS_PER_FRAME
        self.clean_latent_history = None
        self.memory = [MemoryKV() for _ in range(depth)]


class HyWorldPlayWan21Transformer:
    def __init__(self):
        self.network = HyWorldPlayWanDiTNetwork()

    def _build_memory_rope_freqs(self, cache, t_positions):
        rope = cache.rope_adapter
        freqs_t, freqs_h, freqs_w = rope._freq_components(t_positions)
        return rope._cat_freqs(freqs_t, freqs_h, freqs_w)

    def prefill_memory_kv_cache(self, cache, selected):
        K = len(selected)
        tokens_per_frame = cache.hy_tokens_per_frame
        history = cache.clean_latent_history
        token_ranges = [history[..., idx * tokens_per_frame:(idx + 1) * tokens_per_frame, :] for idx in selected]
        memory_x = torch.cat(token_ranges, dim=-2)
        selected_idx_t = torch.as_tensor(selected, dtype=torch.long)
        if FIXED:
            rope_freqs = self._build_memory_rope_freqs(cache=cache, t_positions=selected_idx_t.to(torch.float64))
        else:
            rope_freqs = self._build_memory_rope_freqs(cache=cache, t_positions=torch.arange(K, dtype=torch.float64))
        for mem in cache.memory:
            mem.reset()
        self.network.prefill_memory_kv_cache(x=memory_x, cache=cache, rope_freqs=rope_freqs)

    def predict_flow(self, noisy_latent, cache, ar_idx, memory_frame_indices):
        self.prefill_memory_kv_cache(cache, memory_frame_indices)
        return self.network(noisy_latent, cache.rope_adapter.shift_t(ar_idx), cache)

    def finalize_kv_cache(self, clean_latent, cache):
        cache.clean_latent_history = clean_latent.detach().clone() if cache.clean_latent_history is None else \
            torch.cat([cache.clean_latent_history, clean_latent.detach()], dim=-2)


@torch.no_grad()
def reference(model, history, selected, x, ar_idx):
    """Memory frames and chunk in one uncached pass, every frame RoPE'd at its position in the rollout."""
    rope = RotaryPositionEmbedding3D(HD, LEN_T)
    mem_x = torch.cat([history[:, i * TOKENS_PER_FRAME:(i + 1) * TOKENS_PER_FRAME] for i in selected], 1)
    pos = torch.cat([torch.tensor(selected, dtype=torch.float64),
                     ar_idx * LEN_T + torch.arange(LEN_T, dtype=torch.float64)])
    freqs = rope._cat_freqs(*rope._freq_components(pos))
    n_mem = mem_x.shape[1]
    seq = torch.cat([mem_x, x], 1)
    L = seq.shape[1]
    # memory rows see only memory; chunk rows see memory + chunk
    mask = torch.ones(L, L, dtype=torch.bool)
    mask[:n_mem, n_mem:] = False
    h = seq
    for blk, mlp in zip(model.network.blocks, model.network.mlps):
        q = apply_rope_freqs(blk.q(h).view(1 if h.dim() == 2 else h.shape[0], L, HEADS, HD), freqs)
        k, v = blk.kv(h, freqs)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        h = h + blk.o(a.transpose(1, 2).reshape(h.shape[0], L, DIM))
        h = h + torch.tanh(mlp(h))
    return h[:, n_mem:]


model = HyWorldPlayWan21Transformer()
cache = HyWorldPlayWan21TransformerCache(depth=2)
B = 2
worst = 0.0
with torch.no_grad():
    for ar_idx in range(4):
        x = torch.randn(B, LEN_T * TOKENS_PER_FRAME, DIM)
        n_hist = ar_idx * LEN_T
        # the selector re-picks memory frames from the clean history each chunk (slot order != frame order)
        selected = [] if n_hist == 0 else sorted(torch.randperm(n_hist)[:min(3, n_hist)].tolist(), reverse=True)
        if selected:
            out = model.predict_flow(x, cache, ar_idx, selected)
            ref = reference(model, cache.clean_latent_history, selected, x, ar_idx)
            worst = max(worst, (out - ref).abs().max().item())
        else:
            out = model.network(x, cache.rope_adapter.shift_t(ar_idx), cache)
        model.finalize_kv_cache(out, cache)
print(f"max |memory-cache rollout - true-frame-position reference| = {worst:.3e}")
