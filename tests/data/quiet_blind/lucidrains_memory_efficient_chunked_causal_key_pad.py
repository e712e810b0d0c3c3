# Follows lucidrains/memory-efficient-attention-pytorch memory_efficient_attention.py (summarize_qkv_chunk / 
# memory_efficient_attention): q and k chunked, causal mask rebuilt per chunk with offsets, key mask True = keep,
# chunks merged by running max/exp-sums; right-padded keys masked, pad query rows dropped afterwards.
import torch
torch.manual_seed(9); torch.set_default_dtype(torch.float64)
B, T, D, QC, KC = 2, 30, 16, 8, 7
q, k, v = torch.randn(3, B, T, D).unbind(0)
mask = torch.arange(T)[None] < torch.tensor([[30], [19]])          # True = real key

def chunked(q, k, v, mask):
    outs = []
    for qs in range(0, T, QC):
        qc = q[:, qs:qs + QC]; num = 0; den = 0; m = torch.full((B, qc.shape[1], 1), -torch.finfo(q.dtype).max)
        parts = []
        for ks in range(0, T, KC):
            s = qc @ k[:, ks:ks + KC].transpose(1, 2) / D ** 0.5
            qi = torch.arange(qs, qs + qc.shape[1])[:, None]; ki = torch.arange(ks, min(ks + KC, T))[None]
            keep = (ki <= qi)[None] & mask[:, None, ks:ks + KC]
            s = s.masked_fill(~keep, -torch.finfo(s.dtype).max)
            cm = s.amax(-1, keepdim=True).detach()
            e = (s - cm).exp() * keep
            parts.append((e @ v[:, ks:ks + KC], e.sum(-1, keepdim=True), cm))
        gm = torch.stack([p[2] for p in parts]).amax(0)
        num = sum(p[0] * (p[2] - gm).exp() for p in parts); den = sum(p[1] * (p[2] - gm).exp() for p in parts)
        outs.append(num / den.clamp(min=1e-30))
    return torch.cat(outs, 1)

out = chunked(q, k, v, mask)
diff = 0.0
for b, n in enumerate([30, 19]):                       # each sequence alone, unpadded, full causal softmax
    s = q[b, :n] @ k[b, :n].T / D ** 0.5
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    diff = max(diff, (s.softmax(-1) @ v[b, :n] - out[b, :n]).abs().max().item())
print("max diff chunked causal+key-pad vs each sequence alone:", diff)
assert diff < 1e-12
