# Follows transformers models/gemma3/modeling_gemma3.py token_type_ids_mask_function + causal mask:
# text is causal, but tokens of the same image block (token_type_ids == 1, same group) attend each other
# bidirectionally; right padding keys are masked. True = attend (bool mask into torch SDPA).
import torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
B, T, D, H = 2, 14, 32, 4
tt = torch.zeros(B, T, dtype=torch.long)
tt[0, 2:6] = 1; tt[0, 8:11] = 1; tt[1, 1:5] = 1
attn = torch.ones(B, T, dtype=torch.long); attn[1, 10:] = 0
def build(tt, am):
    T = tt.shape[1]; i = torch.arange(T)
    causal = i[None, :, None] >= i[None, None, :]
    is_img = tt == 1
    starts = is_img & ~F.pad(is_img[:, :-1], (1, 0), value=False)
    group = torch.where(is_img, torch.cumsum(starts.long(), 1), -1)
    same_img = (group[:, :, None] == group[:, None, :]) & (group[:, :, None] >= 0)
    return ((causal | same_img) & am.bool()[:, None, :])[:, None]
x = torch.randn(B, T, D); Wq, Wk, Wv = (torch.randn(D, D) / D**.5 for _ in range(3))
def heads(t): return t.view(t.shape[0], -1, H, D // H).transpose(1, 2)
out = F.scaled_dot_product_attention(heads(x @ Wq), heads(x @ Wk), heads(x @ Wv), attn_mask=build(tt, attn))
diff = 0.0
for b in range(B):
    n = int(attn[b].sum()); q, k, v = heads(x[b:b+1, :n] @ Wq), heads(x[b:b+1, :n] @ Wk), heads(x[b:b+1, :n] @ Wv)
    for t in range(n):
        vis = [s for s in range(n) if s <= t or (tt[b, t] == 1 and tt[b, s] == 1 and all(tt[b, min(s, t):max(s, t)+1] == 1))]
        w = torch.softmax(q[:, :, t:t+1] @ k[:, :, vis].transpose(-1, -2) / (D // H) ** .5, -1)
        diff = max(diff, (w @ v[:, :, vis] - out[b:b+1, :, t:t+1]).abs().max().item())
print("max diff", diff); assert diff < 1e-10
