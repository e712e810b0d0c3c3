"""A heavy-hitter KV cache's budget as each module states it (read for checks/evictbudget.py).

H2O (FMInference/H2O's LlamaAttention_heavy_hitter, KVCache-Factory's H2OKVCluster) keeps at each decode step the
`heavy_budget` keys of the largest accumulated attention and the `recent_budget` latest ones (`hh_size` and
`recent_size` in the ports): the module's own attributes, set from its ratios at the prefill. Read once the run is
over (trace/outer.py's settle, where the first forward has set them), as a Stated per module that states both, for
the calls at or under it; a module that states only one, or a budget that is not a non-negative int, states none.
"""

from __future__ import annotations

FLAG = "evict_budget"  # (heavy keys kept, recent keys kept): a FLAG of checks/intent.py
PAIRS = (("heavy_budget", "recent_budget"), ("hh_size", "recent_size"))


def evict_budgets(root, path) -> tuple:
    """A Stated {FLAG: (heavy, recent)} per module of `root` whose own attributes state a heavy-hitter budget."""
    from maskcli.checks.intent import Stated

    found = []
    for module in root.modules():
        own, scope = vars(module), path(module)
        if scope is None:
            continue
        for heavy, recent in PAIRS:
            values = own.get(heavy), own.get(recent)
            if all(type(v) is int and v >= 0 for v in values) and sum(values) > 0:
                source = f"self.{heavy}={values[0]}, self.{recent}={values[1]} of {scope or type(module).__name__}"
                found.append(Stated(source, scope, {FLAG: values}))
                break
    return tuple(found)
