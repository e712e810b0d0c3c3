"""checks/bosmasked.py: every row's BOS marked padding by a mask built from the ids, the pad id being the BOS id."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

BLIND = Path(__file__).parent / "data" / "blind"
BOSMASK = Path(__file__).parent / "data" / "bosmask"


def test_fastchat_gritlm_embeddings_mask_the_bos_that_is_the_pad(tmp_path):
    """lm-sys/FastChat 0f8692b2 (written blind, blind-px, caught after tuning): GritLM's tokenizer pads with its BOS
    (id 1), and `input_ids != pad_token_id` masks each row's BOS out of the two-way attention and the pooling; the fix
    sets attention_mask[:, 0] = 1. A real query of row 0 (query 1, the first after the BOS) misses key 0."""
    [hit] = check_bug(tmp_path, "fastchat_gritlm_embed_bos_pad_masked_instruction_len_of_batchencoding", "bos-masked",
                      BLIND)
    assert tuple(hit["cell"]) == (0, 1, 0) and "BOS (id 1)" in hit["message"], hit


def test_a_causal_embedder_whose_pad_token_is_its_bos(tmp_path):
    """Written another way: transformers' LlamaModel, pad == BOS in its config, right-padded texts, the mask from the
    ids; the fix keeps column 0. Every row's queries after the BOS miss it: row 0, query 1 first."""
    [hit] = check_bug(tmp_path, "llama_embedder_pad_is_bos_mask_from_ids", "bos-masked", BOSMASK)
    assert tuple(hit["cell"]) == (0, 1, 0) and "3 rows, padded on the right" in hit["message"], hit
    status, found, report = traced(tmp_path, "llama_embedder_pad_is_bos_mask_from_ids", False, BOSMASK)
    assert "fully-masked" not in {f["code"] for f in found}, report  # (said once, by the BOS it masked)


def test_a_left_padded_batch_whose_pad_is_its_bos_is_quiet(tmp_path):
    """The same embedder padded on the left: each row begins with its own run of pad ids, the BOS last of them, so
    the first token is padding wherever a row is shorter; nothing says a masked first token is the BOS."""
    text = (BOSMASK / "llama_embedder_pad_is_bos_mask_from_ids.py").read_text()
    left = text.replace("[[BOS] + t + [PAD] * (width - 1 - len(t)) for t in texts]",
                        "[[PAD] * (width - 1 - len(t)) + [BOS] + t for t in texts]")
    assert left != text
    (tmp_path / "left.py").write_text(left)
    status, found, report = traced(tmp_path, "left", False, tmp_path)
    assert "bos-masked" not in {f["code"] for f in found}, report
