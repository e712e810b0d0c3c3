"""Padded tokens a causal convolution mixes into the real tokens after them, where the model call states them padding.

A hybrid model (Jamba, LFM2, Bamba, Zamba, Qwen3-Next: Mamba or short-convolution layers beside attention layers) runs
a causal depthwise Conv1d of kernel K over each layer's token states: token t reads the states of tokens
t - (K - 1) x dilation .. t. In a left-padded batch (or a continued forward whose new segment is padded in the middle
of the sequence) the first real tokens of a row read the padded tokens before them, so the states there must be zero
(Hugging Face's `apply_mask_to_padding_states`, Mamba's `hidden_states * attention_mask`): zeros are what the
convolution pads with itself, so the row's real tokens then read what they read alone. Where the padded states carry
content, the real tokens read whatever the padding held (its embedding, the layers' output at padded positions), and
the row's result depends on how it was padded and on its batch (transformers#32914: Jamba's mixer never given the
mask; transformers#41790: LFM2's ShortConv given the 4-D causal mask, whose `shape[1] > 1` gate skipped it;
transformers#47087: the recurrent layers' mask dropped whenever the cache held a previous state).

The padding is the model call's own statement (its `attention_mask`, checks/real.py's stated), over the keys of its
self-attention, the last Lq of them the call's own tokens; the call's attention must mask those keys from every real
query of the row too (the program applies its mask that way). A convolution of the same model call over the same
rows is read where it runs over the call's own tokens causally (trace/convpad.py: its input's own padding K - 1 on
the left, output trimmed, over Lq frames; or no padding over Lq + (K - 1) x dilation frames, the cached states or
zeros put before them; or zeros over more frames than that before them in every row, the output's last Lq frames
the tokens', MaxText's port padding by hand before a convolution that pads itself): a real token whose taps read a
padded token whose frame is not all zero is wrong. Quiet where
the padded frames are zero, on right padding (no real token comes after it), where no padding is stated, on
convolutions that read later frames (checks/convpad.py) or of other lengths.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.real import stated
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _frames(conv: dict, q_len: int) -> int | None:
    """How many frames of `conv` come before the call's Lq tokens where it runs over them causally; else None."""
    span = (conv["kernel"] - 1) * conv["dilation"]
    if conv["reach"] == 0 and conv["padding"] == span and conv["frames"] == q_len:
        return 0  # (its own zero padding on the left, the output trimmed to the tokens)
    if conv["padding"] == 0 and conv["reach"] == span and conv["frames"] == q_len + span:
        return span  # (the cached states, or zeros, put before the tokens by the program)
    before = conv["frames"] - q_len
    if conv["padding"] == 0 and conv["reach"] == span and before > span and conv.get("zeros") \
            and all(runs and runs[0][0] == 0 and runs[0][1] >= before for runs in conv["zeros"]):
        return before  # (zeros put before the tokens more than once, MaxText's port padding by hand before a convolution
        # that pads itself: the output's last Lq frames are the tokens', each reading the span before it)
    return None


def _content(zeros, frames: int, before: int) -> np.ndarray | None:
    """Bool (Lq,) tokens whose frame is not all zero, from one row's zero runs; None where the row's runs were not kept."""
    if zeros is None:
        return None
    nonzero = np.ones(frames, bool)
    for start, end in zeros:
        nonzero[start:end] = False
    return nonzero[before:]


def _hit(conv: dict, before: int, real: np.ndarray, masked: np.ndarray) -> tuple[int, int, int] | None:
    """(batch row, real token, padded token it reads) for the first real token of `conv`'s rows whose taps read a padded
    token with content; `real` bool (B, Lq) the call's tokens, `masked` those the attention masks as padding."""
    q_len = real.shape[1]
    for b, zeros in enumerate(conv["zeros"]):
        content = _content(zeros, conv["frames"], before)
        if content is None:
            continue
        leaks = ~real[b] & masked[b] & content  # (Lq,): a padded token whose state carries something
        for tap in range(1, conv["kernel"]):
            back = tap * conv["dilation"]
            if back >= q_len:
                break
            reads = real[b, back:] & leaks[:-back]  # token t reads token t - back
            if reads.any():
                t = int(np.argmax(reads)) + back
                return b, t, t - back
    return None


def padding_convolved_left(run: Run) -> list:
    """Self-attention calls whose model call states padding that a causal convolution of the same call reads, with
    content, into a later real token."""
    found = []
    for top in run.tops:
        if not any(conv.get("zeros") for conv in top.convs):
            continue
        done = set()
        for call in run.made_by(top):
            b, _, q_len, k_len = call.shape
            if (q_len, k_len) in done or q_len < 2 or k_len < q_len or cross(call):
                continue
            done.add((q_len, k_len))
            said = stated(top, b, k_len)
            cells = keep(call)
            if said is None or not said[2] or cells is None or cells.shape[0] not in (1, b):
                continue
            real = np.broadcast_to(said[0], (b, k_len))
            if real.all():
                continue
            own = real[:, k_len - q_len:]  # (B, Lq): the call's own tokens
            sees = np.broadcast_to(cells.any(axis=1), (b, q_len, k_len))  # (B, Lq, Lk) in some head
            seen = (sees & own[:, :, None]).any(axis=1)  # (B, Lk): a key some real query of the row sees
            masked = ~seen[:, k_len - q_len:]
            for conv in top.convs:
                before = _frames(conv, q_len) if conv.get("zeros") is not None else None
                if before is None or len(conv["zeros"]) != b:
                    continue
                hit = _hit(conv, before, own, masked)
                if hit is not None:
                    found.append((call, _finding(hit, conv, said[1], k_len - q_len)))
                    break
    return found


def _finding(hit: tuple, conv: dict, source: str, offset: int) -> Finding:
    b, t, p = hit
    return Finding("padding-convolved-causal", (
        f"batch row {b}: real token {offset + t} is convolved with padded token {offset + p} (a causal Conv1d of kernel "
        f"{conv['kernel']}, dilation {conv['dilation']}, over the call's tokens), which {source} states padding and the "
        f"model's own attention masks, and the padded token's state is not zero: the padding reaches the real tokens "
        f"through the convolution — the padding mask not applied to the states before the convolution (a Mamba or "
        f"short-conv mixer not given it, or given a mask it skips)?"),
        expected=f"the padded tokens' states zeroed before the convolution (row {b}: token {offset + p})",
        source=source, cell=(b, t, offset + p))


RULES = (
    Rule("padding-convolved-causal", "wrong", "steps", "a causal convolution (a Mamba or short-conv mixer of a hybrid "
         "model) reads padded tokens whose states carry content into the real tokens after them, where the model call's "
         "attention_mask states them padding and its attention masks them (transformers#32914, #41790, #47087: the "
         "mixer never given the padding mask, given one it skips, or given none on a continued forward)",
         padding_convolved_left),
)
