# nanoGPT model.py CausalSelfAttention: slow path uses registered buffer bias=tril(block_size) sliced [:T,:T],
# masked_fill(bias==0, -inf); fast path is SDPA is_causal=True. Compared with an explicit per-query loop.
import math, torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, H, BS, T = 48, 3, 32, 20
hd = D // H
c_attn = torch.nn.Linear(D, 3 * D); c_proj = torch.nn.Linear(D, D)
bias = torch.tril(torch.ones(BS, BS)).view(1, 1, BS, BS)
x = torch.randn(2, T, D)
q, k, v = c_attn(x).split(D, 2)
q, k, v = [t.view(2, T, H, hd).transpose(1, 2) for t in (q, k, v)]
att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
att = att.masked_fill(bias[:, :, :T, :T] == 0, float('-inf'))
slow = c_proj((F.softmax(att, -1) @ v).transpose(1, 2).reshape(2, T, D))
fast = c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, T, D))
loop = torch.zeros(2, H, T, hd)
for i in range(T):
    s = q[:, :, i:i + 1] @ k[:, :, :i + 1].transpose(-2, -1) / math.sqrt(hd)
    loop[:, :, i] = (s.softmax(-1) @ v[:, :, :i + 1])[:, :, 0]
loop = c_proj(loop.transpose(1, 2).reshape(2, T, D))
d = max((slow - loop).abs().max().item(), (fast - loop).abs().max().item())
print("max diff slow/fast vs loop:", d); assert d < 1e-10
