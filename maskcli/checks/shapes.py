"""Shapes: a mask tensor whose dimensions a kernel reads otherwise than its author meant (inspect, given --heads)."""

from __future__ import annotations

from maskcli.checks.registry import Rule
from maskcli.text import Finding


def heads(shape: tuple, count: int | None) -> list[Finding]:
    """A 3-D mask of one plane per head (MHA wants batch x heads there), a 3-D first dimension no API takes, or a 4-D
    mask whose heads do not broadcast to the model's `count`."""
    if count is None:
        return []
    if len(shape) == 3 and shape[0] == count and count > 1:
        return [Finding(
            "3d-heads",
            f"the 3-D mask's first dimension is {count}, the head count: SDPA applies it per head, but "
            f"nn.MultiheadAttention expects batch x heads there and gives each head the wrong mask once batch > 1 "
            f"(repeat it: mask.repeat(B, 1, 1) for a batch of B)",
        )]
    if len(shape) == 3 and shape[0] not in (1, count):
        return [Finding(
            "3d-shape",
            f"the 3-D mask's first dimension is {shape[0]}: SDPA needs 1 or the head count {count} there; "
            f"nn.MultiheadAttention needs batch x heads = {count} x B",
        )]
    if len(shape) == 4 and shape[1] not in (1, count):
        return [Finding(
            "heads-mismatch",
            f"the mask has {shape[1]} heads (dimension 1) but the model has {count}: it broadcasts only when they are equal or it is 1",
        )]
    return []


def tensor_shape(analysis, count: int | None = None) -> list[Finding]:
    """A tensor a user gave (inspect's Analysis, taken as it comes), against the model's heads (`count`, --heads)."""
    return heads(analysis.tensor.shape, count)


RULES = (
    Rule("3d-heads", "wrong", "call", "a 3-D mask of one plane per head, which nn.MultiheadAttention reads per batch "
         "row and head", tensor_shape, "tensor"),
    Rule("3d-shape", "wrong", "call", "a 3-D mask whose first dimension neither SDPA nor MHA accepts", tensor_shape, "tensor"),
    Rule("heads-mismatch", "wrong", "call", "a 4-D mask whose heads do not broadcast to the model's", tensor_shape, "tensor"),
)
