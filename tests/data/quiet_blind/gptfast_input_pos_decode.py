# gpt-fast model.py (Transformer.forward: mask = self.causal_mask[None, None, input_pos]) + KVCache.update.
# Bool mask True = keep, rows selected by input_pos from a max_seq x max_seq tril; cache slots past input_pos are zeros but masked.
import torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, H, MAX = 32, 4, 24
hd = D // H
Wqkv = torch.randn(D, 3 * D) / D**0.5; Wo = torch.randn(D, D) / D**0.5
causal_mask = torch.tril(torch.ones(MAX, MAX, dtype=torch.bool))
k_cache = torch.zeros(1, H, MAX, hd); v_cache = torch.zeros(1, H, MAX, hd)

def attn(x, input_pos, use_cache=True):
    B, T, _ = x.shape
    q, k, v = (x @ Wqkv).split(D, -1)
    q, k, v = [t.view(B, T, H, hd).transpose(1, 2) for t in (q, k, v)]
    if use_cache:
        k_cache[:, :, input_pos] = k; v_cache[:, :, input_pos] = v
        k, v = k_cache, v_cache
        mask = causal_mask[None, None, input_pos]          # (1,1,T,MAX)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, T, D) @ Wo

x = torch.randn(1, 14, D)
ref = attn(x, None, use_cache=False)
out = [attn(x[:, :9], torch.arange(9))]                      # prefill
for p in range(9, 14):                                        # decode one token at a time
    out.append(attn(x[:, p:p + 1], torch.tensor([p])))
diff = (torch.cat(out, 1) - ref).abs().max().item()
print("max diff cached vs full:", diff); assert diff < 1e-10
