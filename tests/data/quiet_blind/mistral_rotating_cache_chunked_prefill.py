# Follows mistralai/mistral-inference cache.py (BufferCache slot = pos % sliding_window, unrotate, CacheView.interleave_kv) and its
# prefill masks BlockDiagonalCausalMask(...).make_local_attention(W) / BlockDiagonalMask.from_seqlens(q, kv=s+cached).make_local_attention_
# from_bottomright(W): packed sequences see only their own cached+chunk keys, causal from bottom-right, last W positions.
import math
import torch
from torch import nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, H, W, CHUNK = 32, 4, 5, 4
hd = D // H


def rope(x, pos):  # x [t,h,hd]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    f = pos[:, None].to(torch.float64) * inv[None]
    c, s = f.cos()[:, None], f.sin()[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)


def unrotate(cache, seqlen):
    position = seqlen % cache.shape[0]
    if seqlen < cache.shape[0]:
        return cache[:seqlen]
    elif position == 0:
        return cache
    return torch.cat([cache[position:], cache[:position]], dim=0)


def block_diag_local_mask(q_seqlens, kv_seqlens, window):
    """Boolean [sum q, sum kv], True = attend: block-diagonal, causal from the bottom-right, local window."""
    m = torch.zeros(sum(q_seqlens), sum(kv_seqlens), dtype=torch.bool)
    qo = ko = 0
    for ql, kl in zip(q_seqlens, kv_seqlens):
        i = torch.arange(ql)[:, None] + (kl - ql)  # query row expressed in key coordinates (bottom-right aligned)
        j = torch.arange(kl)[None, :]
        m[qo:qo + ql, ko:ko + kl] = (j <= i) & (i - j < window)
        qo, ko = qo + ql, ko + kl
    return m


wq, wk, wv, wo = (nn.Linear(D, D, bias=False) for _ in range(4))
lengths = [13, 9, 2]
seqs = [torch.randn(L, D) for L in lengths]
cache_k = torch.zeros(len(lengths), W, H, hd)
cache_v = torch.zeros(len(lengths), W, H, hd)
seen = [0] * len(lengths)
outs = [[] for _ in lengths]
with torch.no_grad():
    while any(s < L for s, L in zip(seen, lengths)):
        xq, xk, xv, qlens, kvlens, live = [], [], [], [], [], []
        for b, (s, L) in enumerate(zip(seen, lengths)):
            c = min(CHUNK, L - s)
            if c == 0:
                continue
            x = seqs[b][s:s + c]
            pos = torch.arange(s, s + c)
            q = rope(wq(x).view(c, H, hd), pos)
            k = rope(wk(x).view(c, H, hd), pos)
            v = wv(x).view(c, H, hd)
            # interleave_kv: unrotated cache first, then the new chunk
            kk = torch.cat([unrotate(cache_k[b], s), k])
            vv = torch.cat([unrotate(cache_v[b], s), v])
            xq.append(q); xk.append(kk); xv.append(vv); qlens.append(c); kvlens.append(kk.shape[0]); live.append(b)
            # cache.update: slots position % W (after attention read the old content)
            cache_k[b, pos % W] = k
            cache_v[b, pos % W] = v
        q, k, v = (torch.cat(t).transpose(0, 1) for t in (xq, xk, xv))  # packed [H, total, hd]
        mask = block_diag_local_mask(qlens, kvlens, W)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        a = wo(a.transpose(0, 1).reshape(-1, D))
        off = 0
        for b, c in zip(live, qlens):
            outs[b].append(a[off:off + c]); off += c; seen[b] += c
    # reference: each sequence alone in one dense pass with an explicit sliding-window causal mask
    diff = 0.0
    for b, L in enumerate(lengths):
        pos = torch.arange(L)
        q = rope(wq(seqs[b]).view(L, H, hd), pos).transpose(0, 1)
        k = rope(wk(seqs[b]).view(L, H, hd), pos).transpose(0, 1)
        v = wv(seqs[b]).view(L, H, hd).transpose(0, 1)
        i, j = pos[:, None], pos[None, :]
        bias = torch.where((j <= i) & (i - j < W), 0.0, float("-inf"))
        ref = wo(((q @ k.transpose(-1, -2) / math.sqrt(hd) + bias).softmax(-1) @ v).transpose(0, 1).reshape(L, D))
        diff = max(diff, (torch.cat(outs[b]) - ref).abs().max().item())
print("max |packed chunked prefill with rotating cache - dense sliding-window pass| =", diff)
assert diff < 1e-10
