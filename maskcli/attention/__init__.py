"""Attention through a mask: inputs, staged computation, findings, and verification against kernels.

Nothing is imported here, so the names below stay cheap for help text; the modules import torch.
"""

FILLS = ("-inf", "min", "-1e9", "multiply")
STAGES = ("scores", "scaled", "unmasked", "masked", "weights", "output")  # unmasked: softmax(scaled), no mask
LIKES = ("tutorial", "sdpa", "hf-eager", "mha", "mha-weights")
