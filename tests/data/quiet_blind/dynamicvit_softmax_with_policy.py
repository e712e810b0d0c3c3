# Follows raoyongming/DynamicViT models/dyvit.py, Attention.softmax_with_policy: policy [B, N, 1] (1 keep,
# 0 pruned) becomes attn_policy [B,1,1,N] + eye, so kept keys are visible to all queries and a pruned token
# still sees itself; softmax is computed with max subtraction and an eps/N smoothing.
import torch

torch.manual_seed(0)
dt = torch.float64
B, N, C, Hh = 2, 17, 32, 4
hd = C // Hh
x = torch.randn(B, N, C, dtype=dt)
qkv_w = torch.randn(C, 3 * C, dtype=dt) / C ** 0.5
policy = (torch.rand(B, N, 1) > 0.45).to(dt)
policy[:, 0] = 1.0                                     # CLS token is always kept


def softmax_with_policy(attn, policy, eps=1e-6):
    B, N, _ = policy.size()
    B, H, N, N = attn.size()
    attn_policy = policy.reshape(B, 1, 1, N)
    eye = torch.eye(N, dtype=attn_policy.dtype, device=attn_policy.device).view(1, 1, N, N)
    attn_policy = attn_policy + (1.0 - attn_policy) * eye
    max_att, _ = torch.max(attn, dim=-1, keepdim=True)
    attn = attn - max_att
    attn = attn.exp_() * attn_policy
    attn = (attn + eps / N) / (attn.sum(dim=-1, keepdim=True) + eps)
    return attn.type_as(max_att)


qkv = (x @ qkv_w).reshape(B, N, 3, Hh, hd).permute(2, 0, 3, 1, 4)
q, k, v = qkv[0], qkv[1], qkv[2]
attn = (q @ k.transpose(-2, -1)) * hd ** -0.5
out_eps0 = softmax_with_policy(attn.clone(), policy, eps=0.0) @ v
out_eps = softmax_with_policy(attn.clone(), policy) @ v

# reference: keep tokens physically gathered (inference path), pruned tokens attend to kept + themselves
d0, d1 = 0.0, 0.0
for b in range(B):
    kept = [j for j in range(N) if policy[b, j, 0] == 1]
    for i in range(N):
        keys = kept if i in kept else kept + [i]
        a = attn[b][:, i, keys].softmax(-1)             # [H, |keys|]
        ref = torch.einsum('hk,hkd->hd', a, v[b][:, keys])
        d0 = max(d0, (out_eps0[b, :, i] - ref).abs().max().item())
        d1 = max(d1, (out_eps[b, :, i] - ref).abs().max().item())
print("max |policy softmax (eps=0) - gathered kept tokens| =", d0)
print("max |policy softmax (eps=1e-6) - gathered kept tokens| =", d1)
assert d0 < 1e-12 and d1 < 1e-5
