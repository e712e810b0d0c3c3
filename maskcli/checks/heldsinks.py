"""A learned per-head sink logit the attending module holds, which the kernel's softmax had no term for
(trace/heldsinks.py records it at each SDPA or MHA call).

Attention with sinks (openai/gpt-oss; vLLM's MiMo vision encoder) gives each head's softmax one more learned logit
beside its keys: `softmax([q·k_0, ..., q·k_n, s_h])`, or `s_h` added to a sequence's first key in MiMo's reference. A
module that holds that logit (`self.sinks`, one value per head, not None, not all 0, no `use_sink`-like flag of its own
set False) states the term; SDPA and nn.MultiheadAttention can only get it through their float attn_mask (a per-head
value on some key, or an extra key column), and return no log-sum-exp that the output could be rescaled by
afterwards. Where the call's mask is none, bool, a float mask of only 0 and its fill, or one the same for every head
while the sinks differ between heads, every query row of the call attends as if the module held no sinks: wrong, the
program's own module contradicts its kernel call (vllm-project/vllm#49815: MiMo's windowed vision blocks load
`attn.sinks` and call flash_attn_varlen_func(window_size=[w, w]) without them; the fix adds `sinks[h]` to each
sequence's key 0). Quiet where the mask varies per head (the sink may be in it: ALiBi too), where a softmax had a sink
column joined (GPT-OSS's eager path), and at softmax, flash and flex calls (the logit may be in the scores, a
kernel's own argument, or a rescale by the log-sum-exp they return).
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def sinks_dropped(run: Run) -> list:
    """Each call (once per module class, sink name and mask) whose module holds learned sinks its mask has no term for."""
    found, done = [], set()
    for call in [*run.calls, *run.cross, *run.unmasked]:
        held = call.details.get("sinks_dropped")
        if not held:
            continue
        once = (call.mask, call.shape, held["module"], held["name"], held["mask"])
        if once in done:
            continue
        done.add(once)
        values = ", ".join(f"{v:g}" for v in held["values"]) + (", ..." if held["heads"] > len(held["values"]) else "")
        q, k = held["query"], held["key"]
        found.append((call, Finding("sinks-dropped", (
            f"the {held['module']} module that made these calls holds a learned sink logit per head "
            f"(`{held['name']}`, {held['heads']} heads: {values}), but its {call.api} call was handed "
            f"{held['mask']}, so no head's softmax has a term for it: batch row 0, query {q} attends over its keys "
            f"from key {k} with no sink beside them, as every row of the call does (the module's own sinks are dropped: "
            f"join them as a column of the scores, add sinks[h] to the logit of each sequence's first key, or use a "
            f"kernel that takes them)"),
            expected=f"each head h's softmax includes {held['name']}[h]",
            source=f"the {held['module']} module's `{held['name']}`", cell=(0, q, k))))
    return found


RULES = (
    Rule("sinks-dropped", "wrong", "call", "a module that holds learned per-head attention sinks calls SDPA or MHA "
         "with a mask that has no term for them: every head attends as if it had none", sinks_dropped),
)
