# Follows ml-explore/mlx-examples llms/mlx_lm/models/base.py (create_causal_mask(N, offset, window_size)):
# with `offset` tokens already cached, query i (absolute offset+i) keeps key j iff j <= offset+i and,
# with a window, offset+i - j < window_size; the bool is turned into an additive -inf bias for SDPA.
import torch
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, L, W = 32, 20, 6
Wq, Wk, Wv = (torch.randn(D, D) / D ** 0.5 for _ in range(3))

def create_causal_mask(N, offset=0, window_size=None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N)
    mask = linds[:, None] >= rinds[None]
    if window_size is not None:
        mask = mask & (linds[:, None] < rinds[None] + window_size)
    return mask

x = torch.randn(L, D)
keys = torch.empty(0, D); vals = torch.empty(0, D); outs = []
for chunk in (x[:7], x[7:12], x[12:13], x[13:]):             # chunked prefill + decode with growing cache
    offset = keys.shape[0]
    keys = torch.cat([keys, chunk @ Wk]); vals = torch.cat([vals, chunk @ Wv])
    m = create_causal_mask(chunk.shape[0], offset, W)
    bias = torch.zeros(m.shape).masked_fill(~m, float("-inf"))
    outs.append(torch.nn.functional.scaled_dot_product_attention(chunk @ Wq, keys, vals, attn_mask=bias))
out = torch.cat(outs)
ref = torch.empty_like(out)
for i in range(L):
    lo = max(0, i - W + 1)
    s = (x[i] @ Wq) @ (x[lo:i + 1] @ Wk).T / D ** 0.5
    ref[i] = s.softmax(0) @ (x[lo:i + 1] @ Wv)
diff = (out - ref).abs().max().item()
print("max diff", diff)
assert diff < 1e-12
