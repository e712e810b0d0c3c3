"""checks/arguments.py: the forward call's attention_mask and position_ids, on reproductions of published bugs."""

from __future__ import annotations

import numpy as np
import pytest

from checkbugs import check_bug
from maskcli.checks.arguments import document_starts

BUGS = [
    ("decode_mask_sliced", "padding-ignored"),  # thu-nics/C2C#19: the mask sliced to one column at decode
    ("prefill_mask_ignores_padding", "padding-ignored"),  # ml-explore/mlx-lm#1906: a plain causal mask at prefill
    ("packed_positions_no_document_mask", "documents-leak"),  # huggingface/nanoVLM#204: positions reset, mask causal
    ("packing_position_reset_only", "documents-leak"),  # DeepOpt-com/WrinkleFree-Monorepo#53: the same, RoPE only
    ("chunked_mask_clobbers_documents", "documents-leak"),  # huggingface/transformers#37429: chunks over documents
]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


def test_documents_start_where_positions_restart_between_real_tokens():
    """Against a loop over positions: a new document where the position is 0 after a real token; generate's
    left-padded position_ids (cumsum - 1, padding filled with 1) are one document."""
    positions = np.array([[0, 1, 2, 0, 1, 0], [1, 1, 0, 1, 2, 3]])
    real = np.array([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    expected = np.zeros_like(positions)
    for b in range(2):
        for i in range(1, 6):
            new = positions[b, i] == 0 and real[b, i] and real[b, i - 1]
            expected[b, i] = expected[b, i - 1] + bool(new)
    assert document_starts(positions, real).tolist() == expected.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
