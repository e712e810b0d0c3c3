"""What attend's rules (checks/stages.py) read off a run: the cells looked at once per dimension the mask only
broadcasts over, and the value a -1e9 fill wrote in the compute dtype."""

from __future__ import annotations

from maskcli.attention.stages import Stages, compact, fill_value
from maskcli.checks import registry
from maskcli.text import Finding


def mask_findings(keep, mask) -> list[Finding]:
    """Rows of the mask alone (bool (B, H, Lq, Lk) on a device) that see nothing, queries that see later keys: every
    rule given the `mask`."""
    return registry.run("mask", compact(keep, (0, 1)), mask)


def run_findings(stages: Stages, mask) -> list[Finding]:
    """What a run made of the mask: rows that see no key, weight rows off 1, scores not finite, a fill that overflows."""
    fill = fill_value("-1e9", stages.scaled.dtype) if stages.fill == "-1e9" else None
    return registry.run("stages", stages, mask, compact(stages.keep, (0, 1)), fill)
