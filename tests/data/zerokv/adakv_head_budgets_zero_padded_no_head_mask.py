"""Per-head KV budgets (AdaKV / SnapKV style) in a batch of two: each head keeps its own number of prompt keys, the
shorter heads padded with zeros at the end to the longest head's, and the decode step attends with a padding mask of
the batch's rows only (B, 1, 1, L), so every head sees the zero slots of the heads that kept fewer.

Written another way than VeloxQuant's NestedKV (tests/data/bugs): a batch of two, each row's heads keeping their own counts; a
bool mask handed to SDPA rather than none. Fix: a per-head mask (B, H, 1, L) that hides each head's padded slots.
"""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
B, H, D, PROMPT = 2, 4, 8, 12
BUDGETS = [[6, 4, 6, 3], [5, 6, 2, 6]]  # per batch row, per head: prompt keys kept


def compress(k, v):
    """Keep each head's highest-norm keys (in order), padded with zeros at the front to the longest head's."""
    longest = max(max(row) for row in BUDGETS)
    ks, vs = torch.zeros(B, H, longest, D), torch.zeros(B, H, longest, D)
    for b in range(B):
        for h in range(H):
            n = BUDGETS[b][h]
            idx = k[b, h].norm(dim=-1).topk(n).indices.sort().values
            ks[b, h, longest - n:], vs[b, h, longest - n:] = k[b, h, idx], v[b, h, idx]
    return ks, vs


def main():
    q_proj, k_proj, v_proj = (torch.nn.Linear(H * D, H * D) for _ in range(3))
    x = torch.randn(B, PROMPT, H * D)
    heads = lambda t: t.view(B, -1, H, D).transpose(1, 2)  # noqa: E731
    with torch.no_grad():
        q, k, v = heads(q_proj(x)), heads(k_proj(x)), heads(v_proj(x))
        F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the prompt pass
        ks, vs = compress(k, v)
        step = torch.randn(B, 1, H * D)
        q, k, v = heads(q_proj(step)), heads(k_proj(step)), heads(v_proj(step))
        ks, vs = torch.cat([ks, k], 2), torch.cat([vs, v], 2)
        slots = ks.shape[2]
        if FIXED:
            kept = torch.tensor(BUDGETS)[:, :, None]  # (B, H, 1)
            at = torch.arange(slots)[None, None, :]
            mask = (at >= slots - 1 - kept)[:, :, None, :]  # (B, H, 1, L): each head's own kept keys and the new
        else:
            mask = torch.ones(B, 1, 1, slots, dtype=torch.bool)  # the batch's rows: every slot real
        out = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask)
        ref = torch.zeros_like(out)
        for b in range(B):
            for h in range(H):
                n = BUDGETS[b][h]
                keys, vals = ks[b, h, slots - 1 - n:], vs[b, h, slots - 1 - n:]
                ref[b, h] = torch.softmax(q[b, h] @ keys.T / D ** 0.5, -1) @ vals
    print(f"decode vs each head's kept keys, max |diff| = {(out - ref).abs().max():.4f}")


if __name__ == "__main__":
    main()
