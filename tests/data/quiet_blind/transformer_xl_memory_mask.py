# Follows kimiyoung/transformer-xl pytorch/mem_transformer.py MemTransformerLM._forward: dec_attn_mask =
# torch.triu(ones(qlen, klen), diagonal=1+mlen) with True = masked (masked_fill -inf), keys = [mems; current segment].
# The mask is not square: qlen queries vs mlen+qlen keys, every query sees all of memory. Relative bias by distance.
import torch
torch.manual_seed(4)
torch.set_default_dtype(torch.float64)
D, L, T, SEG = 32, 2, 16, 4
Wqkv = [torch.randn(D, 3 * D) / D ** 0.5 for _ in range(L)]
Wo = [torch.randn(D, D) / D ** 0.5 for _ in range(L)]
rel = torch.randn(L, T)                 # learned bias per relative distance i - j (stand-in for the R/r_w/r_r terms)

def layer(l, h, mem):
    mlen, qlen = mem.shape[0], h.shape[0]
    cat = torch.cat([mem, h], 0)
    q = (h @ Wqkv[l])[:, :D]
    k, v = (cat @ Wqkv[l])[:, D:2 * D], (cat @ Wqkv[l])[:, 2 * D:]
    klen = mlen + qlen
    score = q @ k.T / D ** 0.5
    dist = (torch.arange(qlen)[:, None] + mlen) - torch.arange(klen)[None, :]
    score = score + rel[l][dist.clamp(min=0)]
    dec_attn_mask = torch.triu(torch.ones(qlen, klen), diagonal=1 + mlen).bool()
    score = score.masked_fill(dec_attn_mask, float("-inf"))
    return h + torch.tanh(score.softmax(-1) @ v @ Wo[l])

x = torch.randn(T, D)
# segment-recurrent run: mems[l] holds layer-l inputs of all earlier segments (mem_len >= T, nothing dropped)
mems = [torch.zeros(0, D) for _ in range(L)]
outs = []
for s in range(0, T, SEG):
    h = x[s:s + SEG]
    new = []
    for l in range(L):
        new.append(h)
        h = layer(l, h, mems[l])
    mems = [torch.cat([m, n], 0).detach() for m, n in zip(mems, new)]
    outs.append(h)
out = torch.cat(outs)

# reference: whole sequence at once, explicit per-query loop over keys 0..i
h = x
for l in range(L):
    nh = torch.zeros_like(h)
    for i in range(T):
        q = (h[i] @ Wqkv[l])[:D]
        kv = h[:i + 1] @ Wqkv[l]
        sc = kv[:, D:2 * D] @ q / D ** 0.5 + rel[l][i - torch.arange(i + 1)]
        nh[i] = h[i] + torch.tanh(sc.softmax(-1) @ kv[:, 2 * D:] @ Wo[l])
    h = nh
d = (out - h).abs().max().item()
print("max diff segment+memory vs full-sequence per-query loop:", d)
assert d < 1e-12
