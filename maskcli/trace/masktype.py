"""A module's mask type as its word that its scores are causal (trace/sites.py causal_flag; checks/own.py).

Megatron's and Transformer Engine's attention modules keep `attn_mask_type` ("causal", "padding_causal",
"causal_bottom_right", or an `AttnMaskType` member), their fused softmax a `softmax_type`
(`SoftmaxType.SCALED_UPPER_TRIANG_MASKED`: the kernel that applies the triangle itself). A fallback that ignores it
runs unmasked while the module says causal (TransformerEngine#1524).
"""

from __future__ import annotations

import enum
import re


MASK_TYPES = ("attn_mask_type", "mask_type", "softmax_type")  # Megatron's / Transformer Engine's / apex's words
CAUSAL_TYPE = re.compile(r"causal|upper_triang", re.IGNORECASE)  # 'causal', 'padding_causal', 'causal_bottom_right',
# AttnMaskType.causal, SoftmaxType.SCALED_UPPER_TRIANG_MASKED (the fused kernel that applies the triangle itself)
NOT_CAUSAL = re.compile(r"non_?causal|not_?causal|acausal", re.IGNORECASE)  # (a program's own words for the opposite)


def mask_type(module) -> str | None:
    """'Class.attn_mask_type=causal' where the module's own mask-type attribute (a str or an Enum member) names a
    causal mask: its word that its scores are causal, as a flag is (only True is read: 'padding', 'no_mask' and
    'arbitrary' say nothing of causality, nor does a word that negates it, 'non_causal'). An Enum is read by its member's name and value."""
    for name in MASK_TYPES:
        value = vars(module).get(name, getattr(type(module), name, None))
        if isinstance(value, str):
            text = value
        elif isinstance(value, enum.Enum):
            text = f"{value.name} {value.value}"
        else:
            continue
        if CAUSAL_TYPE.search(text) and not NOT_CAUSAL.search(text):
            return f"{type(module).__name__}.{name}={value if isinstance(value, str) else value.name}"
    return None
