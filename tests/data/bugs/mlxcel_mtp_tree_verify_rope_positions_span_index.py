# mlxcel (lablup/mlxcel#1214, "branch the draft tree, and verify it at its own positions"): the MTP tree
# verify handed the flattened tree to the target with the ancestor mask but RoPE positions offset+span index,
# so once a sibling exists every later node sits one place too far along (fix: offset + DraftTree depths).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
VOCAB, HID, NH, HD, LAYERS = 64, 48, 4, 12, 2


class DraftTree:
    """Flattened token tree: node 0 is the root (the pending token), parents[i] < i."""

    def __init__(self, tokens, parents):
        self.tokens, self.parents = tokens, parents

    def depths(self):
        d = [0] * len(self.parents)
        for i, p in enumerate(self.parents):
            d[i] = 0 if p < 0 else d[p] + 1
        return d

    def additive_mask_with_history(self, offset):
        """[n, offset + n]: every node sees the KV history in full, then only itself and its ancestors."""
        n = len(self.parents)
        m = torch.full((n, offset + n), float("-inf"), dtype=torch.float64)
        m[:, :offset] = 0.0
        for i in range(n):
            j = i
            while j >= 0:
                m[i, offset + j] = 0.0
                j = self.parents[j]
        return m


def rope(x, pos):  # x [B, H, T, D]
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HID, 3 * HID)
        self.o = nn.Linear(HID, HID)
        self.mlp = nn.Sequential(nn.Linear(HID, 2 * HID), nn.SiLU(), nn.Linear(2 * HID, HID))

    def forward(self, x, pos, mask, cache):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, NH, HD).permute(2, 0, 3, 1, 4)
        q, k = rope(q, pos), rope(k, pos)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, HID))
        return x + self.mlp(x), (k, v)


class Target(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HID)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(HID, VOCAB)

    def forward(self, ids, pos, mask, caches=None):
        x, new = self.emb(ids)[None], []
        for i, l in enumerate(self.layers):
            x, c = l(x, pos, mask, None if caches is None else caches[i])
            new.append(c)
        return self.head(x)[0], new


model = Target().double().eval()
history = torch.randint(0, VOCAB, (9,))
offset = len(history)
# root = pending token; chain child d1 and the drafter's runner-up d1' as a sibling leaf; d2 under d1
tree = DraftTree(tokens=[5, 17, 33, 40, 8], parents=[-1, 0, 0, 1, 3])

with torch.no_grad():
    causal = torch.full((offset, offset), float("-inf"), dtype=torch.float64).triu(1)
    _, caches = model(history, torch.arange(offset), causal)  # prefill fills the KV history
    if FIXED:
        positions = offset + torch.tensor(tree.depths())
    else:
        positions = offset + torch.arange(len(tree.tokens))  # position = index in the flattened span
    print("verify positions:", positions.tolist(), "depths:", tree.depths())
    logits, _ = model(torch.tensor(tree.tokens), positions, tree.additive_mask_with_history(offset), caches)

    worst = 0.0
    for i in range(len(tree.tokens)):  # reference: each root-to-node path decoded as a plain sequence
        path, j = [], i
        while j >= 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        seq = torch.cat([history, torch.tensor(path[::-1])])
        L = len(seq)
        ref, _ = model(seq, torch.arange(L), torch.full((L, L), float("-inf"), dtype=torch.float64).triu(1))
        worst = max(worst, (logits[i] - ref[-1]).abs().max().item())
print(f"max |tree verify logits - per-path causal reference| = {worst:.3e}")
