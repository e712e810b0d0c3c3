"""A softmax over an axis of one element: every weight is exactly 1, whatever the score (checks/singleton.py).

DIEN's AUGRU cell (torch-rechub#229) scored one behavior per step, `softmax(hWi.unsqueeze(1), dim=1)` over (B, 1),
inside a loop over the steps: the attention over the behaviors was T softmaxes of one score each, each weight 1,
padded steps included. Such a softmax is recorded as a call (one query against one key, nothing masked) with
details `singleton`, wherever its input came from, so that the checks can count how often one line ran it in one
model call. A softmax over q @ kᵀ scores is read as every such one is (a single token's own key is routine); a
single element (no batch) is not read. A line of the program that also runs its softmax over more elements (a loop
over each point's neighbours, some points with one) takes its one element from the data, not from its shape: its
calls are marked `wider` (Singles), whichever came first.
"""

from __future__ import annotations

import sys

import torch

import maskcli.trace.masks as readers
from maskcli.trace.held import program_frames


def singleton(args: tuple, kwargs: dict) -> bool:
    """Whether a softmax call (its arguments) is over a last axis of one element, of a float 2-D or 3-D input
    of more elements."""
    x = readers.softmax_input(args, kwargs)
    if type(x) is not torch.Tensor or x.dim() not in (2, 3) or not x.is_floating_point():
        return False
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return dim in (-1, x.dim() - 1) and x.shape[-1] == 1 and x.numel() > 1


def wider(args: tuple, kwargs: dict) -> bool:
    """Whether a softmax call is over a last axis of more than one element, of a float 2-D or 3-D input."""
    x = readers.softmax_input(args, kwargs)
    if type(x) is not torch.Tensor or x.dim() not in (2, 3) or x.shape[-1] < 2:
        return False
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return dim in (-1, x.dim() - 1)


def read(args: tuple, kwargs: dict):
    """The softmax reader's Seen of a softmax over one element (a 3-D input read as (B, Lq, 1)), marked `singleton`."""
    seen = readers.softmax(args, kwargs)
    if seen is not None:
        seen.details["singleton"] = True
    return seen


read.api = "softmax"


class Singles:
    """The program's lines that run a softmax over one element, and whether each ran one over more elements too."""

    def __init__(self):
        self._lines: dict = {}  # (code, line) -> [ran wider, the singleton calls it made]

    def _line(self):
        frame = next(program_frames(sys._getframe(2), 1), None)
        return None if frame is None else (frame.f_code, frame.f_lineno)

    def single(self, call) -> None:
        """Singleton `call`, just recorded: marked `wider` where its line ran a softmax over more elements."""
        line = self._line()
        if line is not None:
            held = self._lines.setdefault(line, [False, []])
            held[1].append(call)
            if held[0]:
                call.details["wider"] = True

    def wider(self) -> None:
        """A softmax over more elements, not recorded, at its line: that line's singleton calls marked `wider`."""
        line = self._line()
        if line is None:
            return
        held = self._lines.setdefault(line, [False, []])
        if not held[0]:
            held[0] = True
            for call in held[1]:
                call.details["wider"] = True
