"""VeloxQuant-MLX NestedKV cache: ragged per-head budgets stacked by zero-padding at the front.

rajveer43/VeloxQuant-MLX#364 ("Verify nestedkv (issue #21): fix attention-corrupting padding
and batching bug"). The cross-head budget competition gives heads different kept lengths; the
cache zero-pads shorter heads at the front to stack them, and the decode attention (mlx_lm passes
no mask for a single-token step) attends those padded key slots. Fix: uniform per-head budget.
Torch port of the MLX cache and of mlx_lm's attention/mask helpers; prefill attends the full
prompt and evicts afterwards (the deferred-eviction convention of the repository).
"""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class KVCacheConfig:
    def __init__(self, nestedkv_budget=6, nestedkv_n_sink=2, nestedkv_window=4, nestedkv_safeguard_alpha=0.2):
        self.nestedkv_budget = nestedkv_budget
        self.nestedkv_n_sink = nestedkv_n_sink
        self.nestedkv_window = nestedkv_window
        self.nestedkv_safeguard_alpha = nestedkv_safeguard_alpha


def nestedkv_score(k, window):
    # key-only anomaly: distance to the global mean blended with distance to the recent window mean
    glob = (k - k.mean(0, keepdim=True)).norm(dim=-1)
    cur = (k - k[-window:].mean(0, keepdim=True)).norm(dim=-1)
    return 0.6 * glob + 0.4 * cur


def nestedkv_allocate_head_budgets(scores, total, n_sink, alpha):
    H = len(scores)
    mass = torch.stack([s.var() for s in scores])
    share = mass / mass.sum()
    floor = max(n_sink, int(alpha * total / H))
    budgets = (floor + share * (total - floor * H)).floor().long()
    return [int(b) for b in budgets]


class NestedKVKVCache:
    def __init__(self, config):
        self._budget = config.nestedkv_budget
        self._n_sink = config.nestedkv_n_sink
        self._window = config.nestedkv_window
        self._alpha = config.nestedkv_safeguard_alpha
        self.keys = None
        self.values = None
        self.kept = None  # per-head list of kept (k, v)
        self.offset = 0

    def _keep(self, k, v, score, budget):
        score = score.clone()
        score[: self._n_sink] = float("inf")
        idx = score.topk(min(budget, k.shape[0])).indices.sort().values
        return k[idx], v[idx]

    def compress_prefill(self, keys, values):
        B, H, S, D = keys.shape
        assert B == 1
        scores = [nestedkv_score(keys[0, h], self._window) for h in range(H)]
        if FIXED:
            budgets = [self._budget] * H
        else:
            budgets = nestedkv_allocate_head_budgets(scores, self._budget * H, self._n_sink, self._alpha)
        self.kept = [self._keep(keys[0, h], values[0, h], scores[h], budgets[h]) for h in range(H)]
        self._restack()

    def _restack(self):
        L = max(k.shape[0] for k, _ in self.kept)
        D = self.kept[0][0].shape[-1]
        ks, vs = [], []
        for k, v in self.kept:
            pad = torch.zeros(L - k.shape[0], D)  # shorter heads padded at the front
            ks.append(torch.cat([pad, k]))
            vs.append(torch.cat([pad, v]))
        self.keys = torch.stack(ks)[None]
        self.values = torch.stack(vs)[None]
        self.offset = L

    def update_and_fetch(self, keys, values):
        self.kept = [(torch.cat([k, keys[0, h]]), torch.cat([v, values[0, h]])) for h, (k, v) in enumerate(self.kept)]
        self._restack()
        return self.keys, self.values


def create_attention_mask(h, cache):
    return "causal" if h.shape[1] > 1 else None


def scaled_dot_product_attention(q, k, v, scale, mask):
    if mask == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class Attention(torch.nn.Module):
    def __init__(self, dim=32, n_heads=4):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = torch.nn.Linear(dim, dim, bias=False)
        self.k_proj = torch.nn.Linear(dim, dim, bias=False)
        self.v_proj = torch.nn.Linear(dim, dim, bias=False)
        self.o_proj = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask, cache):
        B, L, _ = x.shape
        q, k, v = (p(x).view(B, L, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if L > 1:  # prefill: attend the whole prompt, then evict
            out = scaled_dot_product_attention(q, k, v, self.scale, mask)
            cache.compress_prefill(k, v)
        else:
            k, v = cache.update_and_fetch(k, v)
            out = scaled_dot_product_attention(q, k, v, self.scale, mask)
        self.last_q = q
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


def main():
    attn = Attention()
    cache = NestedKVKVCache(KVCacheConfig())
    prompt = torch.randn(1, 24, 32) * torch.linspace(0.3, 3.0, 32)  # heads with different score spread
    attn(prompt, create_attention_mask(prompt, cache), cache)
    print("kept per head:", [k.shape[0] for k, _ in cache.kept])
    x = torch.randn(1, 1, 32)
    worst = 0.0
    for step in range(3):
        y = attn(x, create_attention_mask(x, cache), cache)
        # what the cache means: each head attends only its own kept tokens
        ref = []
        for h, (k, v) in enumerate(cache.kept):
            w = torch.softmax(attn.last_q[0, h] @ k.T * attn.scale, -1)
            ref.append(w @ v)
        ref = attn.o_proj(torch.cat(ref, -1))
        worst = max(worst, (y[0] - ref).abs().max().item())
        x = y
    print(f"decode max |out - per-head kept-token attention| = {worst:.4f}")


if __name__ == "__main__":
    main()
