# Follows zhuzilin/ring-flash-attention ring_flash_attn/ring_flash_attn.py (skip kv blocks with step > rank, causal
# only at step 0), zigzag_ring_flash_attn.py (rank r holds chunks r and 2W-1-r; earlier kv: only its first half,
# later kv: only the second half of q) and utils.py _update_out_and_lse; ranks simulated in one process.
import torch, torch.nn.functional as F
torch.manual_seed(4); torch.set_default_dtype(torch.float64)
W, T, D = 4, 32, 16
q, k, v = torch.randn(3, T, D).unbind(0)

def attn(q, k, v, causal):
    s = q @ k.T / D ** 0.5
    if causal:
        s = s.masked_fill(~torch.ones(len(q), len(k), dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    return torch.softmax(s, -1) @ v, lse

def update(out, lse, bo, blse):
    if out is None:
        return bo, blse
    out = out - torch.sigmoid(blse - lse) * (out - bo)
    lse = lse - F.logsigmoid(lse - blse)
    return out, lse

def ring(rank, qs, ks, vs):
    out = lse = None
    for step in range(W):
        src = (rank - step) % W                     # kv block received after `step` sends
        if step <= rank:
            bo, bl = attn(qs[rank], ks[src], vs[src], causal=(step == 0))
            out, lse = update(out, lse, bo, bl)
    return out

def zigzag(rank, qs, ks, vs):
    out = lse = None
    n = qs[rank].shape[0] // 2
    for step in range(W):
        src = (rank - step) % W
        if step == 0:
            bo, bl = attn(qs[rank], ks[src], vs[src], causal=True)
            out, lse = update(out, lse, bo, bl)
        elif step <= rank:
            bo, bl = attn(qs[rank], ks[src][:n], vs[src][:n], causal=False)
            out, lse = update(out, lse, bo, bl)
        else:
            bo, bl = attn(qs[rank][n:], ks[src], vs[src], causal=False)
            o2, l2 = update(out[n:], lse[n:], bo, bl)
            out, lse = torch.cat([out[:n], o2]), torch.cat([lse[:n], l2])
    return out

ref, _ = attn(q, k, v, causal=True)
split = lambda t: list(t.chunk(W))
o = torch.cat([ring(r, split(q), split(k), split(v)) for r in range(W)])
d_ring = (o - ref).abs().max().item()
c = T // (2 * W)
zz = lambda t: [torch.cat([t[r * c:(r + 1) * c], t[(2 * W - 1 - r) * c:(2 * W - r) * c]]) for r in range(W)]
outs = [zigzag(r, zz(q), zz(k), zz(v)) for r in range(W)]
zref = zz(ref)
d_zz = max((outs[r] - zref[r]).abs().max().item() for r in range(W))
print("max diff ring vs full causal:", d_ring, " zigzag vs full causal:", d_zz)
assert d_ring < 1e-12 and d_zz < 1e-12
