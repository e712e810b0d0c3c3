"""EAGLE-2 style verification of a draft tree: tree_mask over the draft tokens, cache fully visible.

Follows SafeAILab/EAGLE eagle/model/cnets.py (topK_genrate: draft tokens kept with parents_list, then
`tree_mask = torch.eye(total_tokens + 1).bool(); tree_mask[:, 0] = True; for i: tree_mask[i + 1].add_(
tree_mask[mask_index_list[i]])`, tree_position_ids = depth) and eagle/model/modeling_llama_kv.py
(_prepare_decoder_attention_mask writes `combined_attention_mask[:, :, -tree_len:, -tree_len:][tree_mask == 0]
= min`). Here the base model is a one-layer causal attention written in torch.

Mask meant: the committed prefix (KV cache) is visible to every tree node; among the draft tokens a node
sees exactly its ancestors and itself (node 0 is the last accepted token, the root). Positions are
prefix_len + depth, so siblings share a position.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)

D, H = 16, 2
W = torch.randn(3, D, D) / D ** 0.5


def rope(x, pos):
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (torch.arange(half) / half))
    ang = pos[:, None].float() * freq
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)


def attend(hidden, position_ids, past_kv, tree_mask=None):
    q, k, v = (hidden @ W[i] for i in range(3))
    q = rope(q.view(-1, H, D // H).transpose(0, 1), position_ids)
    k = rope(k.view(-1, H, D // H).transpose(0, 1), position_ids)
    v = v.view(-1, H, D // H).transpose(0, 1)
    if past_kv is not None:
        k, v = torch.cat([past_kv[0], k], 1), torch.cat([past_kv[1], v], 1)
    tgt, src = q.shape[1], k.shape[1]
    min_val = torch.finfo(q.dtype).min
    # causal mask over the whole row, bottom-right aligned with the cache
    combined = torch.full((tgt, src), min_val).triu(src - tgt + 1)
    if tree_mask is not None:
        combined[-tgt:, -tgt:] = combined[-tgt:, -tgt:].masked_fill(tree_mask == 0, min_val)
        combined[-tgt:, -tgt:] = combined[-tgt:, -tgt:].masked_fill(tree_mask == 1, 0.0)
    scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5 + combined
    out = scores.softmax(-1) @ v
    return out.transpose(0, 1).reshape(tgt, D), (k, v)


def build_tree(parents):
    """parents[i] is the index of node i+1's parent among 0..i (0 = root)."""
    total = len(parents)
    tree_mask = torch.eye(total + 1).bool()
    tree_mask[:, 0] = True
    for i, p in enumerate(parents):
        tree_mask[i + 1].add_(tree_mask[p])
    depth = tree_mask.sum(1) - 1
    return tree_mask.int(), depth


def main():
    prefix = torch.randn(6, D)
    _, past = attend(prefix, torch.arange(6), None)
    # root + 7 draft tokens: two top-k branches, then children
    parents = [0, 0, 1, 1, 2, 3, 5]
    tree_mask, depth = build_tree(parents)
    draft = torch.randn(len(parents) + 1, D)
    tree_out, _ = attend(draft, 6 + depth, past, tree_mask=tree_mask)

    # every root-to-leaf path, run as a plain causal continuation, gives the same outputs
    for leaf in range(len(parents) + 1):
        path = tree_mask[leaf].nonzero().flatten()
        seq_out, _ = attend(draft[path], 6 + torch.arange(len(path)), past)
        assert torch.allclose(seq_out, tree_out[path], atol=1e-5), leaf
    print("tree nodes", len(parents) + 1, "depths", depth.tolist())


if __name__ == "__main__":
    main()
