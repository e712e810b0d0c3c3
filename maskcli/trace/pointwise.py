"""Attention weighted by a pointwise activation of its scores, not a softmax: silu(q @ kᵀ) (HSTU), relu, sigmoid.

HSTU (generative recommenders) and ReLU or sigmoid attention weigh the values by an activation of each score alone:
nothing normalises a row. A masked cell is one filled low before the activation (-inf, the dtype's lowest or a
finite fill of at most -1e4: silu, relu and sigmoid make each weight 0 or about 0 there), as a softmax's. Only
tensors scores.py saw made from q @ kᵀ are read (an activation of anything else is a feed-forward's), in their plain
axis order, 3-D or 4-D: the call is recorded as the softmax reader reads those scores (masks.py), its details saying
which activation weighs them (`by_hand`), so what follows the weights (after.py) follows these. Scores with no fill
are no call: an activation masked by a 0/1 product after it and a scaling (generative-recommenders'
`silu(qk) / max_seq_len * valid`) would read as full, which it is not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from maskcli.trace.masks import softmax, softmax_input

ACTIVATIONS = {F.silu: "silu", F.relu: "relu", torch.relu: "relu", torch.Tensor.relu: "relu", torch.sigmoid: "sigmoid",
               torch.Tensor.sigmoid: "sigmoid", F.sigmoid: "sigmoid"}


def activation_reader(scores, weights, name: str):
    """The reader of activation `name`: its input read as attention scores where scores.py made them from q @ kᵀ (not
    a softmax's weights, nor what is made of them alone: weights.py), else no call."""
    def read(args, kwargs):  # (seen only while the mode follows scores: these are not patched at their entry)
        x = softmax_input(args, kwargs)
        if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4) or not scores.has(x) \
                or scores.axes_of(x) is not None or weights is not None and weights.has(x):
            return None
        seen = softmax((x, -1), {})
        if seen is None or not seen.details.get("fill"):
            return None  # (no fill before it: its mask, if any, is a product after it, `silu(qk) / n * valid`)
        seen.details["by_hand"] = name
        return seen
    read.api, read.of_scores = "softmax", True  # (follow.py asks scores.has before any frame is read)
    return read
