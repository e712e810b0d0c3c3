"""Rope positions between two tokens: integer positions shifted off the grid by a fraction.

trace/offgrid.py records, at an attention call, a float tensor a program frame holds under a positions name whose
every value is off the integer grid by one and the same fraction, beside an integer tensor of the same shape named as
positions in the same frame (what the program states its positions are), and which is no scaling of it. The queries
or keys rotated at those positions sit between two tokens' places: the shift that moved them was computed with a true
division where the positions' own arithmetic is integer (SelfExtend's `q // g1 + g2 - g2 / g1`: datamllab/LongLM
715c1e3, whose fix is `g2 // g1`; the grouped positions then step by whole tokens as the keys' `k // g1` do). Said
once per name and function. Quiet where the positions are integers (the fix), where every position is one scaling of
the integer ones (position interpolation's `position_ids / factor`), and on a lone position (one decode step).
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def positions_off_grid(run: Run) -> list:
    """The first call per (name, function) whose frames hold rope positions off the integer grid."""
    found, done = [], set()
    for call in run.calls:
        held = call.details.get("offgrid_positions")
        if not isinstance(held, dict) or (held.get("name"), held.get("function")) in done:
            continue
        done.add((held["name"], held["function"]))
        name, integer, fraction = held["name"], held["integer"], held["fraction"]
        values = ", ".join(f"{x:g}" for x in held["values"])
        said = (f"{call.where}: {held['function']}() holds the positions `{name}` ({values}, ..., {held['cells']} of "
                f"them) every one {fraction:g} off the integer grid, beside its integer positions `{integer}`: a token's "
                f"position is a whole number, and a query or key rotated at one of these sits between two tokens' "
                f"places (a shift computed with true division `/` where the positions' arithmetic is integer: `//`)")
        found.append((call, Finding("positions-off-grid", said, expected=f"integer positions, as {integer}",
                                    source=f"{held['function']}({name})", cell=(0, 0, 0))))
    return found


RULES = (
    Rule("positions-off-grid", "wrong", "steps", "rope positions that a frame computes from its integer positions and "
         "that all sit off the integer grid by one fraction (a shift computed with `/` for `//`)", positions_off_grid),
)
