"""checks/prefixloss.py (and trace/losses.py, which reads the loss mask a per-token loss is weighed by): a prefix LM
whose loss starts one query after the last prefix query."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

PREFIXLOSS = Path(__file__).parent / "data" / "prefixloss"


def test_megatron_prefix_lm_prefix_index_offset(tmp_path):
    """bigscience-workshop/Megatron-DeepSpeed#167 (written blind, batch blind-dd): `loss_mask[b, :prefix_index] = 0`
    beside a prefix of prefix_index tokens; the fix masks `[:prefix_index - 1]`. Before the loss mask was read,
    sees-its-target fired on both (the prefix's queries see their targets, but the loss mask weighs them 0)."""
    check_bug(tmp_path, "megatron_deepspeed_prefix_lm_prefix_index_offset", "prefix-target-skipped")
    for fixed in (False, True):
        status, found, report = traced(tmp_path, "megatron_deepspeed_prefix_lm_prefix_index_offset", fixed)
        assert [f for f in found if f["code"] == "sees-its-target"] == [], report


def test_labels_ignore_first_target_padded(tmp_path):
    """Written another way: Hugging Face labels at -100 shifted in the model, right-padded rows, a keep mask to SDPA.
    The rows and the first cell against a double loop over the collator's own prefixes and labels."""
    [hit] = check_bug(tmp_path, "labels_ignore_first_target_padded", "prefix-target-skipped", folder=PREFIXLOSS)
    prefixes, lengths = (5, 3, 7), (12, 7, 9)
    rows = []
    for b in range(3):
        keep = [[k < lengths[b] and (k <= q or k < prefixes[b]) for k in range(12)] for q in range(12)]
        p = sum(keep[0])  # the keys the first query sees: the prefix
        labels = [None if i <= prefixes[b] or i >= lengths[b] else i for i in range(12)]  # buggy: [:prefix + 1]
        first = min(q for q in range(11) if labels[q + 1] is not None)
        if first == p:
            rows.append((b, p - 1, p))
    assert tuple(hit["cell"]) == rows[0]
    assert f"({len(rows)} such rows)" in hit["message"].replace("\n", " ")
