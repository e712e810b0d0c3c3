"""checks/rewritten.py (fed by trace/rewritten.py): a model call over the same batch and ids as an earlier one that
attends with the mask the earlier call's own forward wrote back into the batch, on a reproduction of a published bug
(sentence-transformers' Pooling writing its prompt-excluded mask into `features["attention_mask"]`, BERT then run again
on the same features by AdaptiveLayerLoss) and on the same bug written otherwise (a GradCache embedder with a dataclass
batch and a hand-written SDPA encoder, its instruction tokens narrowed out of `batch.attention_mask`); both fixes
quiet, and correct programs that change a batch's mask between two passes (the training loop's token dropout, a cast
written back, a pooling mask in another field, a narrowed batch never run again) quiet."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, first, traced
from maskcli.checks.context import Run, Top
from maskcli.checks.rewritten import rewritten_attended

REWRITTEN = Path(__file__).parent / "data" / "rewritten"


def _dropped(lengths: list[int], width: int, excluded: int, left: bool = False):
    """The first (row, query, key) of a batch where a key is one of the row's tokens (padded to `width`) among the
    first `excluded` of them (the prompt or instruction the pooling leaves out): the keys the rewritten mask hides.
    The reference: a loop over rows and positions."""
    def dropped(b, q, k):
        start = width - lengths[b] if left else 0
        return start <= k < start + lengths[b] and k < start + excluded
    return first((len(lengths), 1, width), dropped)


def test_sentence_transformers_prompt_mask_written_back_into_features_is_flagged(tmp_path):
    # huggingface/sentence-transformers#3944: with include_prompt=False, Pooling replaced features["attention_mask"]
    # with the prompt-excluded mask, so AdaptiveLayerLoss's repeated call ran BERT with [CLS] and the prompt masked
    # as keys; the fix narrows the mask for pooling only
    hits = check_bug(tmp_path, "sentence_transformers_pooling_prompt_mask_written_back_into_features",
                     "mask-rewritten-by-forward")
    # [CLS] + "query:" (prompt_length 2) + four words + [SEP] in each row of the first features dict
    assert tuple(hits[0]["cell"]) == _dropped([7, 7], 7, 2)
    assert "keys 0-1 are tokens of the attention_mask the program handed AdaptiveLayerLoss" in hits[0]["message"]
    assert "sentence_features[0]['attention_mask']" in hits[0]["message"]


def test_a_gradcache_embedder_narrowing_its_dataclass_batch_mask_is_flagged(tmp_path):
    hits = check_bug(tmp_path, "gradcache_instruction_mask_written_into_batch_dataclass", "mask-rewritten-by-forward",
                     REWRITTEN)
    # the queries: an instruction of 3 tokens before texts of 4, 2 and 3 tokens, padded on the right to 7
    assert tuple(hits[0]["cell"]) == _dropped([7, 5, 6], 7, 3)
    assert "batch row 0 (and rows 1, 2): keys 0-2" in hits[0]["message"]
    assert "batch.attention_mask" in hits[0]["message"]


def test_masks_the_program_changes_itself_or_that_drop_no_token_are_quiet(tmp_path):
    status, found, report = traced(tmp_path, "batch_masks_changed_by_the_program_correct", False, REWRITTEN)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


class _Call:
    def __init__(self, index, keep):
        self.index, self.where, self.api, self.step, self.details = index, "enc", "sdpa", 0, {}
        self.shape = tuple(keep.shape)
        self.stored = None
        self._keep = keep


def test_only_a_call_that_hides_the_dropped_keys_is_said(monkeypatch):
    before = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=bool)
    after = before.copy()
    after[:, 0] = False
    rewrite = {"batch": "features", "field": "attention_mask", "before": before, "after": after, "by": "M", "call": 0}

    def cells(seen):
        return np.broadcast_to(seen[:, None, None, :], (2, 1, 5, 5))

    monkeypatch.setattr("maskcli.checks.rewritten.keep", lambda call: call._keep)
    for seen, said in ((after, True), (before, False), (np.ones_like(before), False), (after & ~after, False)):
        call = _Call(0, cells(seen))
        run = Run(calls=[call], tops=[Top("M", first=0, end=1, rewritten=(rewrite,))])
        assert bool(rewritten_attended(run)) == said
