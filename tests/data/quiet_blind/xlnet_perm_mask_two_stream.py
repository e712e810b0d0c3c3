# Follows HF transformers models/xlnet/modeling_xlnet.py (XLNetModel.forward: perm_mask[b,i,j]=1 means i may NOT
# attend j; content stream adds -eye so a token sees itself, query stream does not). The query row of the first
# token in the factorisation order legitimately sees nothing (no memory): its output is defined as zero here.
import torch
torch.manual_seed(0)
B, T, D = 2, 8, 16
perms = [torch.randperm(T) for _ in range(B)]
rank = torch.stack([torch.argsort(p) for p in perms])            # rank[b, pos] = order in factorisation
perm_mask = (rank[:, None, :] >= rank[:, :, None]).double()     # 1 = i cannot see j (j not strictly before i)
h = torch.randn(B, T, D, dtype=torch.float64)                   # content stream
g = torch.randn(B, T, D, dtype=torch.float64)                   # query stream
Wq, Wk, Wv = (torch.randn(D, D, dtype=torch.float64) / 4 for _ in range(3))

def attend(q_in, kv_in, blocked):
    s = (q_in @ Wq) @ (kv_in @ Wk).transpose(1, 2) / D ** 0.5
    s = s.masked_fill(blocked.bool(), float("-inf"))
    any_key = (~blocked.bool()).any(-1, keepdim=True)
    p = torch.where(any_key, torch.softmax(s.masked_fill(~any_key, 0.0), -1), torch.zeros_like(s))
    return p @ (kv_in @ Wv)

non_tgt = -torch.eye(T, dtype=torch.float64)
content_blocked = (perm_mask + non_tgt) > 0     # as in XLNet: attn_mask_h = (attn_mask + non_tgt_mask) > 0
query_blocked = perm_mask > 0                   # attn_mask_g = attn_mask
out_h = attend(h, h, content_blocked)
out_g = attend(g, h, query_blocked)

ref_h = torch.zeros_like(out_h); ref_g = torch.zeros_like(out_g)
for b in range(B):
    for i in range(T):
        for out, src, inclusive in ((ref_h, h, True), (ref_g, g, False)):
            js = [j for j in range(T) if rank[b, j] < rank[b, i] or (inclusive and j == i)]
            if not js:
                continue
            q = src[b, i] @ Wq
            k = h[b, js] @ Wk; v = h[b, js] @ Wv
            out[b, i] = torch.softmax(k @ q / D ** 0.5, 0) @ v
diff = max((out_h - ref_h).abs().max().item(), (out_g - ref_g).abs().max().item())
print("max diff", diff)
assert diff < 1e-12
