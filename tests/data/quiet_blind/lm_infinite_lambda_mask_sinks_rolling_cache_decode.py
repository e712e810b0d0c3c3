"""LM-Infinite Lambda-shaped attention: starting tokens + a local window, decoded
with a rolling KV cache that keeps the starting tokens.

Follows Glaciohound/LM-Infinite (models/lambda_attention.py: a "global branch" over
the first n_global tokens and a "local branch" over the last local_branch tokens,
everything in between masked) and the way StreamingLLM-style caches serve it at
decode time (sink slots never evicted, a ring buffer of window slots overwritten at
pos % size), not pinned. Prefill of a prompt uses the dense Lambda mask; then every
new token attends to the sink slots plus the valid ring slots. The ring is not in
position order after it wraps, so its mask is read from the stored positions, not
from the slot index. Reference: the dense Lambda mask over the whole sequence, no
cache. Positions go into the embeddings (no rope), so no distance cap is needed.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, HD = 32, 4, 8
N_GLOBAL, LOCAL = 2, 5                       # sinks, local branch (incl. the token itself)
T_PROMPT, T_TOTAL = 7, 20

wq, wk, wv = (torch.nn.Linear(D, D, bias=False) for _ in range(3))
tok = torch.nn.Embedding(40, D)
pos = torch.nn.Embedding(64, D)
ids = torch.randint(0, 40, (1, T_TOTAL))


def heads(t):
    return t.view(t.shape[0], -1, H, HD).transpose(1, 2)


def lambda_mask(q_pos, k_pos):
    qp, kp = q_pos[:, None], k_pos[None, :]
    return (kp <= qp) & ((kp < N_GLOBAL) | (qp - kp < LOCAL))


with torch.no_grad():
    x = tok(ids) + pos(torch.arange(T_TOTAL))[None]
    q, k, v = heads(wq(x)), heads(wk(x)), heads(wv(x))
    p = torch.arange(T_TOTAL)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=lambda_mask(p, p))

    # ---- cached run: prefill then one token at a time
    sink_k, sink_v = k[:, :, :N_GLOBAL].clone(), v[:, :, :N_GLOBAL].clone()
    ring_k = torch.zeros(1, H, LOCAL, HD)
    ring_v = torch.zeros(1, H, LOCAL, HD)
    ring_pos = torch.full((LOCAL,), -1)         # -1: slot never written
    pp = torch.arange(T_PROMPT)
    prefill = F.scaled_dot_product_attention(q[:, :, :T_PROMPT], k[:, :, :T_PROMPT],
                                             v[:, :, :T_PROMPT], attn_mask=lambda_mask(pp, pp))
    for t in range(N_GLOBAL, T_PROMPT):          # non-sink prompt tokens go to the ring
        s = t % LOCAL
        ring_k[:, :, s], ring_v[:, :, s], ring_pos[s] = k[:, :, t], v[:, :, t], t

    outs = [prefill]
    for t in range(T_PROMPT, T_TOTAL):
        s = t % LOCAL                           # overwrite the oldest window slot
        ring_k[:, :, s], ring_v[:, :, s], ring_pos[s] = k[:, :, t], v[:, :, t], t
        keys = torch.cat([sink_k, ring_k], dim=2)
        vals = torch.cat([sink_v, ring_v], dim=2)
        ring_ok = (ring_pos >= 0) & (t - ring_pos < LOCAL)
        mask = torch.cat([torch.ones(N_GLOBAL, dtype=torch.bool), ring_ok])[None, :]
        outs.append(F.scaled_dot_product_attention(q[:, :, t:t + 1], keys, vals, attn_mask=mask))
    cached = torch.cat(outs, dim=2)

worst = (cached - reference).abs().max().item()
print(f"sinks + rolling window cache vs dense Lambda mask, max diff {worst:.2e}")
assert worst < 1e-5
