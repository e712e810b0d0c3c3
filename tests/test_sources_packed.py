"""sources/packed.py: the mask a packed batch's fields imply (causal inside each document, padding cut), checked
against a double loop over absolute positions built here from the batch's own fields (cu_seqlens, position_ids,
attention_mask)."""

from __future__ import annotations

import numpy as np
import pytest

from maskcli.errors import MaskError
from maskcli.pack.fields import from_arrays
from maskcli.sources import packed, registry


def from_cu_seqlens(cu: list[int], length: int) -> np.ndarray:
    """(L, L) keep cells of one row by a double loop: query and key in the same [cu[i], cu[i+1]), key <= query; a
    token past cu[-1] is padding, seen by no one."""
    doc = [next((i for i in range(len(cu) - 1) if cu[i] <= t < cu[i + 1]), None) for t in range(length)]
    return np.array([[doc[k] is not None and doc[q] == doc[k] and k <= q for k in range(length)]
                     for q in range(length)])


def from_position_ids(rows: list[list[int]], real: list[list[int]] | None = None) -> np.ndarray:
    """(B, L, L) by a double loop: a document starts where the position does not go up by 1; a key where
    attention_mask is 0 is seen by no one."""
    out = []
    for b, pos in enumerate(rows):
        doc = np.cumsum([t == 0 or pos[t] != pos[t - 1] + 1 for t in range(len(pos))])
        ok = real[b] if real is not None else [1] * len(pos)
        out.append([[bool(ok[k]) and doc[q] == doc[k] and k <= q for k in range(len(pos))] for q in range(len(pos))])
    return np.array(out)


def test_cu_seqlens_make_causal_documents_and_padding_past_the_last(tmp_path):
    path = tmp_path / "batch.npz"
    np.savez(path, input_ids=np.arange(10)[None], cu_seqlens=np.array([0, 3, 7, 8], dtype=np.int32))
    mask = registry.sources()["packed"].load(str(path))
    assert mask.shape == (1, 1, 10, 10)
    assert np.array_equal(mask.dense()[0, 0, :8], from_cu_seqlens([0, 3, 7, 8], 10)[:8])  # real query rows
    assert not mask.dense()[0, 0, :, 8:].any()  # padding keys


def test_position_ids_per_row_and_attention_mask_padding():
    pos = [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]
    real = [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    batch = from_arrays({"position_ids": np.array(pos), "attention_mask": np.array(real)},
                        {"position_ids": "position_ids", "attention_mask": "attention_mask"})
    mask = packed.documents(batch)
    want = from_position_ids(pos, real)
    got = mask.dense()[:, 0]
    for b in range(2):
        rows = np.array(real[b], bool)
        assert np.array_equal(got[b][rows], want[b][rows]), b


def test_the_named_reference_field_is_the_one_read():
    batch = from_arrays({"position_ids": np.array([[0, 1, 2, 3, 0, 1]]), "cu_seqlens": np.array([0, 2, 6])},
                        {"position_ids": "position_ids", "cu_seqlens": "cu_seqlens"})
    by_cu = packed.documents(batch, "cu_seqlens").dense()[0, 0]
    by_pos = packed.documents(batch, "position_ids").dense()[0, 0]
    assert np.array_equal(by_cu, from_cu_seqlens([0, 2, 6], 6))
    assert np.array_equal(by_pos, from_position_ids([[0, 1, 2, 3, 0, 1]])[0])


def test_a_batch_that_places_no_documents_is_one_clear_error(tmp_path):
    path = tmp_path / "ids.npz"
    np.savez(path, input_ids=np.arange(6)[None])
    with pytest.raises(MaskError, match="does not say where its documents are"):
        packed.load(str(path))


def test_read_takes_fields_given_as_options_over_the_file_and_field_maps(tmp_path):
    """What `maskcli pack` asks the registry for: the file's fields, a key mapped with --field, an option over both;
    the documents then as a double loop over the fields that won."""
    path = tmp_path / "batch.npz"
    np.savez(path, input_ids=np.arange(6)[None], pos=np.array([[0, 1, 2, 0, 1, 2]]))
    batch = registry.read("packed", str(path), {}, ["position_ids=pos"])
    assert batch.sources["position_ids"] == "pos via --field"
    assert np.array_equal(packed.documents(batch).dense()[0, 0], from_position_ids([[0, 1, 2, 0, 1, 2]])[0])
    over = registry.read("packed", str(path), {"position_ids": "0,1,0,1,2,3"}, ["position_ids=pos"])
    assert np.array_equal(packed.documents(over).dense()[0, 0], from_position_ids([[0, 1, 0, 1, 2, 3]])[0])
    alone = registry.read("packed", None, {"cu_seqlens": "0,2,6"})
    assert np.array_equal(packed.documents(alone).dense()[0, 0], from_cu_seqlens([0, 2, 6], 6))


def test_sequence_is_document_bound_to_the_sizes_and_one_row_with_padding_is_refused():
    # shard's BATCH: the documents of one row of real tokens, as a term and-ed into a mask (mask.build's before);
    # cells by a double loop over the documents position_ids restart
    from maskcli.mask import MaskOptions, build

    batch = from_arrays({"position_ids": np.array([[0, 1, 2, 0, 1, 0, 1, 2, 3]])}, {"position_ids": "position_ids"})
    term = packed.sequence(batch)
    assert term.kind.name == "document" and term.values["labels"].as_json() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    doc = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    mask = build("causal & window(2)", MaskOptions(), before=term)
    reference = np.array([[doc[q] == doc[k] and 0 <= q - k < 2 for k in range(9)] for q in range(9)])
    assert np.array_equal(mask.dense()[0, 0], reference)
    padded = from_arrays({"position_ids": np.array([[0, 1, 2, 0, 1]]), "attention_mask": np.array([[1, 1, 1, 1, 0]])},
                         {"position_ids": "position_ids", "attention_mask": "attention_mask"})
    with pytest.raises(MaskError, match="holds 1 padding token"):
        packed.sequence(padded, "BATCH 'b.pt'")
