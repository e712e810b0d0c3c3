"""checks/biasdropped.py: a stack's first layer adds a relative position bias and its later layers, whose forward
takes it, are handed none."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from checkbugs import check_bug, traced
from maskcli.checks.biasdropped import bias_dropped
from maskcli.checks.context import Run

RELBIAS = Path(__file__).parent / "data" / "relbias"


def call(index: int, layer: int, biased: bool, handed_none: bool, step: int = 0):
    details = {"bias": True} if biased else {}
    if handed_none:
        details["bias_none"] = ("Attention", "position_bias")
    return SimpleNamespace(index=index, where=f"encoder.layers.{layer}.attention", step=step, shape=(2, 4, 6, 6),
                           details=details, stored=None)


def test_later_layers_handed_no_bias_beside_a_first_layer_that_adds_one():
    calls = [call(0, 0, True, False), *(call(i, i, False, True) for i in (1, 2, 3))]
    [(hit, finding)] = bias_dropped(Run(calls))
    assert hit.where == "encoder.layers.1.attention" and finding.code == "bias-dropped"
    assert "layers 1-3 of this stack add no position bias" in finding.message
    assert "Attention.forward's position_bias is None at the kernel" in finding.message


def test_quiet_where_the_bias_is_handed_on_or_no_layer_adds_one_or_a_later_layer_adds_its_own():
    handed = [call(0, 0, True, False), *(call(i, i, True, False) for i in (1, 2, 3))]
    none_at_all = [call(i, i, False, True) for i in range(4)]
    mixed = [call(0, 0, True, False), call(1, 1, False, True), call(2, 2, True, False)]
    for calls in (handed, none_at_all, mixed):
        assert bias_dropped(Run(calls)) == []


def test_each_pass_over_the_layers_is_read_apart():
    # two passes: the first hands the bias on, the second drops it; one finding, at the second pass's layer 1
    calls = [call(0, 0, True, False), call(1, 1, True, False), call(2, 0, True, False), call(3, 1, False, True)]
    [(hit, _)] = bias_dropped(Run(calls))
    assert hit.index == 3


def test_torchaudio_wavlm_extract_features_drops_the_relative_position_bias(tmp_path):
    # pytorch/audio#3350 (written blind, batch blind-yi): get_intermediate_outputs called `layer(x, attention_mask)`
    # and ignored the position bias layer 0 returned, so WavLM's layers 1-3 ran SDPA with no bias
    [hit] = check_bug(tmp_path, "torchaudio_wavlm_extract_features_drops_relative_position_bias", "bias-dropped")
    assert "layers 1-3 of this stack add no position bias" in hit["message"]


def test_written_another_way_a_t5_style_eager_encoder(tmp_path):
    # the same bug by hand: eager softmax, the bias added to the scores, the padding masked_fill-ed in every layer
    [hit] = check_bug(tmp_path, "t5_style_encoder_loop_drops_position_bias", "bias-dropped", RELBIAS)
    assert "Attention.forward's position_bias is None at the kernel" in hit["message"]
    status, found, report = traced(tmp_path, "t5_style_encoder_loop_drops_position_bias", True, RELBIAS)
    assert status == 0 and not [f for f in found if f["code"] == "bias-dropped"], report
