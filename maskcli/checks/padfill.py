"""Padding flags that hold the call's own fill: the mask was built in place on the flags every layer reads.

trace/padfill.py records, at an attention call, a forward parameter named as padding flags (`paddings`,
`input_padding`: float, 1.0 = padded, as lingvo and TimesFM read them, `outputs * (1 - paddings)`) whose every non-zero
value is one fill at most -1e4. Where that value is the fill this call's scores are masked with, the mask was made
from the flags by a view and an in-place product, and the flags themselves now hold the fill (google-research/timesfm
1b95563: `attention_mask = paddings[:, None, None, :]; attention_mask *= -0.7 * finfo.max`): the mask is right, but
every reader of the paddings after it gets the fill in place of 1 (the MLP's `1 - paddings` is 2.4e38 on each padded
position: activations overflow, and NaN reaches the real positions through attention). Said once per name and
function. Quiet where the flags are 0/1 (a copy was multiplied: the fix's `paddings.detach().clone()`), and where their
value is not the call's fill (an additive mask of its own under such a name).
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _same(a, b) -> bool:
    return isinstance(a, float) and isinstance(b, float) and (a == b or abs(a - b) <= 1e-6 * abs(b))


def flags_hold_fill(run: Run) -> list:
    """The first call per (name, function) whose padding flags hold the very fill its scores are masked with."""
    found, done = [], set()
    for call in run.calls:
        held = call.details.get("padding_fill")
        if not isinstance(held, dict) or (held.get("name"), held.get("function")) in done:
            continue
        fill = call.details.get("fill_value")
        if call.details.get("fill") == "-inf" and fill is None:
            fill = float("-inf")
        if not _same(held.get("value"), fill if isinstance(fill, float) else None):
            continue
        done.add((held["name"], held["function"]))
        name, value = held["name"], held["value"]
        said = (f"{call.where}: the padding flags `{name}` handed to {held['function']}() hold {value:g} on "
                f"{held['cells']} of {held['of']} positions, the very fill this call's scores are masked with, where "
                f"1.0 (padded) was: the mask was built in place on the flags (a view of them multiplied by the fill), "
                f"so every reader of `{name}` after it (`1 - {name}`) gets {-value:g} (copy the flags before the "
                f"product: `.clone()`)")
        found.append((call, Finding("padding-holds-fill", said, expected="1.0 where padded",
                                    source=f"{held['function']}({name})", cell=(0, 0, 0))))
    return found


RULES = (
    Rule("padding-holds-fill", "wrong", "steps", "padding flags (paddings, 1.0 = padded) that hold the attention's own "
         "fill: the mask was built in place on the flags every later layer reads", flags_hold_fill),
)
