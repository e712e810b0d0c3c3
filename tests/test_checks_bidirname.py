"""checks/bidirname.py: a transformers model the program subclassed and named bidirectional, run causal."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

HERE = Path(__file__).parent / "data" / "bidirname"


def test_state_llama_bidirectional_override_never_called(tmp_path):
    """ArcInstitute/state#227 (written blind, blind-xn; missed before): `LlamaBidirectionalModel` overrode
    `_update_causal_mask` to return None, which LlamaModel no longer calls, so every cell of the set saw only the
    cells before it. The reference: a set of 6 cells, 2 layers, 2 sets: 4 calls, each keeping no key after its query.
    The fix (a 4-D mask of ones handed in, which eager attention adds: a constant, no bool-added) quiet."""
    found = check_bug(tmp_path, "state_llama_bidirectional_update_causal_mask_override_dead", "bidirectional-run-causal")
    message = " ".join(found[0]["message"].split())
    assert "is run causal, as are all 4 calls under LlamaBidirectionalModel, though the program named the " \
           "transformers model it subclassed bidirectional" in message
    assert found[0]["source"] == "the class name LlamaBidirectionalModel"


def test_a_bimodel_whose_is_causal_flag_is_not_read_is_found(tmp_path):
    """Written another way: LLM2Vec's pattern, `Qwen2BiModel` turning each layer's is_causal off while the library
    still builds the causal mask, over a right-padded batch (the padded row's queries past its end see its 4 real
    keys). The fix (a 4-D padding mask of its own) quiet."""
    found = check_bug(tmp_path, "qwen2_bimodel_is_causal_flag_only", "bidirectional-run-causal", HERE)
    assert "as are all 2 calls under Qwen2BiModel" in " ".join(found[0]["message"].split())


def test_a_bidirectional_lm_of_two_causal_streams_is_quiet(tmp_path):
    """Correct: an ELMo-style model named bidirectional, its own nn.Module over two causal streams (one reversed)."""
    status, found, report = traced(tmp_path, "quiet_elmo_style_bidirectional_lm_two_causal_streams", False, HERE)
    assert status == 0, report
    assert [f for f in found if f["severity"] != "note"] == [], report
