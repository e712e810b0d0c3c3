"""checks/bothways.py: a sliding layer's window where the config states the attention both ways, and ModernBERT's,
whose `local_attention` says each side reaches sliding_window = local_attention // 2 keys, |q - k| <= W."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkbugs import check_bug, traced
from maskcli.checks.bothways import judged
from maskcli.checks.config import Placed
from maskcli.checks.intent import Intent, Stated, fields_of

WINDOWS = Path(__file__).parent / "data" / "windows"


def placed(reach: int, length: int = 12) -> Placed:
    """Every query of one unpadded row sees the keys up to `reach` positions away on either side (a double loop)."""
    cells = np.zeros((1, 1, length, length), bool)
    for q in range(length):
        for k in range(length):
            cells[0, 0, q, k] = abs(q - k) <= reach
    return Placed(cells, np.arange(length), np.ones((1, length), bool), np.ones((1, length), bool))


def intent(**fields) -> Intent:
    return Intent([Stated("config (ModernBertConfig)", "", fields)])


@pytest.mark.parametrize(("reach", "said"), [(3, "one key short of the 4"), (5, "one key over of the 4"), (4, None)])
def test_modernberts_window_reaches_half_of_local_attention_on_each_side(reach, said):
    found, lost, windowed = judged(intent(sliding_window=4, local_attention=8, transformers=True), placed(reach), 4,
                                   "layer 1", "sliding_window=4", ("sliding_attention", "layer_types[1]"))
    assert lost is None and windowed
    if said is None:
        assert found == []
    else:
        assert [f.code for f in found] == ["window-off-by-one"] and said in found[0].message
        assert found[0].severity is None and found[0].expected == "band(5)"


def test_a_config_of_the_programs_own_is_only_suspicious_and_other_bidirectional_counts_stay_accepted():
    found, _, _ = judged(intent(sliding_window=4, local_attention=8, is_causal=False), placed(3), 4, "layer 1",
                         "sliding_window=4", ("sliding_attention", "layer_types[1]"))
    assert found[0].severity == "suspicious" and "unless this port counts its window otherwise" in found[0].message
    for reach in (3, 4, 2):  # |q-k| < W, <= W, <= W/2: no config here says which
        assert judged(intent(sliding_window=4, is_causal=False), placed(reach), 4, "layer 1", "sliding_window=4",
                      ("sliding_attention", "layer_types[1]")) == ([], None, True)
    assert judged(intent(sliding_window=4), placed(3), 4, "layer 1", "sliding_window=4", ("sliding_attention", "")) is None


def test_only_the_encoders_config_states_local_attention():
    transformers = pytest.importorskip("transformers")
    encoder = fields_of(transformers.ModernBertConfig(local_attention=8, num_hidden_layers=3))
    decoder = fields_of(transformers.ModernBertDecoderConfig(local_attention=8, num_hidden_layers=3))
    assert encoder["local_attention"] == 8 and encoder["sliding_window"] == 4
    assert "local_attention" not in decoder  # (modernbert-decoder's window is causal)


def test_vllm_modernbert_local_window_one_key_short(tmp_path):
    # vllm-project/vllm#44040 (written blind): the encoder-only flash path handed local_attention // 2 reached one key
    # short on each side
    found = check_bug(tmp_path, "vllm_modernbert_local_window_one_key_short", "window-off-by-one")
    assert "one key short of the 4 its config states (local_attention=8" in found[0]["message"]


def test_written_another_way_a_hand_written_encoder_over_modernbertconfig(tmp_path):
    # the same bug by hand: the band `(q - k).abs() < config.sliding_window` over transformers' ModernBertConfig,
    # which states no is_causal, on a right-padded batch
    found = check_bug(tmp_path, "modernbert_config_local_band_strict_less_than_half_window", "window-off-by-one", WINDOWS)
    assert "layer 1 sees keys up to 2 positions away on either side, one key short of the 3" in found[0]["message"]
    _, fixed, _ = traced(tmp_path, "modernbert_config_local_band_strict_less_than_half_window", True, WINDOWS)
    assert not [f for f in fixed if f["code"].startswith("window")]
