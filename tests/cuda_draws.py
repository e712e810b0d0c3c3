"""Random draws that give the same numbers whatever torch's default device: each is drawn on the CPU and moved.

tests/test_cuda_trace.py runs each reproduction twice, with CUDA and with the CPU as torch's default device, and asks
for the same trace. torch.manual_seed seeds both generators, but CUDA's (Philox) draws other numbers than the CPU's
(mt19937), and a program's masks may follow its draws: random lengths, ids at a pad id, top-k of random scores. So
the reproduction's harness calls drawn_on_the_cpu() before it runs the program: torch's random factories, their
`_like` forms, the draws over a tensor (bernoulli, multinomial, normal) and the in-place fills that nn.init uses
(`normal_`, `uniform_`, ...) draw on the CPU with its generator and move the result where it was asked for; and
F.dropout keeps the cells a CPU draw keeps. On the CPU every one of them gives what torch gives unpatched.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FACTORIES = ("rand", "randn", "randint", "randperm")
LIKES = ("rand_like", "randn_like", "randint_like")
OVER = ("bernoulli", "multinomial", "normal", "poisson")
FILLS = ("normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_")


def _cpu(value):
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _factory(draw):
    @functools.wraps(draw)
    def drawn(*args, **kwargs):
        if "out" in kwargs or isinstance(kwargs.get("generator"), torch.Generator) and kwargs["generator"].device.type != "cpu":
            return draw(*args, **kwargs)
        device = kwargs.pop("device", None)
        return draw(*args, **kwargs, device="cpu").to(torch.get_default_device() if device is None else device)
    return drawn


def _over(draw):
    """A draw over tensors (`torch.bernoulli(p)`, `torch.randn_like(x)`, `x.multinomial(n)`): drawn over their CPU
    copies, the result moved to the first one's device."""
    factory = _factory(draw)

    @functools.wraps(draw)
    def drawn(*args, **kwargs):
        given = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if given is None:  # (torch.normal(0.0, 1.0, size): a factory)
            return factory(*args, **kwargs)
        if given.device.type == "cpu" or "out" in kwargs:
            return draw(*args, **kwargs)
        device = kwargs.pop("device", None)
        if draw.__name__.endswith("_like"):
            kwargs["device"] = "cpu"
        out = draw(*(_cpu(a) for a in args), **{k: _cpu(v) for k, v in kwargs.items()})
        return out.to(given.device if device is None else device)
    return drawn


def _fill(fill):
    @functools.wraps(fill)
    def filled(self, *args, **kwargs):
        if self.device.type == "cpu" or self.requires_grad and torch.is_grad_enabled():
            return fill(self, *args, **kwargs)
        drawn = torch.empty(self.shape, dtype=self.dtype, device="cpu")
        fill(drawn, *(_cpu(a) for a in args), **{k: _cpu(v) for k, v in kwargs.items()})
        with torch.no_grad():
            self.copy_(drawn)
        return self
    return filled


def _dropout(dropout):
    @functools.wraps(dropout)
    def dropped(input, p=0.5, training=True, inplace=False):
        if not training or p == 0 or input.device.type == "cpu":
            return dropout(input, p, training, inplace)
        keep = torch.empty(input.shape, device="cpu").bernoulli_(1 - p).to(input.device, input.dtype)
        out = input * keep / (1 - p) if p < 1 else input * 0
        return input.copy_(out) if inplace else out
    return dropped


def drawn_on_the_cpu() -> None:
    for name in FACTORIES:
        setattr(torch, name, _factory(getattr(torch, name)))
    for name in (*LIKES, *OVER):
        setattr(torch, name, _over(getattr(torch, name)))
    for name in ("bernoulli", "multinomial"):
        setattr(torch.Tensor, name, _over(getattr(torch.Tensor, name)))
    for name in FILLS:
        setattr(torch.Tensor, name, _fill(getattr(torch.Tensor, name)))
    F.dropout = _dropout(F.dropout)
