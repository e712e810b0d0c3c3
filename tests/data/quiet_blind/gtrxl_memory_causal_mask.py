# Follows opendilab/DI-engine ding/torch_utils/network/gtrxl.py (GTrXL.forward): with mem_len cached
# memories, attn_mask = triu(ones(cur_seq, full_seq), diagonal=1+prev_seq) -- True = masked; every query sees
# all memory slots plus its causal past in the current segment.
import torch
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D = 32; mem_len = 4; cur = 5
Wq, Wk, Wv = (torch.randn(D, D) / D ** 0.5 for _ in range(3))

def layer(x, mem):
    full = torch.cat([mem, x], 0)
    prev_seq, cur_seq, full_seq = mem.shape[0], x.shape[0], full.shape[0]
    attn_mask = torch.triu(torch.ones((cur_seq, full_seq)), diagonal=1 + prev_seq).bool()  # True = masked
    s = (x @ Wq) @ (full @ Wk).T / D ** 0.5
    s = s.masked_fill(attn_mask, -float("inf"))
    return s.softmax(-1) @ (full @ Wv)

stream = torch.randn(mem_len + 2 * cur, D)
mem = stream[:mem_len]
outs = []
for seg in range(2):  # two segments; memory slides with detach like GTrXL's Memory.update
    x = stream[mem_len + seg * cur: mem_len + (seg + 1) * cur]
    outs.append(layer(x, mem))
    mem = torch.cat([mem, x], 0)[-mem_len:].detach()
out = torch.cat(outs)
# reference: explicit per-query loop over the stream; each query sees the mem_len items before its segment + causal
diff = 0.0
for seg in range(2):
    start = mem_len + seg * cur
    for j in range(cur):
        p = start + j
        keys = stream[start - mem_len: p + 1]
        s = (stream[p] @ Wq) @ (keys @ Wk).T / D ** 0.5
        ref = s.softmax(-1) @ (keys @ Wv)
        diff = max(diff, (out[seg * cur + j] - ref).abs().max().item())
print("max diff", diff)
assert diff < 1e-12
