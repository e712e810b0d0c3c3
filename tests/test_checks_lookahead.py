"""checks/lookahead.py: later keys within the look-ahead of an attention context the program states (NeMo's
`att_context_size=[left, right]`) are its word, not a causal mask's slip: sees-later is not said of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import traced

DATA = Path(__file__).parent / "data"
NAME = "conformer_module_att_context_sdpa"


def band(t: int, left: int, right: int) -> np.ndarray:
    """The reference: query i sees keys i - left .. i + right, by a double loop over positions."""
    cells = np.zeros((t, t), bool)
    for i in range(t):
        for j in range(t):
            cells[i, j] = i - left <= j <= i + right
    return cells


def test_nemo_att_context_stated_at_the_top_of_the_program_stays_quiet(tmp_path):
    """quiet_blind (written blind, quiet-o): NeMo's regular [4, 1] context over a padded batch, the pair a variable
    at the program's top level; its later keys are the one frame ahead it states."""
    status, found, report = traced(tmp_path, "nemo_conformer_regular_att_context_left_wider_than_right_padded", False,
                                   DATA / "quiet_blind")
    assert status == 0, report
    assert not [f for f in found if f["code"] == "sees-later" or f["severity"] in ("wrong", "suspicious")], report


def test_a_module_att_context_stays_quiet_and_a_wider_mask_does_not(tmp_path):
    """The pair held by the attention module itself (`self.att_context_size = [4, 1]`), SDPA with a bool mask: quiet as
    stated; a mask that sees 2 keys ahead is past it, and sees-later is said."""
    status, found, report = traced(tmp_path, NAME, False, DATA / "lookahead")
    assert status == 0 and not [f for f in found if f["code"] == "sees-later"], report
    status, found, report = traced(tmp_path, NAME, False, DATA / "lookahead", ("--wider",))
    assert [f for f in found if f["code"] == "sees-later"], report
    assert (band(12, 4, 2) & ~band(12, 4, 1)).any()  # (the wider mask's cells past the stated look-ahead)


def test_the_pair_is_read_at_the_call(tmp_path):
    """The call's details hold (left, right, where) as the module states it."""
    import json

    from typer.testing import CliRunner

    from maskcli.commands import app

    out = tmp_path / "run.json"
    result = CliRunner().invoke(app, ["trace", "--json", str(out), str(DATA / "lookahead" / f"{NAME}.py")])
    assert result.exit_code == 0, result.output
    calls = json.loads(out.read_text())["calls"]
    assert calls and all(list(call["details"]["look_ahead"][:2]) == [4, 1] for call in calls), calls
