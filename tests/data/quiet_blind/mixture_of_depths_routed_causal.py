# Follows the Mixture-of-Depths expert-choice router (Raposo et al. 2024; e.g. the MixtureOfDepth module
# in nanotron-style ports: router top-k, torch.sort of the selected indices, block on the gathered tokens,
# scatter back scaled by router weight).  Inside the block the k routed tokens attend causally by their
# ORIGINAL positions; the full-length equivalent mask leaves unrouted query rows empty and discards them.
import torch

torch.manual_seed(0)
dt = torch.float64
B, T, C, Hh, cap = 2, 16, 32, 4, 6
hd = C // Hh
x = torch.randn(B, T, C, dtype=dt)
w_router = torch.randn(C, dtype=dt)
Wqkv = torch.randn(C, 3 * C, dtype=dt) / C ** 0.5


def attn_block(h, attn_mask):
    # attn_mask: bool, True = may attend (torch SDPA convention)
    b, t, _ = h.shape
    q, k, v = (h @ Wqkv).view(b, t, 3, Hh, hd).permute(2, 0, 3, 1, 4)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask) \
        .transpose(1, 2).reshape(b, t, C)


# routed computation
weights = x @ w_router                                 # [B, T]
topk_w, topk_idx = torch.topk(weights, cap, dim=-1)
sorted_idx, order = torch.sort(topk_idx, dim=-1)      # keep temporal order for the causal mask
sorted_w = torch.gather(topk_w, 1, order)
sel = torch.gather(x, 1, sorted_idx[..., None].expand(-1, -1, C))
causal = sorted_idx[:, :, None] >= sorted_idx[:, None, :]       # by original position, [B, k, k]
blk = attn_block(sel, causal[:, None])
out = x.clone()
out.scatter_add_(1, sorted_idx[..., None].expand(-1, -1, C), blk * sorted_w[..., None])

# reference: full-length attention; key j visible to query i iff both routed and j <= i.
routed = torch.zeros(B, T, dtype=torch.bool)
routed.scatter_(1, topk_idx, True)
pos = torch.arange(T)
full_mask = routed[:, :, None] & routed[:, None, :] & (pos[None, :, None] >= pos[None, None, :])
bias = torch.zeros(B, 1, T, T, dtype=dt).masked_fill(~full_mask[:, None], torch.finfo(dt).min)
full = attn_block(x, bias)                              # rows of unrouted queries are garbage ...
ref = x + torch.where(routed[..., None], full * weights[..., None], torch.zeros_like(full))  # ... and dropped
diff = (out - ref).abs().max().item()
print("max |routed top-k block - full-length masked block| =", diff)
assert diff < 1e-12
