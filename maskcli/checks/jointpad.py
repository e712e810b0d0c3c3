"""A joint (image + text) attention whose image queries see the prompt tokens the model call states are padding.

Dual-stream diffusion transformers (Mochi's, HunyuanVideo's, Flux's MM-DiT blocks) project the image tokens and the
prompt's tokens apart and attend them as one sequence; the prompt, padded to a fixed length, comes with its padding
mask, which the attention must apply per sample. What the program states: the prompt's mask the model call was handed
(`encoder_attention_mask`), or one its frames hold by a text mask's name (`txt_attention_mask`, `prompt_attention_mask`:
trace/held.py), (B, T), 1 = a real token, each row's real tokens one run at an edge; the attending layer, or the block
around it, was handed (B, N) tokens (trace/queried.py) and its kernel attends N + T tokens over themselves: the T
prompt tokens joined to them, before or after. Where, whichever of the two places the prompt holds, an image query of
some row sees a key that row's mask calls padding, the mask never reached the joint attention (diffusers#10033:
Mochi's processor joined all 256 T5 tokens to the video's and ran SDPA with no mask; ParaAttention#26: the
first-block cache ran HunyuanVideo's blocks with attention_mask=None). A single-stream block handed the joint
sequence itself (N + T tokens, nothing joined inside) is read at the place a joint layer of the same model call keeps
the padding to (sd-scripts 2e89cd2c: Flux's single blocks never handed `txt_attention_mask`, which its double blocks
apply to the text before the image).

Quiet where one place of the prompt is kept to (the padding masked per row), on rows with no padding, where the keys
are not N + T (the text trimmed or cut: joint-text-cut; an image-only attention), on a batch the kernel does not keep
(one sample per call), on cross-attention, and on a single-stream block no joint layer of its model call places.
"""

from __future__ import annotations

import re

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding

NAME = "encoder_attention_mask"
TEXT = re.compile(r"^(?:encoder|txt|text|prompt|context|caption)_(?:attention_|attn_)?mask$")  # a prompt's mask, held


def _padding(real) -> np.ndarray | None:
    """Bool (B, T) real text tokens where `real` is a prompt's padding: 0 / 1, each row one run of real tokens at an
    edge with at least one, some row padded; None otherwise."""
    if not isinstance(real, np.ndarray) or real.ndim != 2 or real.shape[1] < 2 or not np.isin(real, (0, 1)).all():
        return None
    real = real.astype(bool)
    count = real.sum(axis=1)
    at = np.arange(real.shape[1])[None, :]
    edge = (real == (at < count[:, None])).all(axis=1) | (real == (at >= real.shape[1] - count[:, None])).all(axis=1)
    return real if count.min() >= 1 and count.min() < real.shape[1] and edge.all() else None


def _stated(top, call) -> tuple[str, np.ndarray] | None:
    """(the mask's name and where it is, bool (B, T) real text tokens): the model call's encoder_attention_mask, else a
    text mask the frames hold at the call."""
    real = _padding(top.arguments.get(NAME))
    if real is not None:
        return f"{NAME} given to {top.where}", real
    for held in call.details.get("held_padding") or ():
        if held.get("kind") in ("keep", "pad") and TEXT.match(held.get("name", "")):
            real = _padding(np.asarray(held["rows"]) if held["kind"] == "keep" else ~np.asarray(held["rows"]))
            if real is not None:
                return f"{held['name']} held by {held.get('where', 'the program')}", real
    return None


def _seen(cells: np.ndarray, real: np.ndarray, start: int) -> np.ndarray:
    """Bool (B, Lq, Lk): image queries that see a padded text key, the T text tokens at keys start .. start + T - 1."""
    rows, length = real.shape
    text = np.zeros(cells.shape[2], dtype=bool)
    text[start:start + length] = True
    padded = np.zeros((rows, cells.shape[2]), dtype=bool)
    padded[:, start:start + length] = ~real
    return cells & ~text[None, :, None] & padded[:, None, :]


