"""checks/heads.py: padding that differs between the heads of one batch row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from checkbugs import check_bug, first, traced
from maskcli.checks import heads
from maskcli.checks.context import Run

ARGS = Path(__file__).parent / "data" / "args"
QUIET = Path(__file__).parent / "data" / "quiet"


def test_mlx_lm_gemma2_gqa_mask_broadcast_batch(tmp_path):
    """ml-explore/mlx-lm#1903: a (B, 1, L, S) mask against 5-D grouped-query scores lands on the kv-head axis."""
    check_bug(tmp_path, "mlx_lm_gemma2_gqa_mask_broadcast_batch", "padding-per-head")


def test_uvadlc_tutorial_padding_mask_broadcast_over_heads(tmp_path):
    """phlippe/uvadlc_notebooks ac42535 (written blind, round 52, caught before any rule was changed for it): tutorial 6's
    [B, 1, L] mask handed to masked_fill on [B, H, L, L] scores with B == H, so head h of every row masks with row h's
    padding. The first key (by a loop over rows, heads and keys) one head hides and another of its row shows."""
    hit = next(f for f in check_bug(tmp_path, "uvadlc_tutorial6_3d_padding_mask_broadcast_over_heads", "padding-per-head"))
    real = torch.arange(6)[None, :] < torch.tensor([6, 4, 5, 3])[:, None]
    laid = real[None, :, :].expand(4, 4, 6)  # (row b, head h) masked with row h's padding
    odd = first((4, 4, 6), lambda b, h, k: bool(not laid[b, h, k] and laid[b, :, k].any()))
    assert tuple(hit["cell"]) == (odd[0], odd[2], odd[2])
    assert hit["message"].startswith(f"batch row {odd[0]}: heads 1-3 hide keys 4-5 from every query")


def test_padding_repeated_over_heads(tmp_path):
    """Written another way: right padding, SDPA, the (batch * heads) padding built with .repeat; the key reported is
    the first a double loop over rows, heads and keys finds hidden from every query of one head and shown by another."""
    status, found, report = traced(tmp_path, "padding_repeated_over_heads", fixed=False, folder=ARGS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "padding-per-head")
    real = torch.arange(6)[None, :] < torch.tensor([6, 3, 5])[:, None]
    spread = real.repeat(2, 1).view(3, 2, 6)  # what the buggy program laid on head h of row b
    odd = first((3, 2, 6), lambda b, h, k: bool(not spread[b, h, k] and spread[b, :, k].any()))
    assert hit["severity"] == "wrong" and tuple(hit["cell"]) == (odd[0], odd[2], odd[2])
    status, found, report = traced(tmp_path, "padding_repeated_over_heads", fixed=True, folder=ARGS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


class _Call:
    def __init__(self, cells):
        self.index, self.where, self.step, self.api = 0, "layers.0.attn", 0, "sdpa"
        self.shape, self.details, self.mask = cells.shape, {}, "m"
        self.stored = {"form": "dense", "planes": list(cells.shape[:2])}
        self.cells = cells


def _found(cells, monkeypatch):
    monkeypatch.setattr(heads, "keep", lambda call: call.cells)
    return heads.per_head(Run([_Call(cells)], [], []))


def test_heads_with_their_own_windows_are_quiet(monkeypatch):
    """Heads that differ by a window (causal in head 0, a window of 2 in head 1) and a left-padded batch padded alike in
    every head are quiet; the same batch with head 1 of row 0 given row 1's padding is found."""
    n = 5
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    window = causal & ~torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-2)
    real = torch.tensor([[True] * 5, [False, False, True, True, True]])
    per_row = [causal & real[b][None, :] for b in range(2)]
    cells = torch.stack([torch.stack([per_row[b], per_row[b] & window]) for b in range(2)]).numpy()
    assert _found(cells, monkeypatch) == []
    wrong = cells.copy()
    wrong[0, 1] = per_row[1].numpy()
    (_, finding), = _found(wrong, monkeypatch)
    assert finding.code == "padding-per-head" and finding.cell == (0, 0, 0)
    assert "head 1 hides keys 0-1" in finding.message


