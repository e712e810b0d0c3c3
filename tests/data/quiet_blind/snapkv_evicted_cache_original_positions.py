# Follows FasterDecoding/SnapKV snapkv/monkeypatch/snapkv_utils.py SnapKVCluster.update_kv: the last window_size prompt
# queries vote (causal-masked softmax, pooled) for prefix keys; top max_capacity-window keys + the window are kept with
# RoPE already applied at ORIGINAL positions. Decoding attends to kept keys unmasked; reference = full cache, -inf bias on evicted.
import torch, torch.nn.functional as F
torch.manual_seed(2)
D, L, WIN, CAP, NEW = 16, 20, 4, 10, 5

def rope(x, pos):
    half = x.shape[-1] // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = pos[:, None].double() * inv[None]
    c, s = ang.cos(), ang.sin()
    return torch.cat([x[..., :half] * c - x[..., half:] * s, x[..., :half] * s + x[..., half:] * c], -1)

Wq, Wk, Wv = (torch.randn(D, D, dtype=torch.float64) / D**0.5 for _ in range(3))
x = torch.randn(L + NEW, D, dtype=torch.float64)
pos = torch.arange(L + NEW)
Kall = rope(x @ Wk, pos); Vall = x @ Wv; Qall = rope(x @ Wq, pos)

# update_kv on the prompt
q_win = Qall[L - WIN:L]
aw = q_win @ Kall[:L].T / D**0.5
mask = torch.full((WIN, WIN), torch.finfo(aw.dtype).min, dtype=aw.dtype)
mask = mask.masked_fill(torch.arange(WIN)[:, None] >= torch.arange(WIN)[None, :], 0)  # causal inside window
aw[:, -WIN:] += mask
aw = F.softmax(aw, dim=-1)
vote = aw[:, :-WIN].sum(0)
vote = F.avg_pool1d(vote.view(1, 1, -1), kernel_size=5, padding=2, stride=1).view(-1)
idx = vote.topk(CAP - WIN).indices.sort().values
kept = torch.cat([idx, torch.arange(L - WIN, L)])
Kc, Vc = Kall[kept], Vall[kept]

outs, refs = [], []
keep_mask = torch.zeros(L + NEW, dtype=torch.bool); keep_mask[kept] = True
for t in range(L, L + NEW):
    Kc = torch.cat([Kc, Kall[t:t+1]]); Vc = torch.cat([Vc, Vall[t:t+1]]); keep_mask[t] = True
    outs.append(F.scaled_dot_product_attention(Qall[t:t+1][None], Kc[None], Vc[None])[0])
    bias = torch.zeros(t + 1, dtype=torch.float64).masked_fill(~keep_mask[:t + 1], float('-inf'))
    refs.append(F.scaled_dot_product_attention(Qall[t:t+1][None], Kall[:t+1][None], Vall[:t+1][None], attn_mask=bias[None, None])[0])
diff = (torch.cat(outs) - torch.cat(refs)).abs().max().item()
print("SnapKV compressed cache vs full cache with evicted -inf bias max diff", diff)
assert diff < 1e-12
