# Follows HF transformers generation/utils.py (prepare_inputs_for_generation: position_ids = attention_mask.cumsum(-1)-1,
# masked_fill(mask==0, 1); attention_mask grows by 1 each step) with an eager fallback attention over a KV cache whose
# query offset is past_len: key j is visible to query i iff j <= past_len+i and attention_mask[j]. Left padding.
import torch
torch.manual_seed(0)
D, V = 16, 20
emb = torch.randn(V, D, dtype=torch.float64); pos_emb = torch.randn(32, D, dtype=torch.float64)
Wq, Wk, Wv, Wo = (torch.randn(D, D, dtype=torch.float64) / 4 for _ in range(4))
def step(ids, pos, am, cache):
    x = emb[ids] + pos_emb[pos]
    q, k, v = x @ Wq, x @ Wk, x @ Wv
    if cache is not None:
        k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)
    past = k.shape[1] - ids.shape[1]
    causal = torch.arange(k.shape[1])[None, :] <= past + torch.arange(ids.shape[1])[:, None]
    keep = causal[None] & am[:, None, :].bool()
    s = (q @ k.transpose(1, 2) / D ** 0.5).masked_fill(~keep, torch.finfo(torch.float64).min)
    return torch.softmax(s, -1) @ v @ Wo, (k, v)
prompts = [[3, 4, 5, 6, 7], [8, 9]]
T = 5
ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
am = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
pos = (am.cumsum(-1) - 1).masked_fill(am == 0, 1)
out, cache = step(ids, pos, am, None)
logits = [out[:, -1]]
new = torch.tensor([[11, 12, 13], [14, 15, 16]])
for t in range(3):
    am = torch.cat([am, torch.ones(2, 1, dtype=am.dtype)], 1)
    p = (am.sum(-1, keepdim=True) - 1)
    o, cache = step(new[:, t:t+1], p, am, cache)
    logits.append(o[:, -1])
diff = 0.0
for b, pr in enumerate(prompts):
    full = torch.tensor([pr + new[b].tolist()])
    L = full.shape[1]
    ref, _ = step(full, torch.arange(L)[None], torch.ones(1, L), None)
    for t in range(4):
        diff = max(diff, (ref[0, len(pr) - 1 + t] - logits[t][b]).abs().max().item())
print("max diff", diff)
assert diff < 1e-12
