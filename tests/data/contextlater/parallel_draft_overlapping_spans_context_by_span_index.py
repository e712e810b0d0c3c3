# The SpecForge 41e252e bug (a parallel drafter trained on sampled, overlapping anchor blocks whose context is made
# visible by block index rather than by position) written another way: a multi-token drafter over spans of 3 tokens,
# plain functions and SDPA with a boolean mask, batch row 1 holding one span fewer (its last span padded, positions -1).
# The context is the target's hidden states gathered at each span's tokens, laid [context | span queries] and rotated
# by `positions`. Buggy: a span sees the context of every earlier span (`ctx_span < q_span`), so overlapping spans leak
# hidden states at or past its own anchor; fixed: only context tokens before the span's anchor (`ctx_pos < q_anchor`).
import sys
import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D, SPAN, SEQ = 16, 3, 14
wq, wk, wv = (torch.randn(D, D) / D ** 0.5 for _ in range(3))
ANCHORS = [[1, 2, 4, 9], [2, 3, 8, -1]]                 # sorted per row; -1: a padded span (row 1 has 3)


def rope(x, positions):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    f = positions.clamp_min(0)[..., None].float() * inv
    e = torch.cat([f, f], -1)
    return x * e.cos() + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * e.sin()


def draft_attention(queries, context, positions, keep):
    # queries (B, Q, D), context (B, C, D): keys [context | queries], each rotated by its own position
    n_ctx = context.shape[1]
    kv = torch.cat([context, queries], dim=1)
    q = rope(queries @ wq, positions[:, n_ctx:])
    k = rope(kv @ wk, positions)
    out = F.scaled_dot_product_attention(q[:, None], k[:, None], (kv @ wv)[:, None], attn_mask=keep[:, None])
    return out[:, 0].nan_to_num(0.0)


def span_mask(anchors):
    anchors = torch.tensor(anchors)                                            # (B, S)
    span_pos = anchors[:, :, None] + torch.arange(SPAN)                        # (B, S, SPAN)
    real = (anchors >= 0)[:, :, None].expand_as(span_pos).flatten(1)           # (B, S * SPAN)
    pos = torch.where(real, span_pos.flatten(1), torch.full_like(real, -1, dtype=torch.long))
    span_id = torch.arange(anchors.shape[1]).repeat_interleave(SPAN)[None].expand_as(pos)
    q_anchor = anchors.repeat_interleave(SPAN, dim=1)
    both = real[:, :, None] & real[:, None, :]
    if FIXED:
        ctx = both & (pos[:, None, :] < q_anchor[:, :, None])
    else:
        ctx = both & (span_id[:, None, :] < span_id[:, :, None])
    own = both & (span_id[:, None, :] == span_id[:, :, None])                 # a span drafted bidirectionally
    return pos, torch.cat([ctx, own], dim=-1)


def run(target_hidden):
    pos, keep = span_mask(ANCHORS)
    context = torch.gather(target_hidden, 1, pos.clamp_min(0)[..., None].expand(-1, -1, D))
    queries = torch.randn(2, pos.shape[1], D, generator=torch.Generator().manual_seed(1))
    positions = torch.cat([pos, pos], dim=1)
    return draft_attention(queries, context, positions, keep), pos


target_hidden = torch.randn(2, SEQ, D)
out, pos = run(target_hidden)
# a span may only read the target's hidden states before its anchor: change those at/after it, the span must not move
worst = 0.0
for b in range(2):
    for s, a in enumerate(ANCHORS[b]):
        if a < 0:
            continue
        changed = target_hidden.clone()
        changed[b, a:] = torch.randn(SEQ - a, D)
        out2, _ = run(changed)
        worst = max(worst, (out2[b, s * SPAN:(s + 1) * SPAN] - out[b, s * SPAN:(s + 1) * SPAN]).abs().max().item())
print(f"max change of a span when the target hidden states at/after its anchor change = {worst:.6f}")
