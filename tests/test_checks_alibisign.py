"""checks/alibisign.py (fed by trace/flexbias.py): a bias the program names ALiBi that rises with the key's distance,
on attention-gym#86 (a causal score_mod with the distance's sign turned, written blind) and on a bidirectional
encoder's |q - k| added where it is subtracted; both fixes quiet. _rising against a loop over heads and distances."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug
from maskcli.checks.alibisign import _rising

ALIBISIGN = Path(__file__).parent / "data" / "alibisign"


def test_attention_gym_alibi_score_mod_with_its_sign_turned_is_flagged(tmp_path):
    # meta-pytorch/attention-gym#86 (290c1e7; written blind, batch blind-gr): generate_alibi_bias's score_mod added
    # (q_idx - kv_idx) * scale, which under the causal mask grows with distance; the fix adds (kv_idx - q_idx) * scale.
    # Head 0's slope is 2 ** -(8 / 4) = 0.25 over 16 tokens: 0.25 at distance -1, 15 * 0.25 at -15
    [hit] = check_bug(tmp_path, "attention_gym_alibi_score_mod_bias_sign_flipped", "alibi-rewards-distance")
    message = " ".join(hit["message"].split())
    assert message.startswith("head 0: the score_mod alibi_mod adds 3.75 at distance -15 and 0.25 at distance -1"), message


def test_bidirectional_alibi_added_instead_of_subtracted_is_flagged(tmp_path):
    # written another way: an encoder's symmetric slope * |q - k| over a key-padding block mask (24 and 17 tokens)
    [hit] = check_bug(tmp_path, "flex_bidirectional_alibi_abs_distance_added", "alibi-rewards-distance", ALIBISIGN)
    message = " ".join(hit["message"].split())
    assert "adds 5.75 at distance -23 and 0.25 at distance -1" in message, message


def _reference(low, high):
    width = len(low[0]) // 2
    for head in range(len(low)):
        seen = [d for d in range(-width, width + 1) if d != 0 and low[head][d + width] is not None]
        if len(seen) < 2 or any(abs(low[head][d + width] - high[head][d + width]) > 1e-6 for d in seen):
            continue
        for side in ([d for d in seen if d < 0], [d for d in seen if d > 0]):
            side = sorted(side, key=abs)
            if len(side) < 2:
                continue
            values = [low[head][d + width] for d in side]
            steps = [b - a for a, b in zip(values, values[1:])]
            if all(s >= -1e-6 for s in steps) and any(s > 1e-6 for s in steps) and values[0] > -1e-6:
                return head, (side[0], values[0]), (side[-1], values[-1])
    return None


def test_rising_matches_a_loop_over_heads_and_distances():
    rng = np.random.default_rng(0)
    for _ in range(300):
        heads, width = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        slope = rng.normal(size=(heads, 1)) * (rng.random((heads, 1)) < 0.8)
        distance = np.arange(-width, width + 1)[None, :]
        values = slope * np.abs(distance) + (rng.random((heads, 2 * width + 1)) < 0.2) * rng.normal(size=(heads, 2 * width + 1))
        values = np.where(distance == 0, 0.0, values)
        low = [[None if rng.random() < 0.2 else round(float(v), 6) for v in row] for row in values]
        high = [[v if v is None or rng.random() < 0.9 else v + 1.0 for v in row] for row in low]
        assert _rising({"low": low, "high": high}) == _reference(low, high)
