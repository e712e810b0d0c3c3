"""checks/anchored.py: a sliding window laid on a call's own rows instead of its queries' positions, on a published
bug written blind (keras-hub) and a second program written another way (a Llama-style start_pos, a later prefill
chunk, a one-sided tril bias); each fix is quiet."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug

WINDOWS = Path(__file__).parent / "data" / "windows"


def test_keras_hub_cached_gemma_band_of_row_zero(tmp_path):
    # keras-team/keras-hub#1738: triu/tril band on the (1, key_len) decode mask keeps keys 0 .. W - 1 at every step;
    # the query's position is the layer call's cache_update_index (an int), the window the config's sliding_window_size
    flagged = check_bug(tmp_path, "keras_hub_gemma_cached_sliding_window_anchored_at_row0", "window-anchored-at-row")
    # query at position p (cache_update_index, from 4 on) sees keys 0-3, as the double loop over the band says
    for p in range(4, 9):
        seen = [k for k in range(10) if k <= p and abs(k - 0) < 4]
        assert any(f"position {p} sees keys {seen[0]}-{seen[-1]} " in f["message"] and f"not {p - 3}-{p}" in f["message"]
                   for f in flagged), flagged
    assert all(f["source"].startswith("sliding_window_size=4 (config (GemmaBackboneConfig) in main()") for f in flagged)


def test_a_later_prefill_chunk_given_the_window_of_its_rows(tmp_path):
    # forward(h, start_pos): the second chunk of 4 (positions 4-7) masks keys up to row - W, not start_pos + row - W
    flagged = check_bug(tmp_path, "start_pos_window_on_chunk_rows", "window-anchored-at-row", WINDOWS)
    assert [f["message"].split(": the query")[1][:32] for f in flagged] == [" at position 4 sees keys 0-4 (ro"], flagged
    assert flagged[0]["source"] == "sliding_window=3 (self.params of Transformer (ModelArgs))"


def _keep(pad: torch.Tensor, start: int, q_len: int, k_len: int, size: int, anchored: bool) -> torch.Tensor:
    """The (B, 1, q_len, k_len) keep mask by a double loop over absolute positions: key j of row b is seen by query i
    (at position start + i) where it is real, not later, and within `size` of the position (of the row i where
    `anchored`: the bug)."""
    keep = torch.zeros(pad.shape[0], 1, q_len, k_len, dtype=torch.bool)
    for b in range(pad.shape[0]):
        for i in range(q_len):
            for j in range(k_len):
                at = i if anchored else start + i
                keep[b, 0, i, j] = bool(pad[b, j]) and j <= start + i and abs(at - j) < size
            if not pad[b, start + i]:
                keep[b, 0, i, start + i] = True  # a padding query sees itself only (no NaN row)
    return keep


class _StaticCacheModel(torch.nn.Module):
    """A model of its own whose forward(x, attention_mask, start_pos) attends over a static cache of 12 slots with
    the mask the double loop makes; its window stated in a dict (self.cfg)."""

    def __init__(self, anchored: bool):
        super().__init__()
        self.cfg, self.anchored = {"sliding_window": 3}, anchored

    def forward(self, x, attention_mask, start_pos):
        q = x[:, None]
        keys = torch.randn(x.shape[0], 1, 12, x.shape[-1])
        keep = _keep(attention_mask, start_pos, x.shape[1], 12, self.cfg["sliding_window"], self.anchored)
        return torch.nn.functional.scaled_dot_product_attention(q, keys, keys, attn_mask=keep)


def _found(anchored: bool, steps) -> list:
    import maskcli
    from maskcli.checks.registry import severity

    pad = torch.ones(2, 12, dtype=torch.long)
    pad[1, :2] = 0  # row 1 left-padded by two
    model = _StaticCacheModel(anchored)
    with maskcli.trace() as t, torch.no_grad():
        for start, q_len in steps:
            model(torch.randn(2, q_len, 4), pad, start)
    return sorted({(f.code, severity(f)) for group in t.groups() for f in group.findings if severity(f) != "note"})


def test_a_left_padded_batch_on_a_static_cache_of_its_own():
    # a prefill of 4 from position 0 (rows are positions: quiet either way), a chunk of 3 at 4, decode steps at 7, 8
    steps = [(0, 4), (4, 3), (7, 1), (8, 1)]
    assert ("window-anchored-at-row", "wrong") in _found(True, steps)
    assert [code for code in _found(False, steps) if code[1] == "wrong"] == []
    assert [code for code in _found(True, steps[:1]) if code[1] == "wrong"] == []
