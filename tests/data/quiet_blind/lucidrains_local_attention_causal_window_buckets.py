# Follows lucidrains/local-attention local_attention/local_attention.py LocalAttention.forward: autopad to window
# multiple, look_around(look_backward=1), causal_mask = bq_t < bq_k, exact_windowsize adds bq_t > bq_k + w,
# pad_mask = bq_k == -1 (look-around padding). True = masked, filled with -finfo.max.
import torch
torch.manual_seed(7); torch.set_default_dtype(torch.float64)
B, T, D, w = 2, 27, 16, 8
q, k, v = torch.randn(3, B, T, D).unbind(0)

def look_around(x, backward=1, pad_value=-1):
    t = x.shape[1]
    padded = torch.cat([torch.full_like(x[:, :backward], pad_value), x], 1)
    return torch.cat([padded[:, i:i + t] for i in range(backward + 1)], 2)

def local_attn(q, k, v):
    pad = (-T) % w
    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    n = (T + pad) // w
    b_t = torch.arange(T + pad).view(1, n, w)
    bq, bk, bv = (t.view(B, n, w, D) for t in (q, k, v))
    bk, bv = look_around(bk, pad_value=0.0), look_around(bv, pad_value=0.0)
    bq_t = b_t[..., :, None]; bq_k = look_around(b_t)[..., None, :]
    sim = bq @ bk.transpose(-1, -2) / D ** 0.5
    mask_value = -torch.finfo(sim.dtype).max
    pad_mask = bq_k == -1
    sim = sim.masked_fill(pad_mask, mask_value)
    causal_mask = (bq_t < bq_k) | (bq_t > bq_k + w)     # exact_windowsize
    sim = sim.masked_fill(causal_mask, mask_value)
    out = (sim.softmax(-1) @ bv).reshape(B, T + pad, D)
    return out[:, :T]                                   # autopad rows dropped

out = local_attn(q, k, v)
diff = 0.0
for i in range(T):                                      # explicit per-query loop over keys i-w..i
    lo = max(0, i - w)
    s = q[:, i:i + 1] @ k[:, lo:i + 1].transpose(1, 2) / D ** 0.5
    ref = s.softmax(-1) @ v[:, lo:i + 1]
    diff = max(diff, (ref[:, 0] - out[:, i]).abs().max().item())
print("max diff bucketed local attention vs per-query window loop:", diff)
assert diff < 1e-12
