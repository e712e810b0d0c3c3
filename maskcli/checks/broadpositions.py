"""A model call handed one column of positions for several tokens a row: every token of the row at one position.

`position_ids` of shape (B, 1) beside `input_ids` of L > 1 tokens a row broadcast over the tokens: GPT-2's
`inputs_embeds + wpe(position_ids)` adds the one row to each token, a rotary table rotates each at the one angle, and
nothing raises. Each token needs its own position. optimum-intel#566: IPEXModelForCausalLM kept
`position_ids[:, -1].unsqueeze(-1)` once a cache existed, right for one decode token and wrong for assisted decoding's
verify step, whose draft tokens all took the last one's position. Said only where an attention call of the model call
runs as many queries as the call was handed tokens (the tokens were run together, not one at a time); quiet where the
positions hold a column per token, where each row holds one token, and where no attention call was made.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def broadcast_positions(run: Run) -> list:
    """Model calls handed `position_ids` of one column for input_ids of several tokens a row that they attend together."""
    found = []
    for top in run.tops:
        positions, ids = top.arguments.get("position_ids"), top.arguments.get("input_ids")
        if not isinstance(positions, np.ndarray) or not isinstance(ids, np.ndarray) or positions.ndim != 2 \
                or ids.ndim != 2 or positions.shape[1] != 1 or ids.shape[1] < 2 \
                or positions.shape[0] not in (1, ids.shape[0]):
            continue
        tokens = ids.shape[1]
        call = next((c for c in run.made_by(top) if c.shape[2] == tokens), None)
        if call is None:
            continue
        at = int(positions[0, 0])
        found.append((call, Finding("positions-broadcast", (
            f"{top.where} was handed input_ids of {tokens} tokens a row but position_ids of one column (batch row 0: "
            f"position {at}), and its attention runs the {tokens} tokens together: the column broadcasts, so every "
            f"token of a row takes that one position, where each needs its own (position_ids made as for a one-token "
            f"decode step?)"),
            expected=f"position_ids of {tokens} columns, one a token",
            source=f"position_ids of {top.where}", cell=(0, 0, 0))))
    return found


RULES = (
    Rule("positions-broadcast", "wrong", "steps", "a model call handed position_ids of one column for several tokens a "
         "row that its attention runs together: every token of a row at one position", broadcast_positions),
)
