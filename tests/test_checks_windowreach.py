"""checks/windowreach.py: a sliding layer whose stated window bounds some real queries while another sees past it
(window-escaped), caught in the published bug's reproductions (tests/data/bugs: transformers#46850, written twice) and
in a program written another way (tests/data/windows: a prefix block, a left-padded batch, eager attention), quiet on
the fixes; the flagged cell against a double loop over positions."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

WINDOWS = Path(__file__).parent / "data" / "windows"


def test_gemma3_image_block_ored_after_the_window_is_found(tmp_path):
    # huggingface/transformers#46850 (blind-bh): create_sliding_window_causal_mask with the image block as its
    # or_mask_function; sliding_window=3, image tokens at 5-12: image query 9 sees image key 5, 4 positions back
    hit = check_bug(tmp_path, "transformers_gemma3_image_block_mask_crosses_sliding_window", "window-escaped")[0]
    assert "sliding_window=3" in hit["source"] and "layer 0" in hit["message"]
    image = [5 <= i <= 12 for i in range(17)]
    assert tuple(hit["cell"]) == first((1, 17, 17), lambda b, q, k: image[q] and image[k] and q - k > 3)


def test_the_same_bug_written_with_mask_functions_and_sdpa_is_found(tmp_path):
    # huggingface/transformers#46850 again (blind-bf): the mask functions written out, a decode step after the prompt
    hit = check_bug(tmp_path, "gemma3_sliding_layer_image_block_escapes_window", "window-escaped")[0]
    image = [3 <= i <= 10 for i in range(14)]
    assert tuple(hit["cell"]) == first((1, 14, 14), lambda b, q, k: image[q] and image[k] and q - k > 3)


def test_a_prefix_block_ored_after_the_window_on_a_left_padded_batch_is_found(tmp_path):
    """Written another way: a dataclass config held as self.cfg, a prefix (not an image) attending both ways, a
    left-padded batch of two, masked_fill and softmax; its fix (the window AND-ed over the prefix) is quiet."""
    status, found, report = traced(tmp_path, "prefix_block_ored_after_sliding_window_left_padded", False, WINDOWS)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "window-escaped"]
    assert hits and hits[0]["severity"] == "wrong" and "self.cfg of PrefixLM" in hits[0]["source"], report
    pads, prefix = [2, 0], [6, 7]  # row 0: two left pads; each row's prefix, in its own positions

    def escaped(b, q, k):  # columns; a row's own positions are its columns less its pads
        pq, pk = q - pads[b], k - pads[b]
        return min(pq, pk) >= 0 and pq < prefix[b] and pk < prefix[b] and pq - pk > 3

    assert tuple(hits[0]["cell"]) == first((2, 10, 10), escaped)
    status, found, report = traced(tmp_path, "prefix_block_ored_after_sliding_window_left_padded", True, WINDOWS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_packed_documents_under_a_stated_window_are_no_window_escaped():
    """torchtitan's GPT-OSS (written blind, quiet-r92b, window-escaped before): a config stating sliding_window=3 on a
    model whose full layers attend causally within packed documents (6, 4 and 8 tokens). A document's first tokens
    see fewer keys than the window and none before them, which read as queries keeping to the window while later ones
    saw further back. A query keeps to a window only where it sees every key within it and the query before it saw a
    key it does not (the window slid on): no query here does, so nothing escaped a window."""
    from dataclasses import dataclass

    import torch
    import torch.nn.functional as F
    from torch import nn

    import maskcli

    @dataclass
    class GptOssConfig:
        sliding_window: int = 3

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = GptOssConfig()

        def forward(self, x, docs):
            same = docs[:, None] == docs[None, :]
            keep = same & torch.ones(len(docs), len(docs), dtype=torch.bool).tril()
            return F.scaled_dot_product_attention(x, x, x, attn_mask=keep)

    docs = torch.tensor([0] * 6 + [1] * 4 + [2] * 8)
    with torch.no_grad(), maskcli.trace() as t:
        Layer()(torch.randn(1, 2, 18, 4), docs)
    codes = [f.code for g in t.groups() for f in g.findings]
    assert "window-escaped" not in codes, codes
