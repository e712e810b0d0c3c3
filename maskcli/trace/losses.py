"""What the program's loss states of its attention: targets that are the model call's own input ids shifted by one.

A reader that records no call (it returns None): at each `F.cross_entropy` / `F.nll_loss` the program makes
while traced, its integer targets are compared with the input ids of the last few model calls (trace/tops.py:
`input_ids`, `idx`, `tokens`, `src`), along either axis (batch-first, or the sequence first as nn.Transformer's
tutorials lay it out), flattened or not, the last position left out or not (transformers shifts inside its
loss); where none of those names holds them, against a hand-written model's first argument of 2-D integer ids. Where
every target not ignored (-100 or the loss's `ignore_index`) is the next position's id, and not the position's own
(a copy task), the model call is a next-token predictor: query q must not see key q + 1, which
is its answer (checks/tokens.py). The model call's arguments get `next_token` = (the sequence axis, bool ids-shaped:
the positions whose next token is a target).
"""

from __future__ import annotations

import re
import sys

import numpy as np
import torch
import torch.nn.functional as F

IDS = ("input_ids", "idx", "tokens", "src", "inputs")  # (`inputs`: MLX-LM's models' token ids)
LOSS_MASK = re.compile(r"^(?:loss_mask|loss_masks|label_mask|loss_weights?|target_mask)$")  # 1 = the loss counts it
RECENT = 4  # model calls looked back at (a model and its reference model, each called before the loss)


def watched(trace) -> dict:
    """The readers of torch functions that record no attention call but what the program states (its loss)."""
    def loss(args, kwargs):
        target = args[1] if len(args) > 1 else kwargs.get("target")
        ignore = kwargs.get("ignore_index", -100)
        if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.numel() > 1 << 20:
            return None
        weight = _loss_mask(target) if kwargs.get("reduction") == "none" else None
        unweighed = kwargs.get("reduction") == "none" and weight is None  # (weighed after it returns, by what is
        # not named: which targets it counts is unsaid, `(nll * (mask & (targets != 0))).sum()`)
        # (the loss inside the model's own forward, which has made attention calls: not a loss module's own call).
        # The outermost module call held (outer.py) may have returned already: its first call runs without the hook
        # that finishes it, so it is still held after it ends. Inside it only while its frame is on this stack.
        held = trace._local.outer
        inner = held is not None and held[0] is not None and len(trace._calls) > held[4] and _running(held[0])
        if inner:  # its model call is no top yet: read when it is (outer.py's _finish calls inside())
            found = _counted(target.detach().cpu().numpy().astype(np.int64), weight, ignore)
            trace._local.losses = [*(getattr(trace._local, "losses", None) or ()), (found, ignore, unweighed)][-RECENT:]
            return None
        if not trace.tops:  # (reading them finishes the module calls held that have ended: capture.py)
            return None
        found = _counted(target.detach().cpu().numpy().astype(np.int64), weight, ignore)
        if not unweighed:
            _count(trace.tops[-1], found, ignore)
        for top in reversed(trace.tops[-RECENT:]):
            if _note_shifts(top.arguments, found, ignore):
                break
        return None

    loss.api, loss.records = "loss", False
    return {F.cross_entropy: loss, F.nll_loss: loss}


def inside(top, losses) -> None:
    """The targets of losses the model call computed in its own forward (a model given `labels`), read against its ids."""
    for found, ignore, unweighed in losses:
        if not unweighed:
            _count(top, found, ignore)
        _note_shifts(top.arguments, found, ignore)


def _note_shifts(arguments: dict, found: np.ndarray, ignore: int) -> bool:
    """The model call's `next_token` where the loss's targets are its ids one position on; else its `previous_token`
    where they are its ids one position back (a backward LM's: ELMo's and AllenNLP's bidirectional LM train both
    ways, each stream blind to its own target, so a query seeing the next token is then no contradiction alone).
    Whether either was read."""
    shifted = None if "next_token" in arguments else _of_ids(found, arguments, ignore)
    if shifted is not None:
        arguments["next_token"] = shifted
        return True
    ids = _ids(arguments)
    if "previous_token" not in arguments and ids is not None and ids.ndim == 2:
        back = _shifted(target=found, ids=ids, ignore=ignore, back=True)
        if back is not None:
            arguments["previous_token"] = back
            return True
    return False


def _ids(arguments: dict) -> np.ndarray | None:
    """The model call's token ids kept by name (IDS), else None."""
    return next((arguments[n] for n in IDS if isinstance(arguments.get(n), np.ndarray)), None)


def _count(top, target: np.ndarray, ignore: int) -> None:
    """The targets the model call's loss counts (not its ignore index), as they lie: the call's `loss_counted`, a tuple
    of bool arrays (checks/emptytrained.py lays each over a call's (B, Lq) queries)."""
    if target.ndim in (1, 2) and target.size > 1:
        counted = target != ignore
        if counted.any():
            top.loss_counted = (*top.loss_counted, counted)[-RECENT:]


