# lucidrains retro_pytorch/retro_pytorch.py ChunkedCrossAttention: pad/shift by chunk_size-1, each chunk attends to its
# neighbours (context_mask True = keep, padded neighbour tokens masked); first chunk_size-1 tokens attend nothing -> 0.
import torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, cs, n_chunks, K, R = 16, 4, 3, 2, 5        # chunk size, chunks, neighbours, neighbour length
N = cs * n_chunks
Wq, Wk, Wv = (torch.randn(D, D) / D**0.5 for _ in range(3))
x = torch.randn(1, N, D)
ctx = torch.randn(1, n_chunks, K, R, D)
ctx_mask = torch.ones(1, n_chunks, K, R, dtype=torch.bool); ctx_mask[0, 1, 1, 3:] = False; ctx_mask[0, 2, 0, 4:] = False
causal_padding = cs - 1
xs = F.pad(x, (0, 0, -causal_padding, causal_padding), value=0.)    # shift left, pad right
xs = xs.reshape(1, n_chunks, cs, D)
q = xs @ Wq; c = ctx.reshape(1, n_chunks, K * R, D); k, v = c @ Wk, c @ Wv
sim = q @ k.transpose(-1, -2) / D**0.5
m = ctx_mask.reshape(1, n_chunks, 1, K * R)
sim = sim.masked_fill(~m, -torch.finfo(sim.dtype).max)
o = (sim.softmax(-1) @ v).reshape(1, N, D)
o = F.pad(o, (0, 0, causal_padding, -causal_padding), value=0.)    # shift back; first cs-1 rows zero
# the last chunk's retrieval is only used by its final token; tokens past N would belong to a nonexistent chunk
ref = torch.zeros(1, N, D)
for i in range(N):
    if i < causal_padding: continue
    ch = (i - causal_padding) // cs
    kk = ctx[0, ch][ctx_mask[0, ch]]                                  # keep only valid neighbour tokens
    s = (x[0, i] @ Wq) @ (kk @ Wk).T / D**0.5
    ref[0, i] = s.softmax(-1) @ (kk @ Wv)
d = (o - ref).abs().max().item()
print("max diff chunked vs per-token loop:", d); assert d < 1e-10
