"""A joint (image + text) attention whose text keys are fewer than a row's real text tokens: the row's text was cut.

Dual-stream diffusion transformers (HunyuanVideo's, Flux's and SD3's MM-DiT blocks) project the image tokens and
the prompt's tokens apart and attend them as one sequence [image, text], with the prompt's padding masked per sample
(`encoder_attention_mask`). What the program states: the model call's `encoder_attention_mask` (B, Le) (trace/tops.py)
gives each row's real text tokens; the attending layer was handed (B, N) image tokens (its forward's first input,
trace/queried.py) and its kernel attends N + T tokens over themselves, T of them the text's. A row whose real text
tokens outnumber the T text keys lost some of its prompt: the text was cut for the whole batch by one row's length
(xDiT#546: `encoder_attention_mask[0]` selects the text tokens of every sample, so the CFG batch's longer prompt is
cut off). Wrong there. Quiet where every row's real tokens fit in the T text keys (the padded text kept and masked per
row, or trimmed to the longest row), where the kernel attends no more tokens than the layer was handed (no joint
sequence) or as many as the layer's first input is the text's own width (the text stream is the layer's input), on a
batch the kernel does not keep (one sample per call), and on cross-attention.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross
from maskcli.checks.registry import Rule
from maskcli.text import Finding

NAME = "encoder_attention_mask"


def _real(mask) -> np.ndarray | None:
    """Each row's real tokens in a (B, Le) keep mask of 0 / 1 (transformers' polarity); None where it is none."""
    if not isinstance(mask, np.ndarray) or mask.ndim != 2 or mask.shape[1] < 2:
        return None
    values = np.unique(mask)
    if not set(values.tolist()) <= {0, 1, False, True}:
        return None
    real = mask.astype(bool).sum(axis=1)
    return real if real.min() >= 1 else None


def joint_text_cut(run: Run) -> list:
    """Per model call, its first joint self-attention call holding fewer text keys than a row's real text tokens."""
    found, seen = [], set()
    for call in sorted((*run.calls, *run.unmasked), key=lambda c: c.index):  # (an unmasked softmax: no mask at all)
        top = run.top(call)
        given = call.details.get("query_input")
        if top is None or id(top) in seen or not given or cross(call):
            continue
        real = _real(top.arguments.get(NAME))
        batch, n = int(given[0]), int(given[1])
        q_len, k_len = int(call.shape[2]), int(call.shape[3])
        if real is None or len(real) != batch or int(call.shape[0]) != batch or q_len != k_len or k_len <= n:
            continue
        text, width = k_len - n, top.arguments[NAME].shape[1]
        if n == width or text >= width or int(real.max()) <= text:
            continue
        b = int(np.argmax(real))
        seen.add(id(top))
        found.append((call, Finding("joint-text-cut", (
            f"the joint attention at {call.where} was handed {n} tokens a row and attends {k_len}: {text} text keys "
            f"beside them, yet the model call's {NAME} ({batch} x {width}) states {int(real[b])} real text tokens in row "
            f"{b} ({[int(x) for x in real]} a row): {int(real[b]) - text} of row {b}'s prompt tokens never reach the "
            f"attention (the text cut for the whole batch by one row's length)"),
            expected=f"each row's {NAME} tokens among the keys, its padding masked",
            source=f"the model call's {NAME}", cell=(b, 0, k_len - 1))))
    return found


RULES = (
    Rule("joint-text-cut", "wrong", "call", "a joint (image + text) attention holding fewer text keys than a row's "
         "real text tokens (encoder_attention_mask): the batch's text cut by one row's length", joint_text_cut),
)
