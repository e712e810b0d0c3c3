"""A trace group as the rules given one read it: its calls (the same mask, API and shape), its mask as stored, what the
recogniser named it, and what only the trace can work out, asked of the trace only where a rule needs it.

The trace report (trace/report.py) makes one per group and asks the registry for the rules given it, in the order it
learns about the group: its `cells` (the stored mask's rows: rows.py), what it was `named` (named.py), what the call's
`scores` were filled or added with (fills.py), and what the `kernel` made of its arguments (kernels.py). A new rule of a
trace group is a check taking a Grouped, declared with one of those in its module's RULES: the report is not touched.
It sits in checks/ so that the rules import nothing of trace/: what only trace works out (the mask read the other
way round, another name for the same cells) comes as functions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable


@dataclass
class Grouped:
    calls: list  # of trace's Call, in order: the first is the one whose details the rules read
    stored: dict  # the mask as stored (tracefile): dense, intervals, or counts only ("stats")
    structure: object | None = None  # inspect's Structure, where the recogniser read the cells (None: not small enough)
    name: str = ""  # what the report calls the mask
    same: Callable[[], str | None] | None = None  # another expression for the same cells (trace/names.also_documents)
    flipped: Callable[[], tuple[str | None, str | None]] | None = None  # (kind, name) of the mask read the other way round
    run: object | None = None  # checks.context.Run: the model calls that made the calls (their stated padding, positions)

    @property
    def first(self):
        return self.calls[0]

    @property
    def q_len(self) -> int:
        return self.first.shape[2]

    @property
    def k_len(self) -> int:
        return self.first.shape[3]

    @functools.cached_property
    def past(self) -> bool:
        """Whether the model calls state the queries past every key (rows.past_the_keys), worked out once a group."""
        from maskcli.checks.rows import past_the_keys

        return past_the_keys(self.run, self.calls)

    @functools.cached_property
    def places(self):
        """Int (Lq,) key positions the model calls state for the queries (rows.stated_places), or None."""
        from maskcli.checks.rows import stated_places

        return stated_places(self.run, self.calls)

    def real(self):
        """Bool (B, Lk): the keys the model calls state are real tokens (rows.stated_tokens), or None."""
        from maskcli.checks.rows import stated_tokens

        return stated_tokens(self.run, self.calls)
