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
