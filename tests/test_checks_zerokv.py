"""checks/zerokv.py (and trace/zerokv.py, which records what it reads): real queries that see a run of keys at an edge
of the keys whose K and V are exactly zero, an unwritten buffer row or zero padding."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from checkbugs import check_bug, first, traced
from maskcli import tracefile
from maskcli.checks.context import Run
from maskcli.checks.zerokv import zero_keys_seen
from maskcli.trace.zerokv import zero_kv

ZEROKV = Path(__file__).parent / "data" / "zerokv"


def _runs(zero: list[bool]) -> tuple[int, int]:
    """(zero keys at the start, at the end) of one row, by a plain loop."""
    left = 0
    while left < len(zero) and zero[left]:
        left += 1
    right = 0
    while right < len(zero) and zero[len(zero) - 1 - right]:
        right += 1
    return left, right


def test_the_trace_records_each_rows_edge_runs_of_keys_zero_in_k_and_v():
    torch.manual_seed(0)
    k, v, q = torch.randn(3, 2, 7, 4), torch.randn(3, 2, 7, 4), torch.randn(3, 2, 7, 4)
    k[0, :, 5:], v[0, :, 5:] = 0, 0  # row 0: two zero keys at the end
    k[1, :, :3], v[1, :, :3] = 0, 0  # row 1: three at the start, and its first two queries zero
    q[1, :, :2] = 0
    k[2, 0, 6], v[2, :, 6] = 0, 0  # row 2: K zero in one head only: a token
    v[0, 1, 4] = 0  # row 0's key 4: V zero in one head, K not: a token
    table = zero_kv(q, k, v, tuple(k.shape))["zero_kv"]
    for b in range(3):
        zero = [bool((k[b, :, j] == 0).all() and (v[b, :, j] == 0).all()) for j in range(7)]
        assert (table["left"][b], table["right"][b]) == _runs(zero)
    assert table["zero_q"] == [[], [[0, 2]], []]
    assert zero_kv(q, torch.randn(3, 2, 7, 4), v, (3, 2, 7, 4)) == {}  # no edge key zero: nothing read further
    one = torch.randn(3, 2, 7, 4)
    one[:, :, 0] = 0
    assert zero_kv(q, one, one.clone(), tuple(one.shape)) == {}  # one zero key alone (a null key) is no padding's run


def test_the_edge_keys_read_cell_by_cell_agree_with_each_cells_value_in_every_layout_and_dtype():
    from maskcli.trace.zerokv import EDGES, _edges_nonzero

    torch.manual_seed(1)
    for trial in range(240):
        dtype = (torch.float32, torch.float64, torch.float16)[trial % 3]
        b, h, length, e = 1 + trial % 3, 1 + trial % 4, 3 + trial % 5, 2 + trial % 3
        if trial % 2:  # (a transposed view, or one at a storage offset)
            k = torch.randn(b, length, h, e, dtype=dtype).transpose(1, 2)
        else:
            k = torch.randn(b, h, length + 1, e, dtype=dtype)[:, :, 1:]
        k[..., 0][torch.rand(b, h, length) < 0.15] = -0.0 if trial % 4 == 1 else 0.0  # (the sign bit set: still zero)
        if trial % 5 == 0:
            k = k[0]  # (H, Lk, E): one batch row
        heads = k.shape[:-2]
        expected = all(float(k[(*index, at, 0)]) != 0 for index in np.ndindex(*heads) for at in (0, k.shape[-2] - 1))
        assert _edges_nonzero(k, tuple(k.shape)) is expected, (trial, tuple(k.shape))
        v = torch.randn(k.shape, dtype=dtype)
        runs = zero_kv(k, k, v, tuple(k.shape))
        assert (runs == {}) or not expected  # (nonzero edges: nothing read further)
    wide = torch.randn(EDGES, 1, 5, 2)  # more edge cells than EDGES: not read here (numpy's count reads them)
    assert _edges_nonzero(wide, tuple(wide.shape)) is False
    assert zero_kv(wide, wide, wide, tuple(wide.shape)) == {}
    broadcast = torch.randn(1, 2, 5, 3).expand(3, 2, 5, 3)  # (stride 0 over the batch)
    assert _edges_nonzero(broadcast, tuple(broadcast.shape)) is True


def test_a_key_of_other_than_three_or_four_dimensions_is_never_read_by_address():
    """A 5-D K (windows as a batch dim: snac's local attention) or a 2-D one: its addresses are not a 3-D or 4-D K's,
    so the edges are not read cell by cell (a read past the storage crashed the process: CI, exit 139)."""
    from maskcli.trace.keyreads import key_reads
    from maskcli.trace.zerokv import _edges_nonzero

    five = torch.randn(2, 3, 4, 1, 8)  # (B, H, W, N, D): N = 1 key a window, heads fewer than positions*stride
    assert _edges_nonzero(five, tuple(five.shape)) is False
    assert _edges_nonzero(five[0, 0, 0], tuple(five[0, 0, 0].shape)) is False
    assert _edges_nonzero(five[0], (2, 3, 4, 1, 8)) is False  # (a shape that is not the tensor's own: not read)
    assert "zero_kv" not in key_reads(five, five, five, tuple(five.shape))


def test_masked_zero_edges_read_cell_by_cell_give_what_reading_every_edge_gives(monkeypatch):
    import maskcli.trace.zerokv as zerokv

    torch.manual_seed(2)
    cases = []
    for trial in range(160):
        b, h, length = 1 + trial % 3, 1 + trial % 2, 4 + trial % 5
        k, v = torch.randn(b, h, length, 3), torch.randn(b, h, length, 3)
        pad = torch.randint(0, length - 1, (b,))
        for row in range(b):  # left padding whose keys are zero (a padding_idx row under bias-free projections)
            k[row, :, :pad[row]], v[row, :, :pad[row]] = 0, 0
        if trial % 3 == 0:
            k[0, :, -1], v[0, :, -1] = 0, 0  # (a zero key the mask keeps, at the end)
        keep = torch.ones(b, 1, 1, length, dtype=torch.bool)
        for row in range(b):
            keep[row, ..., :pad[row] if trial % 4 else 0] = False  # (every fourth: the padding not masked)
        cases.append((k, v, keep))
    fast = [zerokv.zero_kv(k, k, v, tuple(k.shape), keep) for k, v, keep in cases]
    monkeypatch.setattr(zerokv, "_kept_edges_nonzero", lambda *a: False)
    zerokv._VISIBLE.clear()
    assert fast == [zerokv.zero_kv(k, k, v, tuple(k.shape), keep) for k, v, keep in cases]
    assert any(fast) and not all(fast)


def test_the_runs_are_read_from_the_edges_of_the_keys_the_mask_keeps():
    """A static cache's unwritten tail hidden by the mask is no run (its last kept key holds something); a run at the
    start of the keys is read from the first key the mask keeps, its bounds recorded, and the rule finds it where a
    real query sees it; zero keys kept after hidden keys that hold something are no run at an edge."""
    torch.manual_seed(0)
    k, v, q = torch.zeros(2, 2, 40, 4), torch.zeros(2, 2, 40, 4), torch.randn(2, 2, 3, 4)
    k[:, :, :10], v[:, :, :10] = torch.randn(2, 2, 10, 4), torch.randn(2, 2, 10, 4)  # 10 slots written, 30 not
    k[1, :, :5], v[1, :, :5] = 0, 0  # row 1: slots 0-4 zero, kept from slot 2 on
    mask = torch.zeros(2, 1, 3, 40, dtype=torch.bool)
    mask[0, :, :, :10] = True  # row 0: the written slots
    mask[1, :, :, 2:10] = True  # row 1: from slot 2
    table = zero_kv(q, k, v, tuple(k.shape), mask)["zero_kv"]
    assert table["keys"] == [[0, 10], [2, 10]] and table["right"] == [0, 0]
    for b in range(2):  # by a plain loop: the run at the start of the keys, over the kept ones
        lo, hi = table["keys"][b]
        start = _runs([bool((k[b, :, j] == 0).all() and (v[b, :, j] == 0).all()) for j in range(40)])[0]
        kept = min(start, hi) - lo if start > lo else 0
        assert table["left"][b] == (kept if kept >= 2 else 0)
    assert zero_kv(q, k, v, tuple(k.shape), torch.where(mask, 0.0, float("-inf")))["zero_kv"] == table  # additive alike
    with torch.inference_mode():  # (a mask made there keeps no version counter: read each time, never cached)
        assert zero_kv(q, k, v, tuple(k.shape), mask.clone())["zero_kv"] == table
    assert zero_kv(q, k, v, tuple(k.shape))["zero_kv"]["right"] == [30, 30]  # no mask: the unwritten tail is a run
    [(_, found)] = zero_keys_seen(Run([_call(mask.numpy(), table)]))
    assert found.cell == (1, 0, 2) and "keys 2-4" in found.message
    k[1, :, 0], v[1, :, 0] = 1.0, 1.0  # slot 0 holds something: slots 2-4 lie between keys, no padding's shape
    assert zero_kv(q, k, v, tuple(k.shape), mask) == {"unwritten": 30}  # (only the buffer's 30 unwritten slots)


def _call(keep: np.ndarray, table: dict) -> SimpleNamespace:
    stored = tracefile.from_dense(keep, keep.shape)
    return SimpleNamespace(api="sdpa", shape=keep.shape, details={"zero_kv": table}, stored=stored, where="layer",
                           index=0, step="prefill")


def test_only_real_queries_seeing_an_edge_run_are_found():
    causal = np.tril(np.ones((6, 6), dtype=bool))[None, None].repeat(2, axis=0)
    right = {"left": [0, 0], "right": [0, 3], "zero_q": [[], [[3, 6]]]}  # row 1 right-padded, its pad queries zero
    assert zero_keys_seen(Run([_call(causal, right)])) == []  # causal: only its pad queries see the padding
    full = np.ones((2, 1, 6, 6), dtype=bool)
    [(_, found)] = zero_keys_seen(Run([_call(full, right)]))
    assert found.code == "zero-keys-seen" and found.cell == first((2, 6, 6), lambda b, q, k: b == 1 and k >= 3)
    left = {"left": [2, 0], "right": [0, 0], "zero_q": [[[0, 2]], []]}  # row 0 left-padded, is_causal
    [(_, found)] = zero_keys_seen(Run([_call(causal, left)]))
    assert found.cell == first((2, 6, 6), lambda b, q, k: b == 0 and q >= 2 and k < 2 and k <= q)
    hidden = causal.copy()
    hidden[0, :, :, :2] = False
    assert zero_keys_seen(Run([_call(hidden, left)])) == []  # the padding hidden: the fix
    every = {"left": [6, 0], "right": [6, 0], "zero_q": [[], []]}
    assert zero_keys_seen(Run([_call(full, every)])) == []  # every key zero: no padding's shape


def test_whisper_cpp_flash_attn_padded_kv_rows_unmasked(tmp_path):
    """ggml-org/whisper.cpp#3941: the encoder's and the cross-attention's K/V are buffers of GGML_PAD(n_ctx, 256) rows,
    only n_ctx written, and flash attention gets no mask (written blind, batch blind-q)."""
    found = check_bug(tmp_path, "whisper_cpp_flash_attn_padded_kv_rows_unmasked", "zero-keys-seen")
    assert tuple(found[0]["cell"]) == (0, 0, 40) and "keys 40-255" in found[0]["message"]


def test_llava_prepare_multimodal_drops_padded_attention_mask(tmp_path):
    """haotian-liu/LLaVA#1720: the spliced image+text embeddings re-padded on the left with zeros, the rebuilt mask
    dropped, so the decoder's is_causal queries see the padding (written blind, batch blind-q)."""
    found = check_bug(tmp_path, "llava_prepare_multimodal_drops_padded_attention_mask", "zero-keys-seen")
    pads = (0, 3)  # images of 6 and 3 feature tokens: 12 and 9 positions, the second left-padded by 3
    assert tuple(found[0]["cell"]) == first((2, 12, 12), lambda b, q, k: q >= pads[b] and k < pads[b] and k <= q)


def test_poprox_nrms_user_encoder_click_history_padding_unmasked(tmp_path):
    """CCRI-POPROX/poprox-recommender#177 (commit 6b83e63, written blind, batch blind-ei): NRMS's click history is
    left-padded with "PADDED_NEWS" zero vectors and run through nn.MultiheadAttention with no key_padding_mask; its
    in_proj_bias is zero, so those keys' K and V are zero (trace/mhazero.py). The fix's key_padding_mask is quiet.
    Against nn.MultiheadAttention itself: a zero input row projects to a zero key and value."""
    found = check_bug(tmp_path, "poprox_recommender_nrms_user_encoder_click_history_padding_unmasked", "zero-keys-seen")
    pads = (0, 5, 9)  # histories of 12, 7 and 3 clicks in 12 slots
    assert tuple(found[0]["cell"]) == first((3, 12, 12), lambda b, q, k: q >= pads[b] and k < pads[b])
    mha = torch.nn.MultiheadAttention(8, 2)
    w, bias = mha.in_proj_weight.detach(), mha.in_proj_bias.detach()
    assert (torch.nn.functional.linear(torch.zeros(3, 8), w, bias)[:, 8:] == 0).all()


def test_a_sequence_first_mha_over_right_padded_sessions_without_a_key_padding_mask(tmp_path):
    """Written another way: sequence-first nn.MultiheadAttention over right-padded sessions embedded with
    padding_idx=0, no key_padding_mask, pooled over the real items; the fix hands `key_padding_mask=(ids == 0)`."""
    found = check_bug(tmp_path, "session_mha_seq_first_right_padded_no_key_padding_mask", "zero-keys-seen", ZEROKV)
    lengths = (9, 5, 3, 6)
    assert tuple(found[0]["cell"]) == first((4, 9, 9), lambda b, q, k: q < lengths[b] and k >= lengths[b])


def test_zero_keys_a_rule_names_the_cause_of_are_said_once_by_it(tmp_path):
    """A rotary encoder, `padding_idx=0` and bias-free projections, right-padded, no mask: its input ids say the
    padding (padding-ignored), and the zero keys are not said again; its fix is quiet."""
    found = check_bug(tmp_path, "encoder_right_padded_zero_embeddings_no_mask", "padding-ignored", folder=ZEROKV)
    assert tuple(found[0]["cell"]) == first((3, 6, 6), lambda b, q, k: k >= (6, 3, 4)[b] and q < (6, 3, 4)[b])
    _, every, _ = traced(tmp_path, "encoder_right_padded_zero_embeddings_no_mask", False, ZEROKV)
    assert "zero-keys-seen" not in {f["code"] for f in every}


def test_a_preallocated_cache_attended_over_its_unwritten_slots(tmp_path):
    """Written another way: a batched decode over a zero-filled cache of 12 slots, every slot attended."""
    found = check_bug(tmp_path, "static_cache_decode_attends_unwritten_slots", "zero-keys-seen", folder=ZEROKV)
    assert tuple(found[0]["cell"]) == (0, 0, 4)


def test_a_zero_null_key_and_a_finished_rows_pad_queries_are_quiet(tmp_path):
    """A learned null key initialised to zero (one key alone) and a finished row fed pad tokens (zero queries)."""
    status, found, report = traced(tmp_path, "null_key_and_finished_rows", False, ZEROKV)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_flex_decode_whose_mask_mod_keeps_the_unwritten_slots(tmp_path):
    """Another kernel: FlexAttention over a zero-filled cache of 16 slots, a mask_mod that keeps every key; its fix
    keeps each query to the slots at or before its own. Traced in its own process (dynamo's guards on __main__)."""
    import json
    import subprocess
    import sys

    program = ZEROKV / "flex_cache_decode_mask_mod_unbounded.py"
    for fixed in (False, True):
        out = tmp_path / f"flex{int(fixed)}.json"
        done = subprocess.run([sys.executable, "-m", "maskcli", "trace", "--json", str(out), str(program),
                               *(["--fixed"] if fixed else [])], capture_output=True, text=True, timeout=600)
        data = json.loads(out.read_text())
        found = [f for g in data["groups"] for f in g["findings"] if f["severity"] == "wrong"]
        assert data["exit_status"] == 0, done.stderr
        if fixed:
            assert (done.returncode, found) == (0, []), done.stdout
        else:
            assert done.returncode == 1, done.stdout
            hit = next(f for f in found if f["code"] == "zero-keys-seen")
            assert tuple(hit["cell"]) == first((2, 5, 16), lambda b, q, k: k >= 5)


def test_zero_image_features_the_model_call_states_real_are_quiet(tmp_path):
    """A blank image's features under a bias-free projector: the image tokens' K and V are zero at the start of a row,
    but the model call's attention_mask states them real tokens, and the program's word is taken over the values'
    (Gemma 3's tiny vision-language model under generate, in benchmarks/false_alarms_modes.py, is this)."""
    status, found, report = traced(tmp_path, "zero_image_features_stated_real", False, ZEROKV)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_padding_query_rows_opened_on_every_slot_are_not_judged(tmp_path):
    """A static cache over a left-padded batch, handed only each row's padding count (`--offsets`: the model call
    states no padding): the short row's padding queries, whose empty rows are opened on every slot (transformers'
    no-NaN rows), see the unwritten slots' zero K and V. They are padding (checks/real.py reads them off the mask), not
    real queries: no zero-keys-seen (said before, on tt-xla#2953's reproduction too)."""
    status, found, report = traced(tmp_path, "static_cache_left_padded_unmasked_pad_rows", False,
                                   Path(__file__).parent / "data" / "quiet", ("--offsets",))
    assert [f for f in found if f["code"] == "zero-keys-seen"] == [], report
    assert status == 0, report


def test_veloxquant_nestedkv_ragged_head_budgets_zero_padded_keys_attended(tmp_path):
    """rajveer43/VeloxQuant-MLX#364 (written blind, blind-ap): each head keeps its own number of keys, the shorter
    heads zero-padded at the front to the longest, and the decode step attends with no mask. No key is zero in every
    head: the run is one head's own, found where that head's real query sees it (kept 5, 7, 4, 6: head 0's keys 0-1
    first)."""
    hits = check_bug(tmp_path, "veloxquant_nestedkv_ragged_head_budgets_zero_padded_keys_attended", "zero-keys-seen")
    assert hits[0]["cell"] == [0, 0, 0] and "in head 0, one of keys 0-1" in hits[0]["message"]


def test_one_heads_zero_padding_in_a_padded_batch_under_a_rows_only_mask(tmp_path):
    """The same bug written another way (tests/data/zerokv/): per-head budgets in a batch of two, a (B, 1, 1, L) bool
    mask of the batch's rows handed to SDPA. The first (row, head) whose zero slots a real query sees, by a loop over
    the budgets; the fix's per-head mask is quiet."""
    budgets = [[6, 4, 6, 3], [5, 6, 2, 6]]
    longest = max(max(row) for row in budgets)
    pads = [(b, h, longest - n) for b in range(2) for h, n in enumerate(budgets[b]) if longest - n >= 2]
    b, h, n = pads[0]
    hits = check_bug(tmp_path, "adakv_head_budgets_zero_padded_no_head_mask", "zero-keys-seen", ZEROKV)
    assert hits[0]["cell"] == [b, 0, 0] and f"in head {h}, one of keys 0-{n - 1} " in hits[0]["message"]


def test_a_head_whose_every_key_is_zero_or_one_zero_key_alone_is_no_head_padding():
    """A head zero everywhere (a pruned head) holds no real key to pad beside; one zero key alone is a null key: the
    trace records no head's run for either."""
    torch.manual_seed(1)
    k, v, q = torch.randn(1, 3, 6, 4), torch.randn(1, 3, 6, 4), torch.randn(1, 3, 1, 4)
    k[0, 0], v[0, 0] = 0, 0  # head 0: every key zero
    k[0, 1, 5], v[0, 1, 5] = 0, 0  # head 1: key 5 alone
    assert zero_kv(q, k, v, tuple(k.shape)) == {}
    k[0, 2, :2], v[0, 2, :2] = 0, 0  # head 2: keys 0-1, the other heads' real: one head's padding
    assert zero_kv(q, k, v, tuple(k.shape))["zero_kv"]["heads"] == [[[2, 2, 0]]]


def test_a_static_buffers_unwritten_slots_are_recorded_and_place_the_queries_before_them():
    """A zero-filled buffer of 16 slots, 10 written (eole's `k_cache[:, :, cache_slice] = k`): the trace records the 6
    unwritten slots at its end (counted by a loop over the slots), and the 10 queries sit at the written slots 0..9, not
    at the end of the buffer; a buffer every slot of which is written records nothing (a dynamic cache)."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 10, 4)
    k, v = torch.zeros(1, 2, 16, 4), torch.zeros(1, 2, 16, 4)
    k[:, :, :10], v[:, :, :10] = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
    unwritten = 0
    for slot in reversed(range(16)):
        if k[:, :, slot].any() or v[:, :, slot].any():
            break
        unwritten += 1
    details = zero_kv(q, k, v, tuple(k.shape))
    assert details["unwritten"] == unwritten == 6
    from maskcli.checks.context import queries

    call = SimpleNamespace(shape=(1, 2, 10, 16), details=details)
    assert queries(call, None).tolist() == list(range(16 - unwritten - 10, 16 - unwritten)) == list(range(10))
    full = torch.randn(1, 2, 16, 4)
    assert "unwritten" not in zero_kv(q, full, full, tuple(full.shape))


def _fill_runs(k: torch.Tensor, v: torch.Tensor, b: int) -> tuple[int, int]:
    """(keys at the start, at the end) of batch row b whose K and V are each the edge key's one value, by plain loops
    over every head and dimension (0: the edge key is not one nonzero value in K and in V)."""
    length = k.shape[2]

    def one(t, j):
        values = {float(x) for x in t[b, :, j].flatten()}
        return next(iter(values)) if len(values) == 1 and values != {0.0} else None

    runs = []
    for order in (range(length), range(length - 1, -1, -1)):
        order = list(order)
        fill = (one(k, order[0]), one(v, order[0]))
        run = 0
        while None not in fill and run < length and (one(k, order[run]), one(v, order[run])) == fill:
            run += 1
        runs.append(run if run >= 2 else 0)
    return tuple(runs)


def test_the_trace_reads_edge_runs_of_one_nonzero_fill_as_unwritten_buffer_rows():
    """trace/fillkv.py: a buffer made by torch.full / torch.ones leaves the slots nobody wrote one value in every head
    and dimension; an edge run of them is recorded as zerokv's is, with its fill."""
    from maskcli.trace.fillkv import edge_kv

    torch.manual_seed(0)
    q = torch.randn(2, 2, 3, 4)
    k, v = torch.randn(2, 2, 9, 4), torch.randn(2, 2, 9, 4)
    k[:, :, :4], v[:, :, :4] = 7.0, -3.0  # every row: four slots of the fill at the start
    k[:, :, 7:], v[:, :, 7:] = 1.0, 1.0  # and two of another at the end
    found = edge_kv(q, k, v, tuple(k.shape))
    table = found["zero_kv"]
    for b in range(2):
        assert (table["left"][b], table["right"][b]) == _fill_runs(k, v, b)
    assert table["fill"] == {"left": [7.0, -3.0], "right": [1.0, 1.0]} and found["unwritten"] == 2
    assert edge_kv(q, torch.randn(2, 2, 9, 4), v, (2, 2, 9, 4)) == {}  # nothing of one value at an edge
    one = torch.randn(2, 2, 9, 4)
    one[:, :, 0] = 5.0
    assert "zero_kv" not in edge_kv(q, one, one.clone(), (2, 2, 9, 4))  # one key alone: a learned null key's shape
    varied = k.clone()
    varied[:, :, :4, 0] = 6.0  # K's edge keys not one value throughout: tokens
    assert edge_kv(q, varied, v, (2, 2, 9, 4))["zero_kv"]["left"] == [0, 0]


def test_vllm_dflash_draft_attends_unwritten_prefix_cache_context(tmp_path):
    """vllm-project/vllm#47926: on a prefix-cache hit the DFlash drafter's block attends every context-KV slot, the
    16 restored ones never written (the buffer's torch.full 7.0 / -3.0); its fix masks them (written blind, blind-cf)."""
    found = check_bug(tmp_path, "vllm_dflash_draft_attends_unwritten_prefix_cache_context", "zero-keys-seen")
    assert tuple(found[0]["cell"]) == (0, 0, 0) and "keys 0-15" in found[0]["message"]
    assert "K 7, V -3" in found[0]["message"]


def test_a_ones_filled_cache_attended_whole_in_a_batched_decode(tmp_path):
    """Written another way: a (B, H, S, D) cache made by torch.ones, a boolean mask built over the whole buffer at
    every step of a batched generation loop; its fix keeps only the written slots."""
    found = check_bug(tmp_path, "ones_filled_kv_cache_batched_decode_whole_buffer", "zero-keys-seen", folder=ZEROKV)
    assert tuple(found[0]["cell"]) == (0, 0, 5) and "keys 5-15" in found[0]["message"]


def test_jasmine_flash_attention_pad_to_four_mask_masks_nothing(tmp_path):
    # p-doom/jasmine commit 3ec820d (merged via PR #141): `_create_flash_attention_fn` pads T / S to a multiple of 4 and
    # builds its mask `.at[Q:, :]` / `.at[:, K:]` from the padded lengths, which masks nothing (written blind, blind-eh)
    found = check_bug(tmp_path, "jasmine_sttransformer_flash_attn_pad_mask_noop", "zero-keys-seen")
    patches, padded = 6, 8  # the spatial attention: 6 patches padded to 8, non-causal: every real query sees 6-7
    assert tuple(found[0]["cell"]) == first((10, 8, 8), lambda b, q, k: q < patches and patches <= k < padded)
    assert "keys 6-7" in found[0]["message"]


def test_latent_cross_attention_block_padded_keys_under_a_mask_filled_from_the_padded_length(tmp_path):
    """The same bug written another way: latents cross-attend to 13 keys padded with torch.cat of zeros to 16, an
    additive float mask filled from the padded length (an empty slice); its fix fills it from the real length."""
    found = check_bug(tmp_path, "latent_cross_attention_block_padded_keys_mask_from_padded_length", "zero-keys-seen",
                      ZEROKV)
    keys, padded = 13, 16
    assert tuple(found[0]["cell"]) == first((3, 6, 16), lambda b, q, k: keys <= k < padded)
    assert f"keys {keys}-{padded - 1}" in found[0]["message"]


def test_gpt_sovits_static_kv_bucket_attends_its_unwritten_zero_slots(tmp_path):
    """Code-Amadeus/Amadeus#22 (written blind, blind-rp, caught before any rule changed for it): GPT-SoVITS's text-to-
    semantic decoder copies its prefill into a 256-slot static cache of zeros and runs each decode step over every
    slot with no mask, so the unwritten slots' zero keys take weight. The fix attends the `current_len + 1` slots
    written."""
    [hit] = check_bug(tmp_path, "gpt_sovits_amadeus_static_kv_bucket_zero_slots_attended", "zero-keys-seen")
    assert "one of keys 24-255 whose K and V are exactly zero in every head" in hit["message"], hit
