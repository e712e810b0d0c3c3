"""Later keys the program states: an attention context of (left, right) frames with a look-ahead of `right` keys.

A streaming encoder (NeMo's Conformer, `att_context_size=[4, 1]`: 4 frames back, 1 ahead) lets each query see a few
keys after it on purpose, for a small latency. Where the program states such a pair (trace/windows.py `look_ahead`:
an attribute of a running module, or a variable of its frames or its top level, named as an attention context) and
no query of the call sees a key more than `right` after it, the later keys are the program's word: sees-later (a
causal mask's slip?) is not said of them. Queries that see further ahead than stated are left to sees-later.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import cross, keep


def within(call) -> bool:
    """The call's program states a look-ahead of `right` keys, and no query sees a key more than `right` after it
    (queries placed at the end of the keys); False where it states none, or the mask is not kept."""
    said = call.details.get("look_ahead")
    if not said or cross(call):
        return False
    cells = keep(call)
    if cells is None:
        return False
    q_len, k_len = cells.shape[-2:]
    own = k_len - q_len + np.arange(q_len)
    ahead = np.arange(k_len)[None, :] - own[:, None]  # (Lq, Lk): how far after the query each key is
    return not (cells & (ahead > said[1])).any()
