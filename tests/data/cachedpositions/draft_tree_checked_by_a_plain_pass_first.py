"""Correct: a draft model grows a tree of guesses over its prompt cache, two nodes a depth, each node at position
prompt + depth and seeing the prompt's keys, its ancestors and itself (the draft's keys of every depth kept after the
prompt's). After the prompt's pass and before it drafts, the program checks the prompt's logits against a plain causal
pass over the prompt and a chain of three tokens (12 queries, 12 keys, no cache) at the same layer: that pass is not
the cache the tree grows on (9 prompt tokens). Each node's output equals a plain pass over the prompt and its path."""
import torch
from torch import nn
import torch.nn.functional as F


def rotate(x, position_ids):
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = position_ids[:, None, :, None].double() * freqs
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], dim=-1)


class Draft(nn.Module):
    def __init__(self, hidden=32, heads=2, vocab=40):
        super().__init__()
        self.heads, self.embed = heads, nn.Embedding(vocab, hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.head = nn.Linear(hidden, vocab)

    def split(self, x):
        return x.view(x.shape[0], x.shape[1], self.heads, -1).transpose(1, 2)

    def forward(self, ids, position_ids, keep, past=None):
        x = self.embed(ids)
        q, k, v = (self.split(f(x)) for f in (self.q, self.k, self.v))
        q, k = rotate(q, position_ids), rotate(k, position_ids)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
        return self.head(x + out.transpose(1, 2).reshape(x.shape)), (k, v)


def plain(draft, ids):
    n = ids.shape[1]
    return draft(ids, torch.arange(n)[None], torch.tril(torch.ones(n, n, dtype=torch.bool))[None])[0]


@torch.no_grad()
def main():
    torch.manual_seed(0)
    draft = Draft().double().eval()
    prompt, top_k, depth = torch.randint(0, 40, (1, 9)), 2, 4
    chain = torch.randint(0, 40, (1, 3))
    logits, cache = draft(prompt, torch.arange(9)[None], torch.tril(torch.ones(9, 9, dtype=torch.bool))[None])
    reference = plain(draft, torch.cat([prompt, chain], dim=1))  # the check: a plain causal pass, 12 tokens
    assert torch.allclose(logits, reference[:, :9])
    tokens = logits[:, -1].topk(top_k).indices  # (1, top_k): the first depth's nodes
    paths = [[int(t)] for t in tokens[0]]
    ancestors = torch.zeros(top_k, 0, dtype=torch.bool)  # (nodes, draft keys so far): which earlier nodes each sees
    drafted = []
    for d in range(depth):
        n_draft = ancestors.shape[1]
        keep = torch.cat([torch.ones(top_k, 9, dtype=torch.bool), ancestors, torch.eye(top_k, dtype=torch.bool)], 1)
        position_ids = torch.full((1, top_k), 9 + d)
        logits, cache = draft(tokens, position_ids, keep[None], cache)
        drafted.append((logits[0], [list(path) for path in paths]))
        best = logits[0].max(-1)
        parents = best.values.topk(top_k).indices  # the nodes expanded next: one child each, their best token
        tokens = best.indices[parents][None]
        seen = torch.cat([ancestors, torch.eye(top_k, dtype=torch.bool)], 1)  # (nodes, n_draft + top_k)
        ancestors = seen[parents]
        paths = [paths[int(p)] + [int(t)] for p, t in zip(parents, tokens[0])]
        assert ancestors.shape[1] == n_draft + top_k
    for d, (node_logits, node_paths) in enumerate(drafted):  # each node: the plain pass over prompt + its path
        for j, path in enumerate(node_paths):
            alone = plain(draft, torch.cat([prompt, torch.tensor([path])], dim=1))[0, -1]
            assert torch.allclose(node_logits[j], alone), (d, j)
    print("paths", paths)


if __name__ == "__main__":
    main()