def test_heads_that_each_attend_their_own_selected_queries_are_quiet(monkeypatch):
    """Informer's ProbSparse (tests/data/quiet_blind/informer_probsparse_probmask.py): each head of each row attends
    only its own top-u queries, each row the causal row of its query (keys 0..p). A key no row of one head sees is
    then a key whose own query that head did not pick: quiet. The same planes with row 1's right padding (3 real keys
    of 8) laid on head 1 of row 0 are found: rows that end alike at the padding are no query positions."""
    picks = [[[1, 4, 7], [0, 2, 5]], [[3, 6, 7], [1, 2, 4]]]  # (row, head) -> its selected query positions
    n = 8
    cells = np.zeros((2, 2, 3, n), dtype=bool)
    for b in range(2):
        for h in range(2):
            for i, p in enumerate(picks[b][h]):
                cells[b, h, i] = [k <= p for k in range(n)]  # the causal row of query p, by a loop
    assert _found(cells, monkeypatch) == []
    wrong = cells.copy()
    wrong[0, 1] &= np.arange(n) < 3
    (_, finding), = _found(wrong, monkeypatch)
    odd = [k for k in range(n) if not wrong[0, 1, :, k].any() and wrong[0, 0, :, k].any() and k >= n - 3]
    assert finding.code == "padding-per-head" and finding.cell == (0, odd[0], odd[0])


def test_informer_probsparse_written_as_transformers_does_is_quiet(tmp_path):
    """transformers' InformerProbSparseAttention (tests/data/quiet): heads folded into the batch, a finfo.min causal
    mask gathered at each head's top-u queries; flagged padding-per-head before heads.py placed a head's queries by
    its own causal rows."""
    status, found, report = traced(tmp_path, "hf_informer_probsparse_decoder_additive_mask", False, QUIET)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_clip4clip_frame_mask_repeated_over_heads_lays_one_videos_padding_on_another(tmp_path):
    """ArrowLuo/CLIP4Clip#22 (written blind, caught before any rule was tuned for it): `repeat` lays each video's
    frame mask on the heads of the wrong batch row."""
    check_bug(tmp_path, "clip4clip_seqtransf_video_mask_repeat_over_heads", "padding-per-head")


def test_an_axis_before_the_heads_with_padding_of_its_own_is_batch_like(tmp_path):
    """5-D scores (B, T, H, N, N), a frame axis before the heads, each (video, frame) with its own patch padding: quiet
    (the shape of OpenFold's MSA row attention, tests/data/quiet_blind). The same program that keeps only each video's
    padding (B, N) and lays it as pad[:, None, None, :] puts video b's padding on frame b of every video: found, at the
    first (row, head, key) a double loop finds hidden from every query of one head and shown by another."""
    status, found, report = traced(tmp_path, "frame_padding_five_d_scores", fixed=False, folder=ARGS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    status, found, report = traced(tmp_path, "frame_padding_five_d_scores", fixed=False, folder=ARGS, args=("--buggy",))
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "padding-per-head")
    counts = torch.tensor([[6, 4], [3, 5]])
    valid = torch.arange(6)[None, None, :] < counts[:, :, None]
    laid = valid[:, 0][None, :, None, :].expand(2, 2, 2, 6).reshape(2, 4, 6)  # (B, T * H, N): what the bug laid
    odd = first((2, 4, 6), lambda b, h, k: bool(not laid[b, h, k] and laid[b, :, k].any()))
    assert hit["severity"] == "wrong" and tuple(hit["cell"]) == (odd[0], odd[2], odd[2]), report


