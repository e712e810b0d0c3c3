"""checks/docrows.py: a real token of a packed document (position_ids restarting at 0) whose query sees no key at
all, on the published bug's reproduction (tests/data/bugs) and a program written another way (tests/data/docrows),
both quiet fixed; the rows flagged against a plain loop over the position_ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug
from maskcli.checks.docrows import counted

DOCROWS = Path(__file__).parent / "data" / "docrows"


def test_the_first_token_of_a_later_document_given_the_separator_id_is_found(tmp_path):
    """evabyte#10 (written blind, batch blind-be): each later document restarted at `token_idx + 1`, so its first
    token (token 10, position 0 of tokens 10-15) got the separator id and a row of only masked cells."""
    [hit] = check_bug(tmp_path, "evabyte_doc_boundary_mask_skips_first_token_of_next_document", "document-row-empty")
    assert hit["cell"] == [0, 10, 10]
    assert "token 10, at position 0 of the packed document at tokens 10-15" in hit["message"]
    assert "no query of its document sees it" in hit["message"] and "uniform weights" in hit["message"]


def test_a_packed_sft_mask_built_from_the_shifted_labels_is_found(tmp_path):
    """Written another way: two right-padded packed rows, SDPA, the mask's live tokens read from labels that are
    -100 on each example's first token. The first flagged row is the first example start, by a loop."""
    found = check_bug(tmp_path, "packed_sft_mask_from_labels_hides_first_tokens", "document-row-empty", DOCROWS)
    positions = [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 0], [0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 0]]
    real = [[1] * 9 + [0, 0], [1] * 9 + [0, 0]]
    starts = [(b, t) for b in range(2) for t in range(11) if real[b][t] and positions[b][t] == 0]
    assert found[0]["cell"] == [starts[0][0], starts[0][1], starts[0][1]]
    assert f"({sum(1 for b, _ in starts if b == 0)} such rows in batch row 0)" in found[0]["message"]


def test_counted_runs_leave_out_padding_positions():
    positions = np.array([[0, 1, 2, 0, 1, 0, 0], [1, 1, 1, 0, 1, 2, 3]])
    expected = [[p >= 0 and ((t > 0 and row[t] == row[t - 1] + 1) or (t + 1 < len(row) and row[t + 1] == row[t] + 1))
                 for t, p in enumerate(row)] for row in positions.tolist()]
    assert counted(positions).tolist() == expected
    assert counted(positions)[0].tolist() == [True, True, True, True, True, False, False]


def test_a_pad_block_hidden_whole_by_a_bool_4d_mask_is_quiet(tmp_path):
    """quiet-zk, written another way (LLaMA-Factory's float mask in quiet_blind is the first): torchtune-style
    block-causal bool masks from per-row seq_lens, two rows, each ending in a pad block whose position_ids count 0, 1,
    .. and which the mask hides whole (no row of it sees a key, no query sees it). No document-row-empty; the pad
    rows are still said empty (fully-masked), the rows a loop over seq_lens gives."""
    import pytest

    pytest.importorskip("transformers")
    from checkbugs import traced

    quiet = Path(__file__).parent / "data" / "quiet"
    status, found, report = traced(tmp_path, "qwen2_packed_rows_bool_4d_mask_pad_block_hidden", False, quiet)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
    seq_lens, width = [[6, 4, 3], [9, 5]], 16
    pads = [list(range(sum(lens), width)) for lens in seq_lens]
    empty = [f["message"] for f in found if f["code"] == "fully-masked"]
    assert empty and f"query rows {pads[0][0]}-{pads[0][-1]} of batch row 0" in empty[0], report
