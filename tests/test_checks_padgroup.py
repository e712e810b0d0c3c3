"""checks/padgroup.py: group ids that set the padding apart in one row and give it the real tokens' id in another,
caught in the published bug's reproduction (tests/data/bugs) and in a program written another way
(tests/data/padgroup), quiet on the fixes and on a scheme that never sets padding apart; the flagged cell against a
double loop over the program's own batch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from checkbugs import check_bug, first, traced

BUGS = Path(__file__).parent / "data" / "bugs"
PADGROUP = Path(__file__).parent / "data" / "padgroup"


def _loaded(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_moonbeam_dummy_padding_first_piece_shares_its_id_with_its_pads(tmp_path):
    """guozixunnicolas/Moonbeam-MIDI-Foundation-Model be25f5b (written blind, batch blind-fl): ConcatDataset_dummy_padding
    writes sample_count for a piece's notes and sample_count * 2 for its pad rows; from 0, piece 0's both are 0."""
    name = "moonbeam_dummy_padding_first_piece_shares_mask_id_with_pad"
    found = check_bug(tmp_path, name, "padding-shares-group")
    batch = _loaded(BUGS / f"{name}.py", "moonbeam_be25f5b").batch
    pad = [[all(v == 0 for v in tok) for tok in row] for row in batch["input_ids"].tolist()]  # the pad rows' zeros
    ids = batch["attention_mask"].tolist()
    # upstream meaning: a piece's pads and notes are two groups; the mask (equal ids, causal) joins them in a row
    # whose pads got the notes' id
    joined = [b for b in range(2) if ids[b][pad[b].index(True)] == ids[b][pad[b].index(True) - 1]]
    cell = first((2, 40, 40), lambda b, q, k: b in joined and k <= q and pad[b][q] != pad[b][k])
    assert tuple(found[0]["cell"]) == cell
    notes = pad[0].index(True)
    assert f"but in batch row 0 its padding has the id 0 of the real tokens beside it: query {notes} sees key 0" \
        in found[0]["message"]
    assert f"({notes * (40 - notes)} such cells;" in found[0]["message"]  # every pad sees every note before it


def test_left_padded_packed_segments_whose_negated_pad_id_is_zero_for_the_first_sample(tmp_path):
    """The same bug written another way: 2-D ids, left padding, segment_ids from a counter over the batch with the pads
    at -first, an nn.MultiheadAttention block mask: the first row's real tokens attend its padding."""
    name = "left_padded_packed_segments_negated_pad_id_mha"
    found = check_bug(tmp_path, name, "padding-shares-group", folder=PADGROUP)
    program = _loaded(PADGROUP / f"{name}.py", "negated_pad")
    import torch

    g = torch.Generator().manual_seed(3)  # (the program's rows, collated by its own collator)
    rows = [[torch.randint(3, 40, (n,), generator=g).tolist() for n in lengths] for lengths in ((4, 6), (5, 3, 5))]
    ids, seg = (t.tolist() for t in program.collate(rows, program.DecoderConfig()))
    pad = [[t == 0 for t in row] for row in ids]
    cell = first((2, 16, 16), lambda b, q, k: k <= q and seg[b][q] == seg[b][k] and pad[b][q] != pad[b][k])
    assert tuple(found[0]["cell"]) == cell
    assert "the segment_ids given to PackedDecoder" in found[0]["message"]
    assert "sets the padding (the pad id 0) apart in batch row 1 (id -2)" in found[0]["message"]
    _, every, _ = traced(tmp_path, name, False, PADGROUP)
    assert not [f for f in every if f["code"] == "padding-ignored"]  # (the same keys, said with their cause)


def test_pads_kept_in_the_last_samples_segment_in_every_row_are_quiet(tmp_path):
    status, found, report = traced(tmp_path, "right_padded_pads_join_last_sample_in_every_row", False, PADGROUP)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
