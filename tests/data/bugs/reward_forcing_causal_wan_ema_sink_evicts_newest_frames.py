# Reward-Forcing (JaydenLyh/Reward-Forcing#5, fixed in commit 4317f5a "[fix] ema sink"): CausalWanSelfAttention's
# rolling KV cache took the frames it "evicts" into the EMA attention sink from the newest end of the window
# (slots sink+rolled..) instead of the oldest frames that actually leave the window, so the sink keys/values drift.
import sys
import copy
import math

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- wan/modules/attention.py: attention() fallback path (no flash-attn on CPU); float32 here
def attention(q, k, v, q_lens=None, k_lens=None, dropout_p=0., softmax_scale=None, q_scale=None, causal=False,
              window_size=(-1, -1), deterministic=False, dtype=torch.float32, fa_version=None):
    attn_mask = None
    q = q.transpose(1, 2).to(dtype)
    k = k.transpose(1, 2).to(dtype)
    v = v.transpose(1, 2).to(dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=causal, dropout_p=dropout_p)
    out = out.transpose(1, 2).contiguous()
    return out


# ---- wan/modules/model.py
def rope_params(max_seq_len, dim, theta=10000):
    assert dim % 2 == 0
    freqs = torch.outer(
        torch.arange(max_seq_len),
        1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim)))
    freqs = torch.polar(torch.ones_like(freqs), freqs)
    return freqs


class WanRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)


# ---- wan/modules/causal_model.py
def causal_rope_apply(x, grid_sizes, freqs, start_frame=0):
    n, c = x.size(2), x.size(3) // 2
    freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    output = []
    for i, (f, h, w) in enumerate(grid_sizes.tolist()):
        seq_len = f * h * w
        x_i = torch.view_as_complex(x[i, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
        freqs_i = torch.cat([
            freqs[0][start_frame:start_frame + f].view(f, 1, 1, -1).expand(f, h, w, -1),
            freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1)
        ], dim=-1).reshape(seq_len, 1, -1)
        x_i = torch.view_as_real(x_i * freqs_i).flatten(2)
        x_i = torch.cat([x_i, x[i, seq_len:]])
        output.append(x_i)
    return torch.stack(output).type_as(x)


class CausalWanSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, local_attn_size=-1, sink_size=0, qk_norm=True, eps=1e-6,
                 compression_alpha=0.999):
        assert dim % num_heads == 0
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.local_attn_size = local_attn_size
        self.sink_size = sink_size
        self.qk_norm = qk_norm
        self.eps = eps
        self.compression_alpha = compression_alpha
        self.max_attention_size = 32760 if local_attn_size == -1 else local_attn_size * 1560
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()

    def incremental_update(self, new_k, new_v, current_sink_k, current_sink_v, alpha=None):
        if alpha is None:
            alpha = self.compression_alpha
        updated_sink_k = alpha * current_sink_k + (1 - alpha) * new_k
        updated_sink_v = alpha * current_sink_v + (1 - alpha) * new_v
        return updated_sink_k, updated_sink_v

    def forward(self, x, seq_lens, grid_sizes, freqs, block_mask, kv_cache=None, current_start=0, cache_start=None):
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        if cache_start is None:
            cache_start = current_start

        def qkv_fn(x):
            q = self.norm_q(self.q(x)).view(b, s, n, d)
            k = self.norm_k(self.k(x)).view(b, s, n, d)
            v = self.v(x).view(b, s, n, d)
            return q, k, v

        q, k, v = qkv_fn(x)

        frame_seqlen = math.prod(grid_sizes[0][1:]).item()
        current_end = current_start + q.shape[1]
        total_sink_tokens = self.sink_size * frame_seqlen

        kv_cache_size = kv_cache["k"].shape[1]
        num_new_tokens = q.shape[1]

        evicted_tokens_exist = False
        evicted_k = None
        evicted_v = None

        if self.local_attn_size != -1 and (current_end > kv_cache["global_end_index"].item()) and (
                num_new_tokens + kv_cache["local_end_index"].item() > kv_cache_size):
            num_evicted_tokens = num_new_tokens + kv_cache["local_end_index"].item() - kv_cache_size
            num_rolled_tokens = kv_cache["local_end_index"].item() - num_evicted_tokens - total_sink_tokens

            if not FIXED:
                evicted_start = total_sink_tokens + num_rolled_tokens
                evicted_end = total_sink_tokens + num_rolled_tokens + num_evicted_tokens
            else:
                evicted_start = total_sink_tokens
                evicted_end = total_sink_tokens + num_evicted_tokens
            evicted_k = kv_cache["k"][:, evicted_start:evicted_end].clone()
            evicted_v = kv_cache["v"][:, evicted_start:evicted_end].clone()
            evicted_tokens_exist = True

            kv_cache["k"][:, total_sink_tokens:total_sink_tokens + num_rolled_tokens] = \
                kv_cache["k"][:, total_sink_tokens + num_evicted_tokens:total_sink_tokens + num_evicted_tokens + num_rolled_tokens].clone()
            kv_cache["v"][:, total_sink_tokens:total_sink_tokens + num_rolled_tokens] = \
                kv_cache["v"][:, total_sink_tokens + num_evicted_tokens:total_sink_tokens + num_evicted_tokens + num_rolled_tokens].clone()

            local_end_index = kv_cache["local_end_index"].item() + current_end - \
                kv_cache["global_end_index"].item() - num_evicted_tokens
            local_start_index = local_end_index - num_new_tokens
            kv_cache["k"][:, local_start_index:local_end_index] = k
            kv_cache["v"][:, local_start_index:local_end_index] = v
        else:
            local_end_index = kv_cache["local_end_index"].item() + current_end - kv_cache["global_end_index"].item()
            local_start_index = local_end_index - num_new_tokens
            kv_cache["k"][:, local_start_index:local_end_index] = k
            kv_cache["v"][:, local_start_index:local_end_index] = v

        if evicted_tokens_exist and evicted_k is not None and evicted_k.shape[1] > 0:
            if evicted_k.shape[1] == total_sink_tokens:
                current_sink_k = kv_cache["k"][:, :total_sink_tokens]
                current_sink_v = kv_cache["v"][:, :total_sink_tokens]
                updated_sink_k, updated_sink_v = self.incremental_update(
                    evicted_k, evicted_v, current_sink_k, current_sink_v)
                kv_cache["k"][:, :total_sink_tokens] = updated_sink_k
                kv_cache["v"][:, :total_sink_tokens] = updated_sink_v
            else:
                min_len = min(evicted_k.shape[1], total_sink_tokens)
                kv_cache["k"][:, :min_len] = evicted_k[:, :min_len]
                kv_cache["v"][:, :min_len] = evicted_v[:, :min_len]

        kv_start_index = max(total_sink_tokens, local_end_index - self.max_attention_size + total_sink_tokens)
        kv_end_index = local_end_index
        actual_kv_tokens = kv_end_index - kv_start_index
        k_segment = kv_cache["k"][:, kv_start_index:kv_end_index]
        v_segment = kv_cache["v"][:, kv_start_index:kv_end_index]

        sink_k = kv_cache["k"][:, :total_sink_tokens]
        sink_v = kv_cache["v"][:, :total_sink_tokens]
        k_combined = torch.cat([sink_k, k_segment], dim=1)
        v_combined = torch.cat([sink_v, v_segment], dim=1)
        grid_sizes_kv = copy.deepcopy(grid_sizes)
        total_combined_tokens = total_sink_tokens + actual_kv_tokens
        grid_sizes_kv[:, 0] = total_combined_tokens // frame_seqlen
        query_start_frame = (total_sink_tokens +
                             (local_end_index - max(total_sink_tokens, local_end_index - self.max_attention_size + total_sink_tokens)) -
                             q.shape[1]) // frame_seqlen
        x = attention(
            causal_rope_apply(q, grid_sizes, freqs, start_frame=query_start_frame).type_as(v),
            causal_rope_apply(k_combined, grid_sizes_kv, freqs, start_frame=0).type_as(v),
            v_combined,
        )

        kv_cache["global_end_index"].fill_(current_end)
        kv_cache["local_end_index"].fill_(local_end_index)
        x = x.flatten(2)
        return self.o(x)


