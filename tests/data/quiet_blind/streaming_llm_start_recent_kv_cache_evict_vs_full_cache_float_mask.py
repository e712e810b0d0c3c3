"""StreamingLLM decode: 4 attention-sink tokens + a recent window, evicted cache vs masked full cache.

Follows mit-han-lab/streaming-llm streaming_llm/kv_cache.py (StartRecentKVCache.__call__: keep
k_seq[:, :, :start_size] and k_seq[:, :, seq_len - recent_size:]) with the pos-shift attention of
streaming_llm/pos_shift/modify_llama.py (llama_pos_shift_attention_forward: keys cached BEFORE rotary,
rotary applied to the kept keys at positions 0..kv_len-1 and to the query at kv_len-1). Here the
evicting decode loop attends with no mask at all to its compacted cache; the same model is run again
with the full, never-evicted cache and an additive float SDPA mask that keeps the sinks and the last
`recent` keys, the kept keys re-positioned by the cumulative count of the keep mask. Both loops must
give the same hidden states at every step.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, HD, V, NL = 32, 2, 16, 40, 2
START, RECENT = 4, 6
B, STEPS = 2, 20

emb = torch.nn.Embedding(V, D).double()
layers = [dict(q=torch.nn.Linear(D, H * HD).double(), k=torch.nn.Linear(D, H * HD).double(),
               v=torch.nn.Linear(D, H * HD).double(), o=torch.nn.Linear(H * HD, D).double())
          for _ in range(NL)]
tokens = torch.randint(0, V, (B, STEPS))


def rope(x, pos):  # pos (n,) shared by the batch
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = pos[:, None].double() * inv
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def step(tok, cache, mode):
    h = emb(tok)[:, None]
    for li, ly in enumerate(layers):
        sp = lambda t: t.view(B, 1, H, HD).transpose(1, 2)
        q, k, v = sp(ly["q"](h)), sp(ly["k"](h)), sp(ly["v"](h))
        if li in cache:
            k = torch.cat([cache[li][0], k], 2); v = torch.cat([cache[li][1], v], 2)
        n = k.shape[2]
        if mode == "evict":
            if n > START + RECENT:  # StartRecentKVCache on the cache incl. the current token
                k = torch.cat([k[:, :, :START], k[:, :, n - RECENT:]], 2)
                v = torch.cat([v[:, :, :START], v[:, :, n - RECENT:]], 2)
            cache[li] = (k, v)
            kpos = torch.arange(k.shape[2])
            o = F.scaled_dot_product_attention(rope(q, kpos[-1:]), rope(k, kpos), v)
        else:
            cache[li] = (k, v)
            idx = torch.arange(n)
            keep = (idx < START) | (idx >= n - RECENT)
            kpos = keep.long().cumsum(0) - 1
            mask = torch.zeros(n, dtype=torch.float64).masked_fill(~keep, float("-inf"))
            o = F.scaled_dot_product_attention(rope(q, kpos[-1:]), rope(k, kpos), v, attn_mask=mask[None, None, None])
        h = h + ly["o"](o.transpose(1, 2).reshape(B, 1, H * HD))
    return h[:, 0]


with torch.no_grad():
    c1, c2 = {}, {}
    a = torch.stack([step(tokens[:, t], c1, "evict") for t in range(STEPS)], 1)
    b = torch.stack([step(tokens[:, t], c2, "full") for t in range(STEPS)], 1)
print("cache lengths evicted / full:", c1[0][0].shape[2], c2[0][0].shape[2])
d = (a - b).abs().max().item()
print("max |evicted cache, no mask - full cache, sink+window mask| =", d)
assert c1[0][0].shape[2] == START + RECENT and d < 1e-10
