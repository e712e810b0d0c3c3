# Follows thuml Timer-XL as shipped in apache/iotdb iotdb-core/ainode/iotdb/ainode/core/util/masking.py
# (TimerMultivariateMask): mask = kron(ones(n_vars, n_vars), triu(ones(T, T), 1)), True = masked. A patch token of any
# variate sees every variate's patches up to its own time step (block-causal across the flattened variate-major axis).
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, V, T = 32, 4, 3, 8  # dim, heads, variates, patches per variate


class TimerMultivariateMask:
    def __init__(self, B, n_vars, n_tokens):
        m1 = torch.ones(n_vars, n_vars, dtype=torch.long)
        m2 = torch.triu(torch.ones(B, 1, n_tokens, n_tokens, dtype=torch.long), diagonal=1)
        self._mask = torch.kron(m1, m2).bool()  # (B, 1, V*T, V*T)

    @property
    def mask(self):
        return self._mask


qkv = torch.nn.Linear(D, 3 * D).double()
out = torch.nn.Linear(D, D).double()
B = 2
x = torch.randn(B, V * T, D, dtype=torch.float64)
q, k, v = [t.view(B, V * T, H, D // H).transpose(1, 2) for t in qkv(x).chunk(3, -1)]
masked = TimerMultivariateMask(B, V, T).mask
# F.scaled_dot_product_attention wants True = keep, so the masking convention is flipped on the way in
y = out(F.scaled_dot_product_attention(q, k, v, attn_mask=~masked).transpose(1, 2).reshape(B, V * T, D))

# reference: explicit per-query loop, keys = all tokens whose time index <= the query's time index
time = torch.arange(V * T) % T
ref = torch.empty_like(y)
for b in range(B):
    for i in range(V * T):
        keep = time <= time[i]
        s = (q[b, :, i:i + 1] @ k[b, :, keep].transpose(-1, -2)) / (D // H) ** 0.5
        o = torch.softmax(s, -1) @ v[b, :, keep]
        ref[b, i] = out(o.reshape(D))
diff = (y - ref).abs().max().item()
print("max |kron mask - per-query time<=t loop| =", diff)
assert diff < 1e-12
