"""checks/decoders.py: a config that says is_decoder=True whose self-attention sees later real keys."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

HELD = Path(__file__).parent / "data" / "held"


def test_roformer_causal_lm_bidirectional(tmp_path):
    """transformers#48745: RoFormerForCausalLM (config.is_decoder=True) built a bidirectional mask."""
    check_bug(tmp_path, "roformer_causal_lm_decoder_bidirectional_mask", "decoder-sees-later")


def test_dict_config_decoder_padding_only(tmp_path):
    """Written another way: a dict config held as self.cfg, a left-padded batch; the first cell is a double loop's over
    real queries and later real keys."""
    status, found, report = traced(tmp_path, "dict_config_decoder_padding_only", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "decoder-sees-later")
    assert hit["severity"] == "wrong" and "self.cfg of LM (dict)" in hit["source"]
    real = [[0, 0, 1, 1, 1], [1] * 5]
    assert tuple(hit["cell"]) == first((2, 5, 5), lambda b, q, k: k > q and bool(real[b][q] and real[b][k]))
    status, found, report = traced(tmp_path, "dict_config_decoder_padding_only", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_encoder_decoder_and_encoders_left_alone():
    """fields_of: is_decoder=True alone says a causal decoder; an encoder-decoder's whole config or is_decoder=False
    does not; a config with neither states nothing."""
    from maskcli.checks.intent import fields_of

    assert fields_of({"is_decoder": True})["causal_decoder"] is True
    assert fields_of({"is_decoder": True, "is_encoder_decoder": True}) == {}
    assert fields_of({"is_decoder": False, "hidden": 4}) == {}
    assert fields_of({"is_decoder": False, "sliding_window": 4})["causal_decoder"] is False
