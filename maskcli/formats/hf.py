"""Hugging Face transformers: a 4-D (B, 1, Lq, Lk) float mask, 0 = attend, finfo(dtype).min = masked, and
position_ids that restart in each packed document.

Documented rule (transformers "custom 4D attention mask"; masking_utils): a 4-D
attention_mask is used as given, in the eager convention: added to the scores, 0 where a
query may attend and torch.finfo(dtype).min where not, in the model's dtype (float32's min
overflows to -inf in bfloat16 and float16: clamp before casting). Packed sequences need
position_ids that restart at 0 in each document, and left-padded rows position_ids that count only their real
tokens (as generate() makes them), or a model with absolute positions (GPT-2) places their tokens elsewhere.
"""

from __future__ import annotations

import numpy as np

from maskcli.formats.base import CannotHold, Export, dense_cells
from maskcli.terms import terms

NAME = "hf"


def positions(mask) -> np.ndarray | None:
    """(B, n) rotary positions of every position 0..n-1 where they are not 0..n-1: within each document (from the
    expression's document or segment labels), or, with left padding, as generate() counts them (transformers 5.24,
    generation/utils.py:919: cumsum of the 2-D mask - 1, 0 at pads); None otherwise."""
    from maskcli.kinds.labels import run_starts

    tree = mask.expression
    f = mask.frame
    found = [term for term in terms(tree) if term.kind.documents] if tree is not None else []
    if found:
        labels = next(value for _, value in found[0].params if hasattr(value, "array")).array
        p = np.arange(f.n)
        return np.ascontiguousarray(np.broadcast_to((p[None, :] - run_starts(labels)[:, p]).astype(np.int64), (mask.batch, f.n)))
    left = f.padded and bool(np.any(f.left_padding() > 0))
    if left:
        valid = np.broadcast_to(f.key_valid, (mask.batch, f.key_valid.shape[1]))[:, :f.n]
        every = np.where(valid, np.cumsum(valid, axis=1) - 1, 0).astype(np.int64)
    trees = [term for term in terms(tree) if term.kind.name == "tree"] if tree is not None else []
    if trees:
        # A draft token's position is the cached tokens' count plus its depth, as tree decoding passes it (siblings
        # share one): so each node's output is its own path's, decoded one token at a time.
        parents = trees[0].params[0][1].array[0]
        depth = np.zeros(len(parents), dtype=np.int64)
        for i, parent in enumerate(parents.tolist()):  # bounded by the tree kind's MAX_DRAFT
            depth[i] = depth[parent] + 1 if parent >= 0 else 0
        every = np.array(every, copy=True) if left else np.broadcast_to(np.arange(f.n, dtype=np.int64), (mask.batch, f.n)).copy()
        before = every[:, f.q_start - 1:f.q_start] + 1 if f.q_start > 0 else np.zeros((mask.batch, 1), dtype=np.int64)
        every[:, f.q_start:f.q_start + len(parents)] = before + depth[None, :]
        return every
    return every if left else None


def to(mask) -> Export:
    f = mask.frame
    if f.k_start != 0 or f.k_end != f.q_end:
        raise CannotHold(f"a Hugging Face model's keys are the tokens before its queries and the queries themselves (0-{f.q_end - 1}), "
                         f"and this mask's are {f.describe().split(' · ')[1]}: drop --kv-start and --kv-len, or use --for sdpa")
    keep = dense_cells(mask, 4, "Hugging Face")
    keep = keep[:, :1] if not mask.heads_differ else keep
    keep = np.broadcast_to(keep, (mask.batch,) + keep.shape[1:])
    tensors = {"attention_mask": np.where(keep, np.float32(0), np.finfo(np.float32).min).astype(np.float32)}
    args = "attention_mask=<attention_mask>.clamp(min=torch.finfo(model.dtype).min).to(model.dtype)"
    every = positions(mask)
    if every is not None:
        tensors["position_ids"] = np.ascontiguousarray(every[:, f.q_start:f.q_end])
        args += ", position_ids=<position_ids>"
    notes = ["4-D mask: 0 = attend, finfo(dtype).min = masked, added to the scores (eager); cast it to the model's dtype",
             "float32's min is -inf in bfloat16 and float16: clamp to the model dtype's min before casting, as the call does"]
    if every is not None:
        kinds = [term.kind for term in terms(mask.expression)] if mask.expression is not None else []
        notes.append("position_ids restart at 0 in each document: without them packed documents get the positions of one long sequence"
                     if any(kind.documents for kind in kinds) else
                     "position_ids place each draft token at the cached tokens' count plus its depth in the tree (siblings share "
                     "one): without them each node's output is not its own path's" if any(kind.name == "tree" for kind in kinds) else
                     "position_ids count real tokens only, as generate() makes them from the padding: without them left-padded rows start late")
    if f.q_start == 0:
        return Export(["import torch", f"out = model(input_ids, {args})  # input_ids: (B, {f.q_len})"], tensors, notes, device="input_ids.device")
    # Behind a cache the 4-D mask covers the cached keys and the new ones: transformers 5.24 takes a 4-D mask as it is
    # (masking_utils._preprocess_mask_arguments), so the model must hold exactly the cached keys it counts.
    fill = ""
    if f.padded:
        tensors["past_attention_mask"] = np.ascontiguousarray(np.broadcast_to(f.key_valid[:, :f.q_start], (mask.batch, f.q_start))).astype(np.int64)
        fill = ", attention_mask=<past_attention_mask>"
    if every is not None:
        tensors["past_position_ids"] = np.ascontiguousarray(every[:, :f.q_start])
        fill += ", position_ids=<past_position_ids>"
    code = ["import torch", "from transformers import DynamicCache",
            "cache = DynamicCache()  # every layer keeps all its keys, as the mask counts them",
            f"model(past_ids{fill}, cache=cache)  # past_ids: (B, {f.q_start}), the tokens already in the cache: it now holds their keys",
            f"out = model(input_ids, {args}, cache=cache)  # input_ids: (B, {f.q_len})"]
    notes += [f"the mask's last dimension is the {f.q_start} cached keys and the {f.q_len} new ones: the model needs that cache "
              "(a 4-D mask is used as given, with no cache it fails on sizes)",
              "DynamicCache() without a config: DynamicCache(config=...) gives a sliding-window model's layers a window that "
              "holds fewer keys than the mask has",
              "cache= is transformers 5.24's keyword; past_key_values= is its deprecated name (removed in 5.40), the one older releases take"]
    return Export(code, tensors, notes, device="input_ids.device")
