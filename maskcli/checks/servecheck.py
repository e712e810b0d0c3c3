"""`check`: every rule of one serving batch's metadata, run through the registry. It sits apart from the rules
(serve.py, servemasks.py) so that the registry, called from here, enters each rule's module without climbing back
into one the flow is still inside.

A batch is maskcli.serve.batch.ServeBatch, taken as it comes: checks/ imports nothing of serve/.
"""

from __future__ import annotations

from dataclasses import replace

from maskcli.checks import registry
from maskcli.text import Finding


def check(b) -> list[Finding]:
    """Every rule given one batch's metadata, run through the registry, each finding's cell kept only where it is one
    of its request's."""
    return [_inside(b, f) for f in registry.run("metadata", b)]


def _inside(b, f: Finding) -> Finding:
    """The finding, without its cell where that cell is no cell of its request (a position before 0, or past its last
    key as the kernel or the cache counts them): a finding names only cells a mask of that request has."""
    if f.cell is None or f.request is None or not 0 <= f.request < b.requests:
        return f
    r = f.request
    keys = max(int(b.seq_lens[r]), int(b.computed[r] + b.q_lens[r]) if b.computed is not None else 0)
    if all(0 <= int(x) < keys for x in f.cell):
        return f
    return replace(f, cell=None)