def test_five_d_scores_read_their_axis_before_the_heads_by_what_the_batch_axis_says(monkeypatch):
    """(B, N, R) scores read as (B, N * R) heads: N's planes with padding of their own are batch-like where the batch
    rows differ (or there is one), and N is heads where every batch row masks alike while N's planes differ, unless
    the plane that differs hides every key (an empty slice of a batch-like axis, a padded MSA row)."""
    n = 4
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))

    def padded(count):
        return causal & (torch.arange(n) < count)[None, :]  # keys past `count` padding

    def five(counts, repeats=2):  # counts[b][m]: the real keys of plane (b, m); every head r of it alike
        return torch.stack([torch.stack([padded(c) for c in row for _ in range(repeats)]) for row in counts]).numpy()

    def found(cells, lead):
        call = _Call(cells)
        call.details = {"lead": lead}
        monkeypatch.setattr(heads, "keep", lambda c: c.cells)
        return heads.per_head(Run([call], [], []))

    assert found(five([[4, 2]]), (1, 2, 2)) == []  # one batch row, planes of their own
    assert found(five([[4, 2], [3, 4]]), (2, 2, 2)) == []  # batch rows that differ: the planes are theirs
    (_, hit), = found(five([[4, 2], [4, 2]]), (2, 2, 2))  # alike in every batch row, differing by plane: heads
    assert hit.code == "padding-per-head" and "heads 2-3 hide keys 2-3" in hit.message
    empty = five([[4, 0], [4, 0]])  # alike in every batch row, the plane that differs hides every key
    assert found(empty, (2, 2, 2)) == []


def test_diffusers_hunyuan_video_bnn_mask_broadcast_over_heads(tmp_path):
    """huggingface/diffusers#10454: HunyuanVideo hands SDPA a [B, N, N] mask, which broadcasts on the heads axis, so
    head h of each sample takes sample h's padding (written blind, batch blind-x; caught before any rule was changed
    for it)."""
    [hit] = check_bug(tmp_path, "diffusers_hunyuan_video_bnn_mask_broadcast_over_heads", "padding-per-head")
    assert "differs by head" in hit["message"]


def test_heads_first_scores_are_no_batch_mask_on_the_heads(tmp_path):
    """Hand-written scores laid out (H, B, Lq, Lk), each batch row's padding on dim 1 (the program checks itself against a
    double loop over rows and heads): read as (B, H, Lq, Lk) they look like one batch mask laid on the heads, which
    the program never wrote. Quiet where the module's head count (2) is not the axis read as heads (3), and where no
    module states a head count. Where the module states it (num_heads = 2, the first axis), trace reads the scores
    heads first (trace/layouts.py): (B, H) = (3, 2), each row's padding its own, lengths 5, 3, 4 as the program wrote."""
    for args, shape in (((), "(3,2,5,5)"), (("--unstated",), "(2,3,5,5)")):
        status, found, report = traced(tmp_path, "heads_first_scores_padding", fixed=False, folder=ARGS, args=args)
        assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
        assert shape in report, report
    assert "padding (--lengths 5,3,4) · softmax prefill (3,2,5,5)" in traced(
        tmp_path, "heads_first_scores_padding", fixed=False, folder=ARGS)[2]


def test_hand_written_scores_claim_the_heads_axis_only_where_the_program_states_it(monkeypatch):
    """A softmax's mask alike in every batch row and differing by head: said where the module's head count is the axis
    read as heads, or where an einsum or permute laid the scores out (details["axes"]); quiet where the head count is
    another axis's size, or none is stated. A kernel's own layout (SDPA) states its heads."""
    n = 4
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    cells = np.stack([np.stack([causal.numpy(), (causal & (torch.arange(n) < 2)).numpy()])] * 2)  # (2, 2, 4, 4)
    monkeypatch.setattr(heads, "keep", lambda c: c.cells)

    def found(api, details):
        call = _Call(cells)
        call.api, call.details = api, details
        return heads.per_head(Run([call], [], []))

    assert len(found("sdpa", {})) == 1
    assert len(found("softmax", {"stated_heads": 2})) == 1
    assert len(found("softmax", {"axes": [0, 2, 1, 3]})) == 1
    assert found("softmax", {"stated_heads": 4}) == []
    assert found("softmax", {}) == []


def test_scores_that_hide_cells_of_their_own_say_nothing_of_padding(monkeypatch):
    """A softmax read through an additive mask whose scores lie 1e4 and more apart (trace/finitefill.py's scores_hide):
    a key no query of one head weighs is that head's scores, not a mask, so the same cells that are found on a call
    whose mask is a mask are quiet there (transformers#17306's fix, blind-ce: finfo.min over outlier scores)."""
    n = 4
    full = np.ones((n, n), dtype=bool)
    odd = full.copy()
    odd[:, 2] = False  # head 1 of row 0 weighs key 2 from no query
    cells = np.stack([np.stack([full, odd]), np.stack([full, full])])
    (_, finding), = _found(cells, monkeypatch)
    assert finding.code == "padding-per-head" and finding.cell == (0, 2, 2)
    call = _Call(cells)
    call.details = {"additive": True, "scores_hide": 1.6e5}
    monkeypatch.setattr(heads, "keep", lambda c: c.cells)
    assert heads.per_head(Run([call], [], [])) == []


