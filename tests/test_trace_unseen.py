"""maskcli.trace.unseen: maskcli reads the program's tensors out of sight of a subclass's __torch_function__ and of
torch.jit's tracer (torch.jit.trace, the TorchScript ONNX exporter records every op run while it traces)."""

from __future__ import annotations

import torch
import torch.nn as nn

import maskcli


class Attention(nn.Module):
    """An eager causal self-attention whose mask is sliced from a buffer by the input's length (a view of ints)."""

    def __init__(self, width: int = 8, heads: int = 2, most: int = 16):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.register_buffer("bias", torch.tril(torch.ones(most, most)).view(1, 1, most, most))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
        scores = scores.masked_fill(self.bias[:, :, :n, :n] == 0, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)


def _kinds(graph) -> list[str]:
    return [node.kind() for node in graph.nodes()]


def test_a_model_traced_by_torch_jit_inside_maskcli_trace_records_the_graph_python_records():
    """torch.jit.trace of the model inside maskcli.trace(): the export runs as under python (it raised an internal
    assert in torch's alias analysis where maskcli's reads were recorded into the graph), its graph has the same ops as
    the one traced without maskcli, its results equal the model's, and the attention call it ran is recorded."""
    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 5, 8)
    alone = torch.jit.trace(model, x, check_trace=False)
    with maskcli.trace() as t:
        traced = torch.jit.trace(model, x, check_trace=False)
    assert _kinds(traced.graph) == _kinds(alone.graph)
    y = torch.randn(2, 5, 8)
    assert torch.allclose(traced(x), model(x)) and torch.allclose(traced(y), alone(y))
    assert len(t.calls) == 1 and t.calls[0].shape == (2, 2, 5, 5)
    cells = t.calls[0].keep()[0, 0]
    assert cells.tolist() == [[k <= q for k in range(5)] for q in range(5)]
