"""checks/alone.py: a packed document (position_ids restarting at 0) attended otherwise than the same call site
attends a sequence of its length alone, on the published bug's reproduction (tests/data/bugs) and a program written
another way (tests/data/packed), both quiet fixed; the kinds read against torch.tril."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from checkbugs import check_bug
from maskcli.checks.alone import _kind

PACKED = Path(__file__).parent / "data" / "packed"


def test_a_diffusion_lm_given_the_causal_packed_fallback_is_found(tmp_path):
    """nishide-dev/unturtle#44 (written blind, batch blind-bl): the A2D model runs each document alone with no mask
    (full), and packed through run_attention's causal packed-block fallback: causal inside each document."""
    [hit] = check_bug(tmp_path, "unturtle_a2d_packed_sdpa_fallback_causal_blocks", "document-unlike-alone")
    assert "the packed document at tokens 0-6 (7 tokens, position_ids restarting) is causal inside it" in hit["message"]
    assert "run on a 7-token sequence alone (step 1) sees every key of it" in hit["message"]
    assert hit["cell"] == [0, 0, 1]  # query 0 hides key 1 of its own document: the first cell above the diagonal


def test_a_packed_encoder_batch_built_with_a_causal_tril_is_found(tmp_path):
    """Written another way: a right-padded packed batch of two rows into an eager softmax encoder, the collator's
    document mask ANDed with a tril; each sentence run alone with no mask is full."""
    [hit] = check_bug(tmp_path, "encoder_packed_mask_built_causal", "document-unlike-alone", PACKED)
    assert hit["message"].startswith("batch row 0: the packed document at tokens 0-3 (4 tokens")
    assert hit["cell"] == [0, 0, 1]


def test_a_packed_decoder_mask_without_its_tril_is_found(tmp_path):
    """The other way round: a nanoGPT-style decoder, causal alone (SDPA is_causal=True), handed a document mask with
    no tril when packed: full inside each document. Fixed: the document mask ANDed with torch.tril."""
    [hit] = check_bug(tmp_path, "decoder_packed_documents_without_tril", "document-unlike-alone", PACKED)
    assert "tokens 0-4 (5 tokens, position_ids restarting) is full inside it" in hit["message"]
    assert "run on a 5-token sequence alone (step 1) is causal over it" in hit["message"]
    assert hit["cell"] == [0, 0, 1]  # query 0 sees key 1, above torch.tril's diagonal


def test_kinds_against_tril():
    n = 5
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool)).numpy()
    assert _kind(np.ones((2, n, n), dtype=bool)) == "full"
    assert _kind(np.stack([causal, causal])) == "causal"
    window = causal & ~torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-2).numpy()
    assert _kind(window[None]) is None
    assert _kind(np.stack([causal, np.ones((n, n), dtype=bool)])) is None  # (heads that differ: neither)
