"""pytorch/pytorch#41508 (and #103749, #24816): scores masked with masked_fill(mask == 0, float("-inf")) before a
softmax give NaN in every query row that sees no key (a padding query of a padded batch under a causal-and-padding
mask), and the NaN reaches the loss through the output. The fix fills with torch.finfo(dtype).min (as Hugging Face's
eager attention does), which leaves those rows uniform and finite."""

import math
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
batch, length, dim = 2, 5, 8
lengths = torch.tensor([5, 3])
q = k = v = torch.randn(batch, 1, length, dim)
positions = torch.arange(length)
real = positions[None, :] < lengths[:, None]  # right padding
mask = (positions[None, :, None] >= positions[None, None, :]) & real[:, None, :] & real[:, :, None]  # (B, L, L)
scores = q @ k.transpose(-2, -1) / math.sqrt(dim)
fill = torch.finfo(scores.dtype).min if FIXED else float("-inf")
scores = scores.masked_fill(mask[:, None] == 0, fill)
weights = torch.softmax(scores, dim=-1)
out = weights @ v
