# Ports flax/linen/attention.py (make_attention_mask, make_causal_mask, combine_masks; True = keep) to torch and
# feeds SDPA's bool mask (also True = keep). Left padding: pad query rows see nothing; their outputs are discarded.
import torch, torch.nn.functional as F
torch.manual_seed(0)
def make_attention_mask(q_in, k_in, fn=torch.mul):
    m = fn(q_in[..., :, None], k_in[..., None, :])
    return m[..., None, :, :].bool()
def make_causal_mask(x):
    idxs = torch.arange(x.shape[-1]).expand(x.shape)
    return make_attention_mask(idxs, idxs, torch.greater_equal)
def combine_masks(*masks):
    masks = [m for m in masks if m is not None]
    out = masks[0]
    for m in masks[1:]:
        out = torch.logical_and(out, m)
    return out
B, T, H, Dh = 2, 9, 2, 8
lens = [9, 5]
valid = torch.zeros(B, T, dtype=torch.long)
for b, L in enumerate(lens):
    valid[b, T - L:] = 1
mask = combine_masks(make_attention_mask(valid, valid), make_causal_mask(valid))
q, k, v = (torch.randn(B, H, T, Dh, dtype=torch.float64) for _ in range(3))
out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
diff = 0.0
for b, L in enumerate(lens):
    s = slice(T - L, T)
    r = F.scaled_dot_product_attention(q[b:b+1, :, s], k[b:b+1, :, s], v[b:b+1, :, s], is_causal=True)
    diff = max(diff, (r - out[b:b+1, :, s]).abs().max().item())
print("max diff", diff)
assert diff < 1e-12