def _joint(run: Run) -> dict:
    """id(model call) -> [(call, N the layer was handed, (name, real (B, T)), keep cells (B, L, L))] of its joint
    self-attention calls over N + T or N keys, B the stated mask's rows."""
    found: dict = {}
    for call in sorted((*run.calls, *run.unmasked), key=lambda c: c.index):  # (an unmasked softmax: no mask at all)
        top, given = run.top(call), call.details.get("query_input")
        batch, q_len, k_len = int(call.shape[0]), int(call.shape[2]), int(call.shape[3])
        handed = [int(m) for b, m in call.details.get("layer_inputs") or ([given] if given else ()) if int(b) == batch]
        if top is None or not handed or cross(call) or q_len != k_len:
            continue
        stated = _stated(top, call)
        if stated is None or stated[1].shape[0] != batch:
            continue
        n = next((m for m in handed if m + stated[1].shape[1] == k_len), handed[0])  # (the layer's, else its block's)
        if n not in (k_len, k_len - stated[1].shape[1]):
            continue
        cells = keep(call)
        if cells is None or cells.shape[0] not in (1, batch):
            continue
        cells = np.broadcast_to(cells.any(axis=1), (batch, q_len, k_len))
        found.setdefault(id(top), []).append((call, n, stated, cells))
    return found


def _placed(entries: list) -> dict:
    """Keys -> where the text starts, by the joint calls (N + T keys) that keep to one place of the prompt alone."""
    places: dict = {}
    for call, n, (_, real), cells in entries:
        if n + real.shape[1] != cells.shape[2]:
            continue
        kept = [start for start in (0, n) if not _seen(cells, real, start).any()]
        if len(kept) == 1:
            places.setdefault(cells.shape[2], (kept[0], call))
    return places


def joint_padding_seen(run: Run) -> list:
    """Per model call, its first joint attention whose image queries see the stated prompt padding wherever the prompt
    sits; and its first single-stream one that does at the place a joint layer keeps to."""
    found = []
    for entries in _joint(run).values():
        places, said = _placed(entries), set()
        for call, n, (name, real), cells in entries:
            length, k_len = real.shape[1], cells.shape[2]
            if n + length == k_len:
                starts, by = (0, n), None
            elif n == k_len and k_len in places:
                (start, by), starts = places[k_len], (places[k_len][0],)
            else:
                continue
            seen = [_seen(cells, real, start) for start in starts]
            kind = len(starts)
            if kind in said or not all(s.any() for s in seen):
                continue
            said.add(kind)
            cells_at = [first_cell(s) for s in seen]
            b, q, k = cells_at[-1]
            pads = [int(length - r) for r in real.sum(axis=1)]
            if by is None:
                where = (f"the prompt after the {n} tokens handed to the layer (or a module around it), image query "
                         f"{q} of batch row {b} sees padded prompt key {k}; before them, image query {cells_at[0][1]} "
                         f"of batch row {cells_at[0][0]} sees padded prompt key {cells_at[0][2]}")
            else:
                where = (f"the prompt at keys {starts[0]}-{starts[0] + length - 1}, where {by.where} of the same model "
                         f"call keeps its padding masked, image query {q} of batch row {b} sees padded prompt key {k}")
            found.append((call, Finding("joint-padding-seen", (
                f"the joint attention at {call.where} attends {k_len} tokens, {length} of them the prompt's, and "
                f"{name} ({len(pads)} x {length}) calls {pads} of them padding a row; {where} "
                f"({int(seen[-1].sum())} such cells)"),
                expected="each row's padded prompt keys hidden from the image queries", source=name, cell=(b, q, k))))
    return found


RULES = (
    Rule("joint-padding-seen", "wrong", "steps", "a joint (image + text) attention whose image queries see the "
         "prompt tokens the model call's text mask calls padding, wherever the prompt sits among the keys",
         joint_padding_seen),
)
