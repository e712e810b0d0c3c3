# Follows FasterDecoding/Medusa medusa/model/utils.py generate_medusa_buffers (medusa_attn_mask from sorted
# medusa_choices, medusa_position_ids = depth) and medusa/model/modeling_llama_kv.py _prepare_decoder_attention_mask
# (causal float mask whose last tree block is overwritten with finfo.min where medusa_mask == 0). Tree tokens after a cache.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
D, H, V = 32, 4, 24
hd = D // H
medusa_choices = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2]]


def generate_medusa_buffers(choices):
    sorted_choices = sorted(choices, key=lambda x: (len(x), x))
    n = len(sorted_choices) + 1
    mask = torch.eye(n, n)
    mask[:, 0] = 1
    for index, c in enumerate(sorted_choices):
        for c_id in range(len(c) - 1):
            ancestor_idx = sorted_choices.index(c[:c_id + 1]) + 1
            mask[index + 1, ancestor_idx] = 1
    pos = torch.zeros(n, dtype=torch.long)
    for index, c in enumerate(sorted_choices):
        pos[index + 1] = len(c)
    return sorted_choices, mask, pos


def rope(x, pos):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = pos.double()[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


emb = nn.Embedding(V, D).double()
qkv = nn.Linear(D, 3 * D, bias=False).double()
o_proj = nn.Linear(D, D, bias=False).double()
lm_head = nn.Linear(D, V, bias=False).double()


def forward(ids, pos, past=None, medusa_mask=None):
    x = emb(ids)[None]
    L = x.shape[1]
    q, k, v = [t.view(1, L, H, hd).transpose(1, 2) for t in qkv(x).chunk(3, -1)]
    q, k = rope(q, pos), rope(k, pos)
    if past is not None:
        k = torch.cat([past[0], k], 2)
        v = torch.cat([past[1], v], 2)
    K = k.shape[2]
    mn = torch.finfo(torch.float64).min
    mask = torch.full((L, K), mn, dtype=torch.float64)
    mask = torch.triu(mask, diagonal=K - L + 1)  # plain causal with past offset
    if medusa_mask is not None:
        m = mask[None, None]
        m[:, :, -L:, -L:][medusa_mask[None, None] == 0] = mn
    s = q @ k.transpose(-1, -2) * hd ** -0.5 + mask
    y = x + o_proj((F.softmax(s, -1) @ v).transpose(1, 2).reshape(1, L, D))
    return lm_head(y)[0], (k, v)


sorted_choices, tree_mask, depth = generate_medusa_buffers(medusa_choices)
prefix = torch.randint(0, V, (9,))
with torch.no_grad():
    _, cache = forward(prefix, torch.arange(len(prefix)))
    root = torch.tensor([3])
    # candidate token for node c = (c[-1] + 5*depth) % V, i.e. the c[-1]-th top-k of medusa head len(c)
    cand = torch.tensor([(c[-1] + 5 * len(c)) % V for c in sorted_choices])
    tree_ids = torch.cat([root, cand])
    tree_logits, _ = forward(tree_ids, len(prefix) + depth, past=cache, medusa_mask=tree_mask)

    diff = 0.0
    nodes = [[]] + sorted_choices
    for j, c in enumerate(nodes):
        path = [0] + [sorted_choices.index(c[:i + 1]) + 1 for i in range(len(c))]
        seq = torch.cat([prefix, tree_ids[path]])
        ref, _ = forward(seq, torch.arange(len(seq)))  # plain causal, no cache, the node's own path only
        diff = max(diff, (tree_logits[j] - ref[-1]).abs().max().item())
print("max |tree-masked cached verification - each path decoded alone| =", diff)
assert diff < 1e-12
