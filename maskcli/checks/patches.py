"""Padded patches called real: a vision tower handed images whose last patches are exactly 0 (the batch's padding)
with a patch mask that calls them real.

A NaViT-style tower (Idefics2's, SigLIP's, MiniCPM-V's) takes images of different sizes padded to one shape and a
`patch_attention_mask` (True = a real patch). The padding is the data's own: `pad_sequence(..., padding_value=0.0)`
leaves the shorter image's last patches exactly 0 in every channel, which a normalised image never is (0 after
normalisation is a raw value of exactly the mean, 0.5 or 0.485, that no 8-bit pixel has). Where the patch mask calls
such patches real and the tower's real patches attend them, the mask was filled along the wrong axis or never filled
(MiniCPM-V#274: `patch_attn_mask[i, :n] = True` on a (B, 1, P) mask slices its size-1 axis, so it is all True).

Read only where the zero patches are, in each row, one run at its end, some row has none and none is all zero (a
padded batch, not a dark image); stays quiet where the mask hides them (the fix) and where no real patch sees them.

A tower handed a patch mask states that its tokens are an image's patches: a grid, with no order a causal mask could
follow, attended both ways (SigLIP, Idefics2, NaViT). A self-attention of that model call over exactly its patches
that lets no real patch see any later real patch ran causal (microsoft/onnxruntime#25360: the CLIP attention fusion set
`causal=(add_mask is not None)`, so SigLIP's tower with a patch padding mask was fused causal): wrong. Quiet where some
real patch sees a later one (a window, a both-ways mask), on rows of one real patch, and on calls over another count
of tokens (a text side, pooled queries).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans

PATCH_MASKS = ("patch_attention_mask", "patch_attn_mask")  # as trace/tops.py records them: (B, patches), True = real


def _padded(zero: np.ndarray) -> bool:
    """Each row's zero patches one run at its end, some row with none, some with some, no row all zero."""
    count = zero.sum(axis=1)
    at = np.arange(zero.shape[1])[None, :]
    return bool(zero.shape[0] > 1 and count.min() == 0 and 0 < count.max() and count.max() < zero.shape[1]
                and ((at >= zero.shape[1] - count[:, None]) == zero).all())


def padded_patches_attended(run: Run) -> list:
    """Attention calls of a vision tower whose real patches see patches the images hold as exactly-0 padding, where the
    patch mask the tower was given calls them real."""
    found = []
    for top in run.tops:
        zeros = top.arguments.get("zeros")
        name = next((n for n in PATCH_MASKS if isinstance(top.arguments.get(n), np.ndarray)), None)
        if zeros is None or name is None:
            continue
        source, zero = zeros
        given = top.arguments[name].astype(bool)
        if zero.shape != given.shape or not _padded(zero) or not (zero & given).any():
            continue
        rows, count = zero.shape
        for call in sorted([*run.calls, *run.unmasked], key=lambda c: c.index):
            if run.top(call) is not top or call.shape[0] != rows or call.shape[2] != count or call.shape[3] != count:
                continue
            cells = keep(call)
            if cells is None or cells.shape[0] not in (1, rows):
                continue
            cells = np.broadcast_to(cells.any(axis=1), (rows, count, count))
            bad = cells & (~zero)[:, :, None] & (zero & given)[:, None, :]
            if not bad.any():
                continue
            b, q, k = (int(i) for i in np.argwhere(bad)[0])
            padding = np.flatnonzero(zero[b]).tolist()
            found.append((call, Finding("padded-patches-attended", (
                f"batch row {b}: patches {spans(padding)} of the `{source}` handed to {top.where} are exactly 0 in every "
                f"channel (the batch's padding: the row's last {len(padding)} of {count} patches, where another row has none), "
                f"yet its {name} calls them real and real patch {q} attends patch {k}: the patch mask filled along "
                f"the wrong axis, or not at all?"), expected=f"{name} False on the zero-padded patches",
                source=f"the zero padding of {source}", cell=(b, q, k))))
            break
    return found


def patches_run_causal(run: Run) -> list:
    """Self-attention calls of a model call handed a patch mask, over exactly its patches, where no real patch sees a
    later real patch."""
    found, done = [], set()
    for call in run.calls:  # (self-attention: cross-attention calls are apart, engine.py)
        top = run.top(call)
        name = None if top is None else next((n for n in PATCH_MASKS if isinstance(top.arguments.get(n), np.ndarray)), None)
        if name is None or call.shape[2] != call.shape[3] or (call.mask, call.shape, id(top)) in done:
            continue
        done.add((call.mask, call.shape, id(top)))
        real = top.arguments[name] != 0
        rows, count = real.shape
        cells = keep(call)
        if call.shape[0] != rows or call.shape[2] != count or cells is None or cells.shape[0] not in (1, rows):
            continue
        seen = np.broadcast_to(cells.any(axis=1), (rows, count, count))
        later = real[:, :, None] & real[:, None, :] & (np.arange(count)[None, None, :] > np.arange(count)[None, :, None])
        if not later.any() or (seen & later).any():
            continue
        b, q, k = (int(i) for i in np.argwhere(later)[0])
        found.append((call, Finding("patches-run-causal", (
            f"{call.where} runs causal over the image's patches: batch row {b}'s real patch {q} does not see the later "
            f"real patch {k} ({int(later.sum())} such cells), though the model call was handed a {name} (a vision "
            f"tower's patches: a grid attended both ways, with no order to be causal in); a causal flag set on an "
            f"encoder's attention?"), expected="every real patch sees every real patch",
            source=f"the {name} handed to {top.where}", cell=(b, q, k))))
    return found


RULES = (
    Rule("padded-patches-attended", "wrong", "steps", "a vision tower's real patches attend patches its images hold "
         "as exactly-0 padding (the row's last ones) that the patch mask it was given calls real (MiniCPM-V#274)",
         padded_patches_attended),
    Rule("patches-run-causal", "wrong", "steps", "a vision tower handed a patch mask whose self-attention over its "
         "patches runs causal: no real patch sees a later one (onnxruntime#25360: SigLIP fused causal)",
         patches_run_causal),
)
