"""trace/handkv.py: the keys zero in K and V read behind a softmax written by hand, at the product of its weights with V
(q @ kᵀ's operands kept by reference to what they view), as zero-keys-seen reads them at an SDPA call."""

from __future__ import annotations

import json

import torch

import maskcli
from checkbugs import runner
from maskcli.commands import app

RING = """
import sys
import torch

def attend(query, key, value, mask=None):
    scores = torch.matmul(query, key.transpose(-2, -1)) / query.shape[-1] ** 0.5  # (kᵀ a temporary, gone at once)
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1), value)

torch.manual_seed(0)
B, H, S, D = 3, 2, 12, 8
written = [5, 9, 3]  # each row's keys, written at the end of its zero-filled buffer row
keys, values = torch.zeros(B, H, S, D), torch.zeros(B, H, S, D)
for b, n in enumerate(written):
    keys[b, :, S - n:], values[b, :, S - n:] = torch.randn(H, n, D), torch.randn(H, n, D)
query = torch.randn(B, 2 * H, 1, D).view(B, H, 2, 1, D)  # (two query heads a key head: group axes, folded)
mask = None
if "--fixed" in sys.argv:  # the fix: -inf over the slots nobody wrote
    mask = torch.full((B, 1, 1, 1, S), float("-inf"))
    for b, n in enumerate(written):
        mask[b, ..., S - n:] = 0
out = attend(query, keys.view(B, H, 1, S, D), values.view(B, H, 1, S, D), mask)
print(out.shape)
"""


def _left_runs(keys: torch.Tensor, values: torch.Tensor) -> list[int]:
    """Each row's run of keys zero in K and V in every head and dimension at its start, by a plain loop."""
    runs = []
    for b in range(keys.shape[0]):
        n = 0
        while n < keys.shape[2] and not keys[b, :, n].any() and not values[b, :, n].any():
            n += 1
        runs.append(n)
    return runs


def test_a_softmax_by_hand_records_the_zero_runs_a_loop_over_its_k_and_v_finds():
    torch.manual_seed(1)
    keys, values = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    keys[0, :, :2], values[0, :, :2] = 0, 0
    keys[1, :, :4], values[1, :, :4] = 0, 0
    query = torch.randn(2, 2, 3, 4)
    with maskcli.trace() as t:
        weights = torch.softmax(query @ keys.transpose(-2, -1), dim=-1)
        weights @ values
    (call,) = t.calls
    assert call.details["zero_kv"]["left"] == _left_runs(keys, values) == [2, 4]
    assert call.details["zero_kv"]["right"] == [0, 0]


def test_weights_never_multiplied_by_values_record_nothing():
    keys = torch.zeros(1, 1, 4, 4)
    keys[..., 2:, :] = 1.0
    with maskcli.trace() as t:
        torch.softmax(torch.randn(1, 1, 2, 4) @ keys.transpose(-2, -1), dim=-1)
    assert "zero_kv" not in t.calls[0].details


def test_a_decode_step_over_unwritten_zero_slots_with_no_mask_is_found_and_its_fix_is_quiet(tmp_path):
    """tiny-llm's continuous batching before ae06a7f (tests/data/blind): a zero-filled ring row per request, read whole
    by a one-query step handed no mask; the fix's -inf over the unwritten slots hides them."""
    program, out = tmp_path / "ring.py", tmp_path / "ring.json"
    program.write_text(RING)
    result = runner.invoke(app, ["trace", "--json", str(out), str(program)])
    found = [f for g in json.loads(out.read_text())["groups"] for f in g["findings"] if f["severity"] == "wrong"]
    assert result.exit_code == 1 and [f["code"] for f in found] == ["zero-keys-seen"], result.output
    assert "keys 0-6 whose K and V are exactly zero" in found[0]["message"]  # (row 0: 12 slots, the last 5 written)
    result = runner.invoke(app, ["trace", "--json", str(out), str(program), "--fixed"])
    assert result.exit_code == 0 and "zero-keys-seen" not in result.output, result.output


def test_tinyllm_continuous_batching_decode_over_a_zero_filled_ring_row(tmp_path):
    """skyzh/tiny-llm ae06a7f (written blind, blind-yj): each request's keys laid into a zero-filled ring row, read
    whole by its decode steps with mask=None through a grouped softmax by hand (5-D scores). The fix's per-request mask
    quiet."""
    from checkbugs import check_bug

    found = check_bug(tmp_path, "tinyllm_batching_kv_cache_decode_attends_unwritten_zero_slots", "zero-keys-seen")
    assert "whose K and V are exactly zero in every head" in " ".join(found[0]["message"].split())