def test_one_mask_row_over_more_keys_than_unplaced_queries_places_no_query_among_them(monkeypatch):
    """A mask of one row for every query (mask_rows 1) over more keys than queries, where nothing the run states places
    the queries: no key is known to be its query's own, so the keys heads hide differently say nothing of padding
    (kvpress's AdaKV: each head prunes its own keys and the question's queries attend the pruned cache). The same cells
    with the queries placed at the last keys (maskcli's `model`, details["queries"]) are found, at the first (row, key)
    a loop over rows, heads and the placed queries' keys finds hidden by one head and shown by another."""
    rows, heads_, q_len, k_len = 2, 3, 2, 6
    hidden = {(0, 1): [4, 5], (1, 2): [1, 5]}  # (row, head) -> the keys that head pruned
    cells = np.ones((rows, heads_, q_len, k_len), dtype=bool)
    for (b, h), keys in hidden.items():
        cells[b, h, :, keys] = False
    monkeypatch.setattr(heads, "keep", lambda c: c.cells)

    def found(details):
        call = _Call(cells)
        call.details = details
        return heads.per_head(Run([call], [], []))

    assert found({"mask_rows": 1}) == []
    (_, hit), = found({"mask_rows": 1, "queries": (k_len - q_len, k_len)})
    own = range(k_len - q_len, k_len)
    odd = next((b, k) for b in range(rows) for k in own for h in range(heads_)
               if not cells[b, h, :, k].any() and cells[b, :, :, k].any())
    assert hit.code == "padding-per-head" and hit.cell == (odd[0], odd[1], odd[1])
    assert len(found({})) == 1  # (rows of their own: the mask places its queries as it is read today)


def test_per_head_pruned_prefix_and_global_column_attention_are_quiet(tmp_path):
    """Two correct programs the rule called padding-per-head before (tests/data/quiet): AdaKV's budget over KeyDiff
    scores, a question chunk attending the pruned prefix by a per-head keep mask and merged with its own keys by the
    log-sum-exp (the queries are no keys of that call); AlphaFold 2's GlobalAttention over a padded MSA, one mean query
    per head and residue column, laid (protein, column, head, sequence) by its einsums."""
    for name in ("adakv_keydiff_cascade_prefix_keep_mask_merged_lse", "alphafold2_global_column_attention_einsum_padded_msa"):
        status, found, report = traced(tmp_path, name, False, QUIET)
        assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_physiopro_contiformer_nan_mask_laid_on_the_heads_is_flagged_and_its_fix_is_not(tmp_path):
    # microsoft/PhysioPro#11 (8fa0161; written blind, blind-kg, round 61; caught before tuning): the per-timestep NaN
    # mask (B, T) of the unpacked series handed to attention as (1, B, 1, T): with batch == heads, series b's gaps mask
    # head b of every series, at the old timesteps, and the packed rows' padding is never masked
    check_bug(tmp_path, "physiopro_contiformer_merged_series_nan_mask_on_wrong_axis", "padding-per-head")


def test_rectools_sasrec_padding_mask_tiled_head_first_over_the_causal_one(tmp_path):
    """MTSWebServices/RecTools#197 (written blind, batch blind-lz; caught before any rule was changed for it): SASRec's
    `encode_sessions` overwrote its causal mask with the left padding tiled `.repeat(n_heads, L, 1)`, head-first where
    nn.MultiheadAttention reads the (B * heads) masks batch-first: one user's heads got another user's padding. The fix
    keeps the two masks apart and merges them batch-first."""
    found = check_bug(tmp_path, "rectools_sasrec_causal_mask_replaced_by_padding_mask", "padding-per-head")
    assert "head 1 hides keys 0-3 from every query" in " ".join(found[0]["message"].split())
