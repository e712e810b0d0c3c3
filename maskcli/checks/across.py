"""A cross-attention masked as a causal self-attention: decoder query i sees only encoder keys 0..i.

A call the program itself says is a cross-attention (a running module's `attention_type="cross"`,
`is_cross_attention=True`: trace/held.py's cross_said) attends from the decoder's tokens to the encoder's memory: key j
is encoder token j, not a later position of the query's own sequence, so a triangle that hides key j from every query
before j hides real memory for no reason (TransformerEngine#565: the inter-attention called with the self-attention's
`attn_mask_type="causal"`, its `enc_dec_attn_mask` dropped). Said where the mask is exactly the triangle's shape: as
many queries as keys, no query sees a key after its own index, and every query sees its own (a padding mask on top of
a triangle is still the triangle's bug). A cross-attention told apart by its module path alone (context.CROSS_WORDS)
is not read here: the module's own word is.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def causal_cross(run: Run) -> list:
    """Calls a module states are cross-attention whose mask is a causal triangle over the memory."""
    found, done = [], {}
    for call in run.cross:
        said = call.details.get("cross_said")
        q_len, k_len = call.shape[2:]
        if not said or q_len != k_len or q_len < 2:
            continue
        key = (call.mask, call.shape)
        if key not in done:
            done[key] = None
            cells = keep(call)
            if cells is None:
                continue
            later = np.triu(np.ones((q_len, k_len), dtype=bool), 1)
            diagonal = np.eye(q_len, dtype=bool)
            if cells[..., later].any() or not cells[..., diagonal].all():
                continue
            hidden = int((~cells[..., later]).sum())
            done[key] = Finding("cross-attention-causal", (
                f"the program says this call is a cross-attention ({said}), yet its mask is a causal triangle over "
                f"the memory: query {0} sees only key 0, query i only keys 0..i ({hidden} cells of later memory "
                f"hidden): the self-attention's causal mask type handed to the cross-attention?"),
                expected="no causal triangle over the encoder's memory", source=said, cell=(0, 0, 1))
        if done[key] is not None:
            found.append((call, done[key]))
    return found


RULES = (
    Rule("cross-attention-causal", "wrong", "call", "a call a module states is a cross-attention (attention_type="
         "'cross', is_cross_attention=True) whose mask is a causal triangle over the encoder's memory", causal_cross),
)
