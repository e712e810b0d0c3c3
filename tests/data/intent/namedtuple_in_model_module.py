"""A model whose config is a NamedTuple at the top of the module that defines it (namedtuple_model_lib.py), not of
this main program, and held by no module; its layers attend in one loop of its forward (their number is their turn).
The window one key too wide; --fixed (read by the model's module) builds it right."""

import torch

from namedtuple_model_lib import Model

with torch.no_grad():
    Model()(torch.randn(1, 1, 7, 4))
