"""Speculative decoding with a static token tree verified over a static KV cache (Sequoia-style).

Follows Infini-AI-Lab/Sequoia:
  Engine.py  GraphInferenceEngineTG.inference(input_ids, storage_ids, position_ids, attn_mask):
      k/v written at storage_ids of a preallocated cache, attention over the whole cache with a float
      mask (0 = visible, torch.finfo(dtype).min = hidden) of shape (1, 1, n, max_length)
  Tree/SpecTree.py  verify(): tree nodes stored after the accepted prefix, position_ids = prefix_len + depth,
      attn_mask rows = prefix columns 0 plus the node's ancestors (and itself) from the growmap's tree mask;
      greedy acceptance walks from the root to the child whose token equals the target's argmax;
      gather_kv_incremental copies the accepted nodes' KV into contiguous slots.
Reduced: a 2-layer RoPE decoder (hidden 32), a draft made by perturbing its weights, a fixed 8-node tree
(root, 2 children, 4 grandchildren, 1 great-grandchild), cache of 48 slots, float64.
Reference: the target model's plain greedy decoding with a full recompute each step and no cache; the tokens
must match and each tree node's logits must equal a full recompute of the prefix plus the node's path.
"""
import copy
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
V, D, H, L, MAX = 40, 32, 4, 2, 48
HD = D // H
MIN = torch.finfo(torch.float64).min


def rope(x, pos):  # x (1, H, n, HD)
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2) / HD))
    ang = pos.double()[:, None] * inv[None]
    c, s = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return x * c + torch.cat([-x2, x1], -1) * s


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.qkv = nn.ModuleList([nn.Linear(D, 3 * D, bias=False) for _ in range(L)])
        self.o = nn.ModuleList([nn.Linear(D, D, bias=False) for _ in range(L)])
        self.mlp = nn.ModuleList([nn.Sequential(nn.Linear(D, 64), nn.SiLU(), nn.Linear(64, D)) for _ in range(L)])
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids, position_ids, attn_mask=None, storage_ids=None, cache=None):
        """With a cache: k/v stored at storage_ids, attn over all MAX slots with the float attn_mask."""
        x = self.emb(ids)
        n = ids.shape[1]
        for l in range(L):
            h = F.rms_norm(x, (D,))
            q, k, v = self.qkv[l](h).view(1, n, 3, H, HD).permute(2, 0, 3, 1, 4)
            q, k = rope(q, position_ids), rope(k, position_ids)
            if cache is None:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                cache[l][0][:, :, storage_ids] = k
                cache[l][1][:, :, storage_ids] = v
                a = F.scaled_dot_product_attention(q, cache[l][0], cache[l][1], attn_mask=attn_mask)
            x = x + self.o[l](a.transpose(1, 2).reshape(1, n, D))
            x = x + self.mlp[l](F.rms_norm(x, (D,)))
        return self.head(F.rms_norm(x, (D,)))


def full(model, ids):
    return model(torch.tensor([ids]), torch.arange(len(ids)))[0]


target = Model().eval()
draft = copy.deepcopy(target)
with torch.no_grad():
    for p in draft.parameters():
        p.add_(0.05 * torch.randn_like(p))

# growmap: parent of each node (node 0 = root); branching 2,2,1
parents = [-1, 0, 0, 1, 1, 2, 2, 3]
depth = [0, 1, 1, 2, 2, 2, 2, 3]
T = len(parents)
tree_mask = torch.zeros(T, T, dtype=torch.bool)
for i in range(T):
    j = i
    while j >= 0:
        tree_mask[i, j] = True
        j = parents[j]
children = {i: [c for c in range(T) if parents[c] == i] for i in range(T)}

prompt = torch.randint(0, V, (7,)).tolist()
GEN = 14
with torch.no_grad():
    cache = [[torch.zeros(1, H, MAX, HD), torch.zeros(1, H, MAX, HD)] for _ in range(L)]
    P = len(prompt)
    mask = torch.full((P, MAX), MIN)
    mask[:, :P] = torch.where(torch.tril(torch.ones(P, P, dtype=torch.bool)), 0.0, MIN)
    logits = target(torch.tensor([prompt]), torch.arange(P), mask[None, None], torch.arange(P), cache)
    out = prompt + [int(logits[0, -1].argmax())]   # the root token is the target's own choice
    cur, max_node_diff, rounds = P, 0.0, 0
    while len(out) - P < GEN:
        rounds += 1
        # draft proposes the tree tokens (top-k children along each node's path)
        tokens, paths = [out[-1]] + [0] * (T - 1), {0: [out[-1]]}
        for i in range(T):
            kids = children[i]
            if kids:
                top = full(draft, out[:-1] + paths[i])[-1].topk(len(kids)).indices.tolist()
                for c, tok in zip(kids, top):
                    tokens[c], paths[c] = tok, paths[i] + [tok]
        storage = torch.arange(cur, cur + T)
        mask = torch.full((T, MAX), MIN)
        mask[:, :cur] = 0.0
        mask[:, cur:cur + T] = torch.where(tree_mask, 0.0, MIN)
        tl = target(torch.tensor([tokens]), cur + torch.tensor(depth), mask[None, None], storage, cache)[0]
        for i in range(T):
            ref = full(target, out[:-1] + paths[i])[-1]
            max_node_diff = max(max_node_diff, (ref - tl[i]).abs().max().item())
        node, accepted = 0, [0]
        while True:
            want = int(tl[node].argmax())
            nxt = [c for c in children[node] if tokens[c] == want]
            if not nxt:
                break
            node = nxt[0]
            accepted.append(node)
        # gather_kv_incremental: accepted nodes' KV to contiguous slots after the prefix
        src = storage[accepted]
        for l in range(L):
            for t in cache[l]:
                t[:, :, cur:cur + len(accepted)] = t[:, :, src].clone()
        cur += len(accepted)
        out += [tokens[a] for a in accepted[1:]] + [want]

    ref_ids = list(prompt)
    while len(ref_ids) < len(out):
        ref_ids.append(int(full(target, ref_ids)[-1].argmax()))

print("rounds", rounds, "tokens", len(out) - P, "->", out[P:])
print("max |tree-node logits - full recompute|:", max_node_diff)
assert ref_ids == out, (ref_ids, out)
assert max_node_diff < 1e-10
