"""trace/patch.py: a plain Python function's code swapped for a shim while tracing, and put back after."""

from __future__ import annotations

import inspect
import json
import textwrap

import torch.nn.functional as F
from typer.testing import CliRunner

from maskcli.commands import app
from maskcli.trace.patch import swap, swapped


def test_a_swapped_function_keeps_its_own_source_and_signature_and_undo_puts_everything_back():
    def softmax_like(x, dim: int = -1):
        return x.softmax(dim)

    source, signature = inspect.getsource(softmax_like), inspect.signature(softmax_like)
    undo = swap(softmax_like, lambda original: original)
    assert swapped(softmax_like)
    assert inspect.getsource(softmax_like) == source
    assert [(p.name, p.default) for p in inspect.signature(softmax_like).parameters.values()] == \
        [(p.name, p.default) for p in signature.parameters.values()]
    undo()
    assert not swapped(softmax_like) and "__wrapped__" not in softmax_like.__dict__
    assert inspect.getsource(softmax_like) == source


def test_a_scripted_function_calling_functional_softmax_and_dropout_compiles_under_trace(tmp_path):
    # EGT's @torch.jit.script _egt calls F.softmax and F.dropout, which trace swaps: TorchScript compiles a callee from
    # its source, which was the shim's (quiet-r166b, written blind: the program exited 1 under trace alone). The
    # scripted result is checked against the same softmax and dropout run untraced, in the program itself.
    program = tmp_path / "scripted_softmax.py"
    program.write_text(textwrap.dedent("""
        import torch
        import torch.nn.functional as F

        @torch.jit.script
        def attend(scores: torch.Tensor, mask: torch.Tensor, p: float, training: bool) -> torch.Tensor:
            return F.dropout(F.softmax(scores + mask, dim=-1), p=p, training=training)

        scores = torch.randn(2, 3, 3)
        mask = torch.tensor([0.0, 0.0, -1e9]).expand(2, 3, 3)
        assert torch.allclose(attend(scores, mask, 0.5, False), (scores + mask).softmax(-1))
        q = torch.randn(2, 1, 3, 4)
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask[:, None] == 0)
    """))
    out = tmp_path / "scripted_softmax.json"
    result = CliRunner().invoke(app, ["trace", "--json", str(out), str(program)])
    assert json.loads(out.read_text())["exit_status"] == 0, result.output
    assert not getattr(F.softmax, "__wrapped__", None) and not swapped(F.softmax)  # (put back after the trace)