def _of_ids(target: np.ndarray, arguments: dict, ignore: int) -> tuple[int, np.ndarray] | None:
    """_shifted against the model call's ids: those kept by name, else each field of a compound-word model's (B, L, F)
    ids (trace/fieldids.py: a field's head trained on the next position's field)."""
    ids = _ids(arguments)
    fields, first = arguments.get("field_ids"), arguments.get("first_ids")
    if ids is None and isinstance(first, tuple):  # (a hand-written `forward(self, x, targets)`: its first argument's ids)
        found = _shifted(target, first[1], ignore)
        if found is not None:
            arguments["next_token_by"] = first[0]
            return found
    if ids is not None:
        found = _shifted(target, ids, ignore) if ids.ndim == 2 else None
    elif isinstance(fields, tuple) and target.ndim == 2 and target.shape[0] == fields[1].shape[0]:
        for field in range(fields[1].shape[-1]):
            found = _shifted(target, fields[1][..., field], ignore)
            if found is not None and found[0] == 1:  # (batch-first, as the fields' own axes are)
                return found
        found = None
    else:
        found = None
    decoder = arguments.get("decoder_input_ids")  # (a seq2seq's: its labels are its decoder's inputs one position on)
    if found is None and isinstance(decoder, np.ndarray) and decoder.ndim == 2:
        found = _shifted(target, decoder, ignore)
        if found is not None:
            arguments["next_token_by"] = "decoder_input_ids"
    labels = arguments.get("loss_labels")
    if found is None and isinstance(labels, tuple):  # (the labels it was handed, which need not be its ids)
        found = _labels_shifted(target, labels[1], ignore)
        if found is not None:
            arguments["next_token_by"] = labels[0]
    return found


def _labels_shifted(target: np.ndarray, labels: np.ndarray, ignore: int) -> tuple[int, np.ndarray] | None:
    """(1, bool (B, L): the positions whose next label the loss counts) where the loss's targets are the model call's
    `labels` (B, L) or (B, L, F) one position on, batch-first as models take them (their last position left out, or
    filled with the ignore index: transformers' ForCausalLMLoss pads the shifted labels), and not the labels unshifted."""
    length = labels.shape[1]
    nxt, head = labels[:, 1:], labels[:, :-1]
    if target.size == labels.size:
        pred = target.reshape(labels.shape)[:, :-1]
    elif target.size == nxt.size:
        pred = target.reshape(nxt.shape)
    else:
        return None
    valid = pred != ignore
    if valid.sum() < 2 or not (pred[valid] == nxt[valid]).all() or (pred[valid] == head[valid]).all():
        return None
    predicts = np.zeros(labels.shape[:2], bool)
    predicts[:, :length - 1] = valid.reshape(*valid.shape[:2], -1).any(axis=-1)
    return 1, predicts


def _loss_mask(target: torch.Tensor) -> np.ndarray | None:
    """A per-token loss (`reduction="none"`) is weighted by the program after it returns: the 0/1 loss mask its own
    frames hold by name (Megatron's `loss_mask`), as many cells as the targets, else None."""
    from maskcli.trace.held import program_frames

    for frame in program_frames(sys._getframe(2), 8):
        for name, value in frame.f_locals.items():
            if LOSS_MASK.search(name) and isinstance(value, torch.Tensor) and value.numel() == target.numel():
                weight = value.detach().cpu().numpy().reshape(-1)
                if np.isin(weight, (0, 1)).all():
                    return weight != 0
    return None


def _counted(found: np.ndarray, weight: np.ndarray | None, ignore: int) -> np.ndarray:
    """The targets, those the loss mask weighs 0 set to the ignore index (not counted)."""
    return found if weight is None else np.where(weight.reshape(found.shape), found, ignore)


def _running(frame) -> bool:
    """Whether `frame` (a module call's) is on the calling thread's stack: that call has not returned."""
    here = sys._getframe(2)
    while here is not None:
        if here is frame:
            return True
        here = here.f_back
    return False


def _shifted(target: np.ndarray, ids: np.ndarray, ignore: int, back: bool = False) -> tuple[int, np.ndarray] | None:
    """(the sequence axis, bool ids-shaped: the positions whose next token the loss counts as their target) where the
    targets are the ids one position on (`back`: one position back, the positions whose previous token it counts)."""
    for axis in (1, 0):
        length = ids.shape[axis]
        if length < 2:
            continue
        head, nxt = np.take(ids, np.arange(length - 1), axis=axis), np.take(ids, np.arange(1, length), axis=axis)
        if back:  # (position i + 1's target is token i)
            head, nxt = nxt, head
        at = np.arange(1, length) if back else np.arange(length - 1)
        if target.size == ids.size:
            pred = np.take(target.reshape(ids.shape), at, axis=axis)
        elif target.size == head.size:
            pred = target.reshape(head.shape)
        else:
            continue
        valid = pred != ignore
        if valid.sum() >= 2 and (pred[valid] == nxt[valid]).all() and not (pred[valid] == head[valid]).all():
            predicts = np.zeros(ids.shape, bool)
            index = [slice(None), slice(None)]
            index[axis] = slice(1, length) if back else slice(0, length - 1)
            predicts[tuple(index)] = valid
            return axis, predicts
    return None
