# Follows mit-han-lab/streaming-llm streaming_llm/kv_cache.py StartRecentKVCache (keep start_size sink tokens + the
# recent_size newest, evict the middle) and pos_shift/modify_llama.py (RoPE applied to cached keys with positions
# inside the cache, 0..len-1). Decoding uses no mask: every kept key is visible. Checked against an explicit per-query loop.
import torch
torch.manual_seed(1)
D, T, START, RECENT = 16, 24, 2, 5

def rope(x, pos):
    half = x.shape[-1] // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = pos[:, None].double() * inv[None]
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)

class StartRecentKVCache:
    def __init__(self, start_size, recent_size):
        self.start_size, self.recent_size = start_size, recent_size
    def __call__(self, k, v):  # k: [len, D] (un-rotated keys, as in pos_shift)
        n = k.size(0)
        if n <= self.start_size + self.recent_size:
            return k, v
        return (torch.cat([k[:self.start_size], k[n - self.recent_size:]]),
                torch.cat([v[:self.start_size], v[n - self.recent_size:]]))

x = torch.randn(T, D, dtype=torch.float64)
Wq, Wk, Wv = (torch.randn(D, D, dtype=torch.float64) / D**0.5 for _ in range(3))
cache = StartRecentKVCache(START, RECENT - 1)  # evict before appending the new token -> RECENT keys incl. current
K = torch.empty(0, D, dtype=torch.float64); Vc = K.clone(); outs = []
for t in range(T):
    K, Vc = cache(K, Vc)
    K = torch.cat([K, x[t:t+1] @ Wk]); Vc = torch.cat([Vc, x[t:t+1] @ Wv])
    n = K.size(0)
    q = rope(x[t:t+1] @ Wq, torch.tensor([n - 1]))           # query at its position inside the cache
    k = rope(K, torch.arange(n))
    outs.append(torch.softmax(q @ k.T / D**0.5, -1) @ Vc)
out = torch.cat(outs)
ref = []
for t in range(T):
    kept = sorted(set(range(min(START, t + 1))) | set(range(max(0, t - RECENT + 1), t + 1)))
    n = len(kept)
    q = rope(x[t:t+1] @ Wq, torch.tensor([n - 1])); k = rope(x[kept] @ Wk, torch.arange(n))
    ref.append(torch.softmax(q @ k.T / D**0.5, -1) @ (x[kept] @ Wv))
diff = (out - torch.cat(ref)).abs().max().item()
print("rolled sink cache vs per-query loop max diff", diff)
assert diff < 1e-12
