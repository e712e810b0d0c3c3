# transformer-xl pytorch/mem_transformer.py MemTransformerLM._forward: dec_attn_mask = triu(ones(qlen, klen), diagonal=1+mlen)
# (True/1 = masked); queries see all mlen memory slots plus causal current segment. Checked vs one causal pass over mem+segment.
import torch
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, mlen, qlen = 32, 7, 6
Wq, Wk, Wv = (torch.randn(D, D) / D**0.5 for _ in range(3))
def layer(h, mems, mask):
    cat = torch.cat([mems, h], 0) if mems is not None else h   # (klen, B, D) like TXL (seq-first)
    q, k, v = h @ Wq, cat @ Wk, cat @ Wv
    score = torch.einsum('ibd,jbd->ijb', q, k) / D**0.5
    score = score.masked_fill(mask[:, :, None], float('-inf'))
    return torch.einsum('ijb,jbd->ibd', score.softmax(1), v)
x = torch.randn(mlen + qlen, 2, D)
mems, h = x[:mlen], x[mlen:]
klen = mlen + qlen
dec_attn_mask = torch.triu(torch.ones(qlen, klen, dtype=torch.uint8), diagonal=1 + mlen).bool()
out = layer(h, mems, dec_attn_mask)
full_mask = torch.triu(torch.ones(klen, klen, dtype=torch.uint8), diagonal=1).bool()
Wq_full = layer(x, None, full_mask)[mlen:]     # same rows from a plain causal pass over the whole stream
d = (out - Wq_full).abs().max().item()
print("max diff memory vs full causal:", d); assert d < 1e-10
