"""trace/masks.py: the kernel's mask read off an SDPA call, on small programs run through `maskcli trace`."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from maskcli.commands import app

runner = CliRunner()

INTEGER = """
import torch, torch.nn.functional as F
q = torch.randn(1, 2, 5, 8)
try:
    F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.DTYPE).tril())
except RuntimeError as error:
    print("refused")
"""


def test_an_integer_attn_mask_that_sdpa_refuses_is_no_float_bias(tmp_path):
    """SDPA refuses a uint8 or int64 attn_mask beside float queries (the program catches it): the call raised, said
    so, and nothing says the mask is a float one that adds a bias (it adds nothing: no attention ran). Exit 0."""
    for dtype in ("uint8", "int64"):
        script, out = tmp_path / f"{dtype}.py", tmp_path / f"{dtype}.json"
        script.write_text(INTEGER.replace("DTYPE", dtype))
        result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
        codes = [f["code"] for g in json.loads(out.read_text())["groups"] for f in g["findings"]]
        assert result.exit_code == 0 and codes == ["call-raised"], result.output
        assert "refused" in result.output and "the float attn_mask also adds" not in result.output


def test_an_sdpa_call_handed_a_mask_and_is_causal_is_read_as_both():
    """torch documents that attn_mask with is_causal=True raises, yet the kernel it runs keeps both: the mask and the
    top-left causal (nanoVLM's language model hands a left padding mask with is_causal on its prefill; quiet-r68b,
    written blind, read as the padding alone: causal-lost and sees-its-target on a correct program). The recorded keep
    is what the kernel ran: the output matches SDPA over the two put together by hand, not the mask alone."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    import maskcli

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 5, 8).unbind(0)
    real = torch.tensor([[True] * 5, [False, False, True, True, True]])  # (row 1 padded on the left)
    for mask in (real[:, None, None, :], torch.zeros(2, 1, 1, 5).masked_fill(~real[:, None, None, :], -1e9)):
        with maskcli.trace() as t:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
        both = real[:, None, None, :] & torch.ones(5, 5, dtype=torch.bool).tril()
        kept = t.calls[0].keep()
        expected = np.array([[[[bool(real[b, j]) and j <= i for j in range(5)] for i in range(5)]] for b in range(2)])
        assert (kept == np.broadcast_to(expected, kept.shape)).all()
        alone = F.scaled_dot_product_attention(q, k, v, attn_mask=both)
        assert torch.allclose(out[0], alone[0]) and torch.allclose(out[1, :, 2:], alone[1, :, 2:])  # (the real rows)


def test_grouped_scores_of_six_dims_are_read_as_one_call_per_head():
    """tiny-llm's grouped attention (written blind, blind-mh; no call was recorded): queries (B, 1, kv heads, repeats,
    Lq, D) against keys (B, 1, kv heads, 1, Lk, D), a bottom-right causal mask of -inf added, torch.softmax over the
    last axis. Read as a (B, kv heads x repeats, Lq, Lk) call whose cells are a double loop's over positions; its
    output matches SDPA's with the same mask, the keys repeated per group."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    import maskcli

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 2, 3, 2, 8), torch.randn(1, 1, 2, 1, 5, 8), torch.randn(1, 1, 2, 1, 5, 8)
    bias = torch.where(torch.ones(2, 5).tril(3).bool(), 0.0, float("-inf"))  # (query i sees keys j <= i + 3)
    with maskcli.trace() as t:
        out = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5 + bias, dim=-1) @ v
    [call] = t.calls
    assert call.shape == (1, 6, 2, 5)
    expected = np.array([[j <= i + 3 for j in range(5)] for i in range(2)])
    assert (call.keep() == np.broadcast_to(expected, call.keep().shape)).all()
    want = F.scaled_dot_product_attention(q[:, 0].reshape(1, 6, 2, 8), k[:, 0].expand(1, 2, 3, 5, 8).reshape(1, 6, 5, 8),
                                          v[:, 0].expand(1, 2, 3, 5, 8).reshape(1, 6, 5, 8), attn_mask=bias == 0)
    assert torch.allclose(out[:, 0].reshape(1, 6, 2, 8), want, atol=1e-6)
