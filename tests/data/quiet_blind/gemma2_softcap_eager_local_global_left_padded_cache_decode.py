"""Gemma2-style alternating sliding-window / global layers, left-padded batch, KV cache decode.

Follows huggingface/transformers src/transformers/models/gemma2/modeling_gemma2.py
(eager_attention_forward: scaling = query_pre_attn_scalar ** -0.5, logits soft-capped with
tanh(x / attn_logit_softcapping) * attn_logit_softcapping, additive mask, softmax in float) and
masking_utils.sliding_window_causal_mask_function (key kept when q_idx - sliding_window < kv_idx <= q_idx),
with layer_types alternating "sliding_attention" / "full_attention" and a cache that grows by one
token per decode step. The batch is left padded as for generate(); positions come from the
cumulative attention mask and the cache slot index is the cache position. Hand-written softmax
(no SDPA: SDPA cannot softcap). Reference: every row alone, unpadded, whole sequence, no cache.
"""
import torch

torch.manual_seed(0)
D, H, HD, V, NL = 32, 2, 16, 40, 4
WINDOW, SOFTCAP, QSCALAR = 3, 50.0, 16
layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(NL)]
prompts = [torch.randint(1, V, (n,)) for n in (6, 3, 5)]
new_tokens = torch.randint(1, V, (len(prompts), 3))  # tokens fed during decode (teacher forced)

emb = torch.nn.Embedding(V, D).double()
layers = [dict(q=torch.nn.Linear(D, H * HD, bias=False).double(), k=torch.nn.Linear(D, H * HD, bias=False).double(),
               v=torch.nn.Linear(D, H * HD, bias=False).double(), o=torch.nn.Linear(H * HD, D, bias=False).double())
          for _ in range(NL)]


def rope(x, pos):  # x (b, h, n, hd), pos (b, n)
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = pos[..., None].double() * inv
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def make_masks(attn_2d, cache_position, kv_len):
    """additive masks (b, 1, q, kv) for full and sliding layers, as create_causal_mask / create_sliding_window_causal_mask"""
    q_idx = cache_position[:, None]
    kv_idx = torch.arange(kv_len)[None, :]
    causal = kv_idx <= q_idx
    sliding = causal & (kv_idx > q_idx - WINDOW)
    pad = attn_2d[:, None, None, :kv_len].bool()
    neg = torch.finfo(torch.float64).min
    to_add = lambda m: torch.zeros(m.shape, dtype=torch.float64).masked_fill(~m, neg)
    return {"full_attention": to_add(causal[None, None] & pad), "sliding_attention": to_add(sliding[None, None] & pad)}


def forward(ids, pos, masks, cache=None):
    b, n = ids.shape
    h = emb(ids) * D ** 0.5
    for li, ly in enumerate(layers):
        sp = lambda t: t.view(b, n, H, HD).transpose(1, 2)
        q, k, v = rope(sp(ly["q"](h)), pos), rope(sp(ly["k"](h)), pos), sp(ly["v"](h))
        if cache is not None:
            if li in cache:
                k = torch.cat([cache[li][0], k], 2); v = torch.cat([cache[li][1], v], 2)
            cache[li] = (k, v)
        s = (q @ k.transpose(-1, -2)) * QSCALAR ** -0.5
        s = torch.tanh(s / SOFTCAP) * SOFTCAP
        s = s + masks[layer_types[li]]
        p = torch.softmax(s, -1)
        h = h + ly["o"]((p @ v).transpose(1, 2).reshape(b, n, H * HD))
    return h


with torch.no_grad():
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, L, dtype=torch.long)
    attn = torch.zeros(B, L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = p; attn[i, L - len(p):] = 1
    pos = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 1)
    cache = {}
    cache_position = torch.arange(L)
    outs = [forward(ids, pos, make_masks(attn, cache_position, L), cache)]
    for step in range(new_tokens.shape[1]):
        attn = torch.cat([attn, torch.ones(B, 1, dtype=torch.long)], 1)
        pos = pos[:, -1:] + 1
        cache_position = cache_position[-1:] + 1
        outs.append(forward(new_tokens[:, step:step + 1], pos, make_masks(attn, cache_position, attn.shape[1]), cache))
    batched = torch.cat(outs, 1)

    maxdiff = 0.0
    for i, p in enumerate(prompts):
        full = torch.cat([p, new_tokens[i]])[None]
        n = full.shape[1]
        ref = forward(full, torch.arange(n)[None], make_masks(torch.ones(1, n), torch.arange(n), n))
        maxdiff = max(maxdiff, (batched[i, L - len(p):] - ref[0]).abs().max().item())
print("max |left-padded cached decode - per-row full forward| =", maxdiff)
assert maxdiff < 1e-10
