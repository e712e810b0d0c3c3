"""The core of `maskcli pack`: fields read, boundaries per field, each path's mask against a double loop over
documents written here, and the findings, on batches written out for each known failure."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maskcli.errors import MaskError
from maskcli.pack.fields import read
from maskcli.pack.findings import check
from maskcli.pack.paths import Model

NO_CACHE = Model(False, "use_cache=False, as transformers' Trainer runs the model")


def expected(docs, real, causal=True):
    """Double loop: (B, L, L) keep cells where query and key share a document, the key is real, and kv <= q."""
    docs, real = np.atleast_2d(docs), np.atleast_2d(real)
    rows, length = docs.shape
    out = np.zeros((rows, length, length), dtype=bool)
    for b in range(rows):
        for q in range(length):
            for k in range(length):
                out[b, q, k] = bool(real[b, k]) and docs[b, q] == docs[b, k] and (k <= q or not causal)
    return out


def cells(report, name):
    path = next(c.path for c in report.checks if c.path.name == name)
    return path.mask.dense()[:, 0] if path.applies else None


def same_on_real_rows(got, want, real):
    real = np.atleast_2d(np.asarray(real, dtype=bool))
    for b in range(want.shape[0]):
        assert np.array_equal(got[min(b, got.shape[0] - 1)][real[b]], want[b][real[b]]), b


def run(eos=None, reference=None, model=NO_CACHE, **given):
    """The check on fields given as option text; the model runs without a cache unless `model` says (see test_use_cache_*)."""
    return check(read(None, {k: str(v) for k, v in given.items()}, []), eos, reference, model)


def codes(report):
    return [f.code for f in report.findings]


def leak_count(mask_cells, docs, real):
    """Cells a path allows between a real query and a real key of another document (double loop)."""
    docs, real = np.atleast_2d(docs), np.atleast_2d(real)
    count = 0
    for b in range(docs.shape[0]):
        for q in range(docs.shape[1]):
            for k in range(docs.shape[1]):
                count += bool(mask_cells[b, q, k] and real[b, q] and real[b, k] and docs[b, q] != docs[b, k])
    return count


def test_position_ids_only_every_hf_path_reads_them():
    report = run(position_ids="0,1,2,0,1")
    docs, real = [0, 0, 0, 1, 1], [1] * 5
    for name in ("hf-sdpa", "hf-flash"):
        same_on_real_rows(cells(report, name), expected(docs, real), real)
    assert cells(report, "varlen") is None and report.paths_agree and report.ok


def test_cu_seqlens_only_no_hf_path_reads_them():
    report = run(cu_seqlens="0,3,5")
    docs, real = [0, 0, 0, 1, 1], [1] * 5
    same_on_real_rows(cells(report, "varlen"), expected(docs, real), real)
    causal = expected([0] * 5, real)
    for name in ("hf-sdpa", "hf-flash"):
        same_on_real_rows(cells(report, name), causal, real)
    assert not report.paths_agree and not report.ok
    crossing = {c.path.name: c.cross_cells for c in report.checks}
    assert crossing["hf-sdpa"] == crossing["hf-flash"] == leak_count(causal, docs, real) == 6
    assert any("cu_seqlens is not read" in note for note in report.notes)


def test_both_agreeing():
    report = run(position_ids="0,1,2,0,1,0", cu_seqlens="0,3,5,6")
    assert report.paths_agree and report.ok and not report.disagreements
    same_on_real_rows(cells(report, "varlen"), expected([0, 0, 0, 1, 1, 2], [1] * 6), [1] * 6)


def test_both_disagreeing_names_the_position_and_rope_running_on():
    report = run(position_ids="0,1,2,3,4,0", cu_seqlens="0,3,5,6")
    assert [(d.field, d.reference, d.count, d.first) for d in report.disagreements] == [("position_ids", "cu_seqlens", 1, [(0, 3, True)])]
    assert "rope-continues" in codes(report) and "fields-disagree" in codes(report)
    same_on_real_rows(cells(report, "hf-sdpa"), expected([0, 0, 0, 0, 0, 1], [1] * 6), [1] * 6)
    assert not report.ok


def test_attention_mask_with_padding_beside_packed_position_ids_contaminates_both_hf_paths():
    report = run(position_ids="0,1,2,0,1,0", attention_mask="1,1,1,1,1,0")
    real = [1, 1, 1, 1, 1, 0]
    causal = expected([0] * 6, real)
    for name in ("hf-sdpa", "hf-flash"):
        same_on_real_rows(cells(report, name), causal, real)
    assert report.paths_agree and not report.ok  # they agree with each other, and both leak
    assert [c.cross_cells for c in report.checks[:2]] == [6, 6] == [leak_count(causal, [0, 0, 0, 1, 1, 2], real)] * 2
    assert any("flash_attention_2 unpads" in note for note in report.notes)


def test_an_all_ones_attention_mask_is_dropped_by_flash_attention_2_not_by_sdpa():
    report = run(position_ids="0,1,2,0,1", attention_mask="1,1,1,1,1")
    same_on_real_rows(cells(report, "hf-sdpa"), expected([0] * 5, [1] * 5), [1] * 5)
    same_on_real_rows(cells(report, "hf-flash"), expected([0, 0, 0, 1, 1], [1] * 5), [1] * 5)
    assert not report.paths_agree
    assert any("drops it for flash_attention_2" in note for note in report.notes)


def test_flash_attention_kwargs_under_another_spelling_are_not_read_by_transformers():
    cu = np.array([0, 3, 5])
    raw = {"position_ids": np.arange(5)[None], "cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": np.array(3), "max_seqlen_k": np.array(3)}
    report = check(read_dict(raw))
    same_on_real_rows(cells(report, "hf-flash"), expected([0] * 5, [1] * 5), [1] * 5)
    same_on_real_rows(cells(report, "varlen"), expected([0, 0, 0, 1, 1], [1] * 5), [1] * 5)
    assert any("cu_seqlens_q is not read: transformers takes it only as cu_seq_lens_q" in note for note in report.notes)
    maps = ["cu_seq_lens_q=cu_seqlens_q", "cu_seq_lens_k=cu_seqlens_k", "max_length_q=max_seqlen_q", "max_length_k=max_seqlen_k"]
    said = check(read_dict(raw, maps))  # --field says the model gets them under HF's names
    same_on_real_rows(cells(said, "hf-flash"), expected([0, 0, 0, 1, 1], [1] * 5), [1] * 5)


def read_dict(raw, maps=()):
    """A batch as a file would give it: the keys as written, read under their aliases."""
    import tempfile
    from pathlib import Path

    import torch

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "batch.pt"
        torch.save({k: torch.as_tensor(v) for k, v in raw.items()}, path)
        return read(str(path), {}, list(maps))


def test_mrope_positions_are_not_packing():
    t = [0, 1, 2, 2, 2, 3, 0, 1]  # an image's tokens share a time position, then a second sample restarts
    positions = np.array([[t], [[0, 1, 2, 2, 3, 3, 0, 1]], [[0, 1, 2, 3, 2, 3, 0, 1]]])
    from maskcli.pack.fields import from_arrays

    batch = from_arrays({"position_ids": positions}, {"position_ids": "position_ids"})
    report = check(batch)
    assert batch.mrope is not None and "position_ids" not in batch.fields
    same_on_real_rows(cells(report, "hf-sdpa"), expected([0] * 8, [1] * 8), [1] * 8)
    assert [b.name for b in report.fields] == ["mrope_t"]
    assert report.fields[0].start_positions(0).tolist() == [0, 6]
    assert any("mRoPE" in note for note in report.notes)


def test_mrope_that_never_restarts_gives_no_boundaries():
    from maskcli.pack.fields import from_arrays

    positions = np.array([[[0, 1, 1, 1, 2]], [[0, 1, 1, 2, 2]], [[0, 1, 2, 1, 2]]])
    report = check(from_arrays({"position_ids": positions}, {"position_ids": "position_ids"}))
    assert report.fields == [] and report.reference is None and report.ok


def test_four_row_mrope_reads_the_text_row():
    from maskcli.pack.fields import from_arrays

    text = [0, 1, 2, 0, 1]
    positions = np.array([[text], [text], [text], [text]])
    report = check(from_arrays({"position_ids": positions}, {"position_ids": "position_ids"}), model=NO_CACHE)
    same_on_real_rows(cells(report, "hf-sdpa"), expected([0, 0, 0, 1, 1], [1] * 5), [1] * 5)


def test_eos_keyed_documents_split_chat_turns():
    # two chat samples; each turn ends with EOS (id 2), so the EOS mask splits every turn
    ids = "5,6,2,7,8,2,9,2,3,2"
    report = run(eos=2, input_ids=ids, position_ids="0,1,2,3,4,5,0,1,2,3")
    same_on_real_rows(cells(report, "eos"), expected([0, 0, 0, 1, 1, 1, 2, 2, 3, 3], [1] * 10), [1] * 10)
    same_on_real_rows(cells(report, "hf-sdpa"), expected([0] * 6 + [1] * 4, [1] * 10), [1] * 10)
    assert report.reference.name == "position_ids"
    eos_disagreement = next(d for d in report.disagreements if d.field == "eos")
    assert eos_disagreement.count == 2 and eos_disagreement.first == [(0, 3, False), (0, 8, False)]
    assert not report.paths_agree


def test_padding_between_samples_cu_seqlens_padded():
    # TransformerEngine THD: documents of 3 and 2 tokens, each padded to 4
    report = run(cu_seqlens_padded="0,4,8", cu_seqlens="0,3,5", attention_mask="1,1,1,0,1,1,0,0")
    real = [1, 1, 1, 0, 1, 1, 0, 0]
    docs = [0, 0, 0, 9, 1, 1, 9, 9]
    same_on_real_rows(cells(report, "varlen"), expected(docs, real), real)
    for name in ("hf-sdpa", "hf-flash"):
        same_on_real_rows(cells(report, name), expected([0] * 8, real), real)
    assert report.reference.name == "cu_seqlens_padded"
    assert [c.pad_cells for c in report.checks if c.path.applies] == [0, 0, 0]
    assert any("1 padding token between samples" in note and "2 after" in note for note in report.notes)


def test_padding_a_path_leaves_visible_is_found():
    # cu_seqlens covers the padding as if it were a document's: varlen lets token 4 see pad token 3
    report = run(cu_seqlens="0,3,6", attention_mask="1,1,1,0,1,1")
    varlen = next(c for c in report.checks if c.path.name == "varlen")
    assert varlen.pad_cells == 2 and "sees-padding" in codes(report)


def test_two_rows_flash_reads_position_ids_only_for_one_row():
    report = run(position_ids="0,1,0,1;0,1,2,0")
    docs = np.array([[0, 0, 1, 1], [0, 0, 0, 1]])
    same_on_real_rows(cells(report, "hf-sdpa"), expected(docs, np.ones((2, 4))), np.ones((2, 4)))
    same_on_real_rows(cells(report, "hf-flash"), expected(np.zeros((2, 4)), np.ones((2, 4))), np.ones((2, 4)))
    assert not report.paths_agree
    assert any("only for one batch row" in note for note in report.notes)


def test_cu_seqlens_over_two_rows_split_at_the_row_end():
    report = run(cu_seqlens="0,3,6,8", input_ids="1,2,3,4;5,6,7,8")
    varlen = next(c.path for c in report.checks if c.path.name == "varlen")
    same_on_real_rows(cells(report, "varlen"), expected([[0, 0, 0, 1], [0, 0, 1, 1]], np.ones((2, 4))), np.ones((2, 4)))
    assert any("runs from the end of row 0 into row 1" in note for note in varlen.notes)


def test_labels_not_ignored_at_some_boundaries():
    report = run(position_ids="0,1,2,0,1,0,1", labels="-100,5,6,-100,8,7,9")
    found = next(f for f in report.findings if f.code == "labels-across")
    assert "at 1 of 2 document boundaries but not at 1" in found.message and "row 0 position 5" in found.message


def test_labels_ignored_at_every_boundary_are_fine():
    report = run(position_ids="0,1,2,0,1,0,1", labels="-100,5,6,-100,8,-100,9")
    assert report.ok


def test_labels_never_ignored_at_boundaries_is_a_note():
    report = run(position_ids="0,1,2,0,1", labels="4,5,6,7,8")
    assert report.ok and any("never -100" in note for note in report.notes)


def test_shifted_labels_are_checked_at_each_document_end():
    ids = "10,11,12,20,21,22"
    report = run(position_ids="0,1,2,0,1,2", input_ids=ids, labels="11,12,-100,21,22,-100")
    assert report.ok
    bad = run(position_ids="0,1,2,0,1,2", input_ids=ids, labels="11,12,20,21,22,30")
    assert "labels-across" not in codes(bad)  # never -100 at a boundary: a note, not a finding
    assert any("last token of each document" in note for note in bad.notes)


def test_labels_on_padding():
    report = run(attention_mask="1,1,1,0", labels="-100,2,3,4")
    assert "labels-on-padding" in codes(report)


def test_lengths_that_do_not_add_up_and_max_length():
    report = run(input_ids="1,2,3,4,5,6", cu_seq_lens_q="0,3,5", cu_seq_lens_k="0,3,5", max_length_q="2", max_length_k="3")
    assert "lengths-sum" in codes(report) and "max-length" in codes(report)
    assert "q-k-differ" in codes(run(cu_seq_lens_q="0,3,5", cu_seq_lens_k="0,2,5"))


def test_hf_flash_reads_cu_seq_lens_only_with_all_four():
    full = run(position_ids="0,1,2,3,4", cu_seq_lens_q="0,3,5", cu_seq_lens_k="0,3,5", max_length_q="3", max_length_k="3")
    same_on_real_rows(cells(full, "hf-flash"), expected([0, 0, 0, 1, 1], [1] * 5), [1] * 5)
    partial = run(position_ids="0,1,2,3,4", cu_seq_lens_q="0,3,5", cu_seq_lens_k="0,3,5")
    same_on_real_rows(cells(partial, "hf-flash"), expected([0] * 5, [1] * 5), [1] * 5)
    assert any("reads them only when all four" in note for note in partial.notes)


def test_four_d_mask_in_any_convention_is_read_and_rebuilt():
    docs, real = [0, 0, 1, 1, 1], [1] * 5
    keep = expected(docs, real)[:, None]
    for tensor in (keep, ~keep, np.where(keep, 0.0, float("-inf")).astype(np.float32)):
        from maskcli.pack.fields import from_arrays
        import torch

        batch = from_arrays({"attention_mask": torch.as_tensor(tensor)}, {"attention_mask": "attention_mask"})
        report = check(batch)
        sdpa = report.checks[0].path
        assert sdpa.reads == "attention_mask (4-D)" and sdpa.expression == "document(sizes=[2,3])"
        same_on_real_rows(cells(report, "hf-sdpa"), expected(docs, real), real)
        assert report.fields[0].start_positions(0).tolist() == [0, 2]


def test_seq_idx_and_document_ids_in_the_attention_mask():
    report = run(seq_idx="0,0,1,1,1,-1", attention_mask="1,1,2,2,2,0")
    assert [b.start_positions(0).tolist() for b in report.fields] == [[0, 2, 5], [0, 2]]
    assert not report.disagreements  # position 5 is padding, where no start counts
    assert any("document ids in attention_mask are read as 1" in note for note in report.notes)


@pytest.mark.parametrize(("given", "says"), [
    ({"cu_seqlens": "1,3,5"}, "start at 0"),
    ({"cu_seqlens": "0,3,2"}, "go down at entry 2"),
    ({"cu_seqlens": "0,3,9", "input_ids": "1,2,3,4,5"}, "past the batch's 5 tokens"),
    ({"position_ids": "0,1,2", "input_ids": "1,2,3,4"}, "do not agree on (B, L)"),
    ({"position_ids": "0,x"}, "'x' at position 1"),
    ({}, "no batch"),
    ({"cu_seqlens_padded": "0,4"}, "give cu_seqlens (the real lengths) too"),
])
def test_bad_batches_are_one_clear_error(given, says):
    with pytest.raises(MaskError, match=None) as error:
        check(read(None, given, []))
    assert says in str(error.value)


def test_a_real_collator_batch_matches_transformers_own_mask():
    transformers = pytest.importorskip("transformers")
    import torch
    from transformers.masking_utils import and_masks, causal_mask_function, find_packed_sequence_indices, packed_sequence_mask_function, sdpa_mask

    from maskcli.pack.fields import from_arrays

    features = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}, {"input_ids": [3, 4, 1, 2], "labels": [3, 4, 1, 2]}]
    collated = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True, return_tensors="pt")(features)
    tensors = {k: v if isinstance(v, torch.Tensor) else torch.tensor(v) for k, v in collated.items()}
    batch = from_arrays(dict(tensors), {k: k for k in tensors})
    report = check(batch, model=NO_CACHE)
    assert report.ok, report.findings
    packed = find_packed_sequence_indices(tensors["position_ids"])
    theirs = sdpa_mask(batch_size=1, q_length=9, kv_length=9, mask_function=and_masks(causal_mask_function, packed_sequence_mask_function(packed)),
                       allow_is_causal_skip=False)
    assert np.array_equal(cells(report, "hf-sdpa"), theirs[:, 0].numpy())
    same_on_real_rows(cells(report, "varlen"), expected([0, 0, 0, 1, 1, 2, 2, 2, 2], [1] * 9), [1] * 9)
    # the known failure: an attention_mask passed beside the packed position_ids
    tensors["attention_mask"] = torch.ones(1, 9, dtype=torch.int64)
    broken = check(from_arrays(dict(tensors), {k: k for k in tensors}), model=NO_CACHE)
    assert not broken.ok and not broken.paths_agree


@st.composite
def packed_batches(draw):
    """Rows of the same length cut into documents at random; position_ids restart and cu_seqlens count over the
    flattened batch, as a padding-free collator writes them."""
    rows = draw(st.integers(1, 3))
    length = draw(st.integers(1, 12))
    cuts = [sorted(draw(st.sets(st.integers(1, length - 1), max_size=4))) if length > 1 else [] for _ in range(rows)]
    return length, [[0, *row] for row in cuts]


@settings(max_examples=60, deadline=None)
@given(batch=packed_batches())
def test_paths_on_any_packed_batch_equal_a_double_loop(batch):
    length, starts = batch
    docs = np.array([[sum(1 for s in row if s <= p) - 1 for p in range(length)] for row in starts])
    positions = np.array([[p - max(s for s in row if s <= p) for p in range(length)] for row in starts])
    cu = [r * length + s for r, row in enumerate(starts) for s in row] + [len(starts) * length]
    text = ";".join(",".join(map(str, row)) for row in positions)
    report = run(position_ids=text, cu_seqlens=",".join(map(str, cu)))
    real = np.ones(docs.shape)
    want = expected(docs, real)
    same_on_real_rows(cells(report, "hf-sdpa"), want, real)
    same_on_real_rows(cells(report, "varlen"), want, real)
    packed = len(starts) == 1
    flash = want if packed else expected(np.zeros(docs.shape, dtype=int), real)
    same_on_real_rows(cells(report, "hf-flash"), flash, real)
    assert not report.disagreements
    flash_check = next(c for c in report.checks if c.path.name == "hf-flash")
    assert flash_check.cross_cells == leak_count(flash, docs, real)
    assert report.ok == (packed or all(len(row) == 1 for row in starts))


def test_a_2d_attention_mask_in_the_additive_convention():
    import torch

    from maskcli.pack.fields import from_arrays

    mask = torch.tensor([[0.0, 0.0, torch.finfo(torch.float32).min], [0.0, float("-inf"), float("-inf")]])
    report = check(from_arrays({"attention_mask": mask}, {"attention_mask": "attention_mask"}))
    assert report.pad.tolist() == [[False, False, True], [False, True, True]]


def test_options_need_no_torch():
    import subprocess
    import sys

    code = ("import sys; from maskcli.pack.fields import read; from maskcli.pack.findings import check; "
            "check(read(None, {'position_ids': '0,1,0', 'attention_mask': '1,1,0'}, [])); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_field_off_by_one_is_outvoted_and_each_path_is_counted_against_the_documents_the_others_agree_on():
    # DataCollatorWithFlattening's batch for samples of 4, 3 and 5 tokens, with cu_seq_lens_q's first boundary one early
    docs, real = [0] * 4 + [1] * 3 + [2] * 5, [1] * 12
    report = run(position_ids="0,1,2,3,0,1,2,0,1,2,3,4", cu_seq_lens_q="0,3,7,12", cu_seq_lens_k="0,4,7,12", max_length_q=5, max_length_k=5)
    assert report.reference.name == "cu_seq_lens_k" and report.majority == ["cu_seq_lens_k", "position_ids"]
    leaks = {c.path.name: c.cross_cells for c in report.checks if c.path.applies}
    assert leaks == {name: leak_count(cells(report, name), docs, real) for name in leaks}  # the double loop on the real documents
    assert leaks == {"hf-sdpa": 0, "hf-flash": 3, "varlen": 3}
    outvoted = [f.message for f in report.findings if f.code == "fields-disagree"]
    assert len(outvoted) == 1 and outvoted[0].startswith("cu_seq_lens_q disagrees with the majority of the fields (cu_seq_lens_k and position_ids agree) at 2 tokens")
    # --reference still decides where it is given; and two fields that disagree have no majority: the order decides
    chosen = run(reference="cu_seq_lens_q", position_ids="0,1,2,3,0,1,2,0,1,2,3,4", cu_seq_lens_q="0,3,7,12", cu_seq_lens_k="0,4,7,12")
    assert chosen.reference.name == "cu_seq_lens_q" and chosen.majority == []
    assert {c.path.name: c.cross_cells for c in chosen.checks if c.path.applies}["hf-sdpa"] == 3
    tie = run(position_ids="0,1,2,3,0,1,2,0,1,2,3,4", cu_seqlens="0,3,7,12")
    assert tie.reference.name == "cu_seqlens" and tie.majority == []
    assert [f.message.split(":")[0] for f in tie.findings if f.code == "fields-disagree"] == ["position_ids and cu_seqlens disagree at 2 tokens"]


def test_a_batch_too_large_to_check_is_refused_before_anything_per_token_is_made(monkeypatch):
    import tracemalloc

    import maskcli.memory
    from maskcli.pack.fields import BYTES_PER_TOKEN

    monkeypatch.setattr(maskcli.memory, "available_memory", lambda device=None: 1 << 30)  # 1 GiB free, on any machine
    tracemalloc.start()  # numpy reports its buffers to tracemalloc: a per-token array of 1e9 tokens would be 1 GB and more
    try:
        with pytest.raises(MaskError, match=r"checking a batch of 1 x 1,000,000,000 tokens \(--cu-seqlens ends at 1,000,000,000\) "
                                            r"would need 238\.4 GiB .* but only 1\.0 GiB is free"):
            run(cu_seqlens="0,1000000000")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    # within the room: not refused (the same test, at the size that fits 1 GiB and one token more)
    from maskcli.pack.fields import _check_fits

    fits = (1 << 30) // BYTES_PER_TOKEN
    _check_fits(1, fits, {"cu_seqlens": np.array([0, fits])}, {"cu_seqlens": "--cu-seqlens"})
    with pytest.raises(MaskError):
        _check_fits(1, fits + 1, {"cu_seqlens": np.array([0, fits + 1])}, {"cu_seqlens": "--cu-seqlens"})


def test_the_refusal_holds_under_a_real_address_space_limit():
    import os
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 31, 1 << 31))  # 2 GiB: the check of 1e9 tokens would die for memory

    result = subprocess.run([sys.executable, "-m", "maskcli", "pack", "--cu-seqlens", "0,1000000000"], capture_output=True, text=True,
                            preexec_fn=limit, env=os.environ, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("maskcli: error: checking a batch of 1 x 1,000,000,000 tokens") and "would need 238.4 GiB" in result.stderr
    assert result.stderr.count("\n") == 1  # refused before the work, not "ran out of memory" after it


@pytest.mark.parametrize("suffix", [".npz", ".pt"])
def test_a_uint64_field_past_int64_is_refused_not_wrapped_to_a_negative(tmp_path, suffix):
    """hunt 9a: position_ids 2^64 - 1 in a uint64 array became -1, and pack reported "their minimum (-1)", exit 0."""
    import torch

    values = np.array([[0, 1, 2**64 - 1]], np.uint64)
    path = tmp_path / f"batch{suffix}"
    if suffix == ".npz":
        np.savez(path, position_ids=values)
    else:
        torch.save({"position_ids": torch.from_numpy(values)}, path)
    with pytest.raises(MaskError, match=r"position_ids holds 18446744073709551615, past int64 \(9,223,372,036,854,775,807\)"):
        read(str(path), {}, [])
    path = tmp_path / f"fits{suffix}"
    if suffix == ".npz":
        np.savez(path, position_ids=np.array([[0, 1, 2, 0, 1]], np.uint64))
    else:
        torch.save({"position_ids": torch.tensor([[0, 1, 2, 0, 1]], dtype=torch.uint64)}, path)
    assert read(str(path), {}, []).fields["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