# ---- tiny causal rollout, as pipeline/causal_inference.py drives it (configs/reward_forcing.yaml:
# num_frame_per_block 3, local_attn_size 9, sink_size 3), at 2x2 latent tokens per frame
dim, num_heads = 32, 2
head_dim = dim // num_heads
H = W = 2
frame_seq_length = H * W
num_frame_per_block, local_attn_size, sink_size = 3, 9, 3
num_blocks = 8

attn = CausalWanSelfAttention(dim, num_heads, local_attn_size=local_attn_size, sink_size=sink_size).eval()
dd = head_dim
freqs = torch.cat([rope_params(1024, dd - 4 * (dd // 6)), rope_params(1024, 2 * (dd // 6)),
                   rope_params(1024, 2 * (dd // 6))], dim=1)

kv_cache_size = local_attn_size * frame_seq_length
kv_cache = {
    "k": torch.zeros([1, kv_cache_size, num_heads, head_dim]),
    "v": torch.zeros([1, kv_cache_size, num_heads, head_dim]),
    "global_end_index": torch.tensor([0], dtype=torch.long),
    "local_end_index": torch.tensor([0], dtype=torch.long),
}
grid_sizes = torch.tensor([[num_frame_per_block, H, W]])
block_tokens = num_frame_per_block * frame_seq_length
clean_k = []  # keys of each block's clean-context pass, as stored in the cache
clean_v = []

with torch.no_grad():
    for blk in range(num_blocks):
        current_start = blk * block_tokens
        noisy = torch.randn(1, block_tokens, dim)
        clean = torch.randn(1, block_tokens, dim)
        # a denoising step, then the clean-context pass that rewrites this block's cache slots
        attn(noisy, None, grid_sizes, freqs, None, kv_cache=kv_cache, current_start=current_start)
        attn(clean, None, grid_sizes, freqs, None, kv_cache=kv_cache, current_start=current_start)
        clean_k.append(attn.norm_k(attn.k(clean)).view(1, block_tokens, num_heads, head_dim))
        clean_v.append(attn.v(clean).view(1, block_tokens, num_heads, head_dim))

# reference: sink starts as block 0 and is EMA-updated with each block that leaves the 9-frame window
alpha = attn.compression_alpha
frames_in_cache = local_attn_size // num_frame_per_block  # blocks held: sink block + 2 window blocks
ref_sink_k, ref_sink_v = clean_k[0].clone(), clean_v[0].clone()
for blk in range(frames_in_cache, num_blocks):
    leaving = blk - (frames_in_cache - 1)  # oldest non-sink block
    ref_sink_k = alpha * ref_sink_k + (1 - alpha) * clean_k[leaving]
    ref_sink_v = alpha * ref_sink_v + (1 - alpha) * clean_v[leaving]

sink_tokens = sink_size * frame_seq_length
err_k = (kv_cache["k"][:, :sink_tokens] - ref_sink_k).abs().max().item()
err_v = (kv_cache["v"][:, :sink_tokens] - ref_sink_v).abs().max().item()
print(f"fixed={FIXED} after {num_blocks} blocks: max |cached EMA sink - EMA of evicted oldest frames| "
      f"k={err_k:.6e} v={err_v:.6e}")
