# Correct program. Ported from zankner/Hydra hydra/model/utils.py (generate_hydra_buffers: tree_attn_mask
# with each node attending its ancestors, tree_indices / hydra_position_ids = depth) and tree_decoding, which
# writes the tree mask into the bottom-right of the causal mask after the KV cache of the prefix.
import torch, torch.nn.functional as F
torch.manual_seed(0)
D, H, V = 16, 2, 12
emb = torch.nn.Embedding(V, D); pos = torch.nn.Embedding(32, D)
wq, wk, wv = (torch.nn.Linear(D, D) for _ in range(3))
paths = [(0,), (1,), (0, 0), (0, 1), (1, 0)]           # hydra_choices
nodes = [()] + paths
parent = [-1] + [nodes.index(p[:-1]) for p in paths]
depth = torch.tensor([len(p) for p in nodes])
N = len(nodes)
tree_attn_mask = torch.eye(N)
for i in range(1, N):
    j = parent[i]
    while j >= 0: tree_attn_mask[i, j] = 1; j = parent[j]
prefix = torch.tensor([3, 4, 5]); P = len(prefix)
cand = torch.tensor([7, 1, 2, 8, 9, 10])
sp = lambda t: t.view(1, -1, H, D // H).transpose(1, 2)
def kv(tok, positions): x = emb(tok) + pos(positions); return x, wk(x), wv(x)
_, kp, vp = kv(prefix, torch.arange(P))
xt, kt, vt = kv(cand, P + depth)
mask = torch.ones(N, P + N)
mask[:, P:] = tree_attn_mask
bias = torch.zeros_like(mask).masked_fill(mask == 0, float("-inf"))
o = F.scaled_dot_product_attention(sp(wq(xt)), sp(torch.cat([kp, kt])), sp(torch.cat([vp, vt])), attn_mask=bias)
o = o.transpose(1, 2).reshape(N, D)
for i in range(N):                                    # reference: each root-to-node path run causally
    chain = [i]
    while parent[chain[-1]] >= 0: chain.append(parent[chain[-1]])
    chain = chain[::-1]
    seq = torch.cat([prefix, cand[chain]])
    x = emb(seq) + pos(torch.arange(len(seq)))
    r = F.scaled_dot_product_attention(sp(wq(x)), sp(wk(x)), sp(wv(x)), is_causal=True)
    assert torch.allclose(o[i], r.transpose(1, 2).reshape(-1, D)[-1], atol=1e-5)
print("ok")
