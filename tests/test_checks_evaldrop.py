"""checks/evaldrop.py (trace/evaldrop.py): attention weights dropped at random inside a module in eval mode, caught in
the published bug's reproduction (tests/data/bugs, written blind) and in a program written another way
(tests/data/evaldrop), quiet on the fixes and in training mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkbugs import check_bug, traced

EVALDROP = Path(__file__).parent / "data" / "evaldrop"
PROGRAM = "encoder_sdpa_dropout_p_not_tied_to_training"


def test_kronos_attention_function_drops_weights_with_train_true_in_eval(tmp_path):
    """shiyu-coder/Kronos 8715716 (written blind, batch blind-lr; caught once this rule was added): its own attention
    function called `torch.dropout(attn_weight, dropout_p, train=True)`, so after model.eval() every forecast step still
    dropped attention weights. The fix passes `training=self.training`."""
    flagged = check_bug(tmp_path, "kronos_attention_dropout_left_on_in_eval_decoder", "dropout-in-eval")
    assert "MultiHeadAttentionWithRoPE is in eval mode" in flagged[0]["message"]
    assert "torch.dropout(weights, 0.3, train=True)" in flagged[0]["message"]


@pytest.mark.parametrize("args, said", [((), "SDPA is handed dropout_p=0.2"),
                                        (("--functional",), "F.dropout(weights, p=0.2) leaves training=True")])
def test_a_dropout_rate_not_tied_to_the_modules_mode_is_found(tmp_path, args, said):
    """Written another way: an encoder's SDPA handed `dropout_p=self.attn_dropout`, or its weights written out and
    dropped by `F.dropout(attn, p)`, in eval mode; one finding per call site (two layers, one line). The fixes tie the
    rate to self.training."""
    flagged = check_bug(tmp_path, PROGRAM, "dropout-in-eval", folder=EVALDROP, args=args)
    assert len(flagged) == 1 and said in flagged[0]["message"], flagged
    assert flagged[0]["message"].startswith("SelfAttention is in eval mode (training=False)")


@pytest.mark.parametrize("args", [("--train",), ("--functional", "--train")])
def test_dropout_in_training_mode_is_quiet(tmp_path, args):
    """The same model in training mode: dropping the weights is what the module states."""
    status, found, report = traced(tmp_path, PROGRAM, False, EVALDROP, args)
    assert status == 0 and [f for f in found if f["code"] == "dropout-in-eval"] == [], report
