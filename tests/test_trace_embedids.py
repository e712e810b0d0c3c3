"""trace/embedids.py: a model call's embeddings read as one id per token (equal vectors, equal ids; others apart),
against a loop comparing the vectors with torch.equal; a float 0/1 attention_mask kept as integers, others not."""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.embedids import embed_ids, float_mask


def test_tokens_handed_as_embeddings_share_an_id_where_their_vectors_are_equal():
    g = torch.Generator().manual_seed(0)
    vocab = torch.randn(5, 16, generator=g)
    picks = torch.randint(0, 5, (3, 9), generator=g)
    embeds = vocab[picks].clone()
    embeds[1, 4, 3] = torch.nextafter(embeds[1, 4, 3], torch.tensor(1e9))  # (one bit apart from its word's vector)
    ids = embed_ids({"inputs_embeds": embeds}, {})["embeds_ids"]
    assert ids.shape == (3, 9) and ids.dtype == np.int64
    flat, vectors = ids.reshape(-1), embeds.reshape(-1, 16)
    for i in range(len(flat)):
        for j in range(len(flat)):
            assert (flat[i] == flat[j]) == torch.equal(vectors[i], vectors[j])


def test_embeddings_are_read_only_where_no_ids_are_and_random_state_is_left():
    embeds = torch.randn(2, 4, 8)
    assert embed_ids({"inputs_embeds": embeds}, {"input_ids": np.zeros((2, 4))}) == {}
    assert embed_ids({"inputs_embeds": embeds[0]}, {}) == {}  # (not (B, L, D))
    assert embed_ids({"inputs_embeds": embeds.long()}, {}) == {}
    wide = torch.randn(2, 4, 1000)
    state = torch.get_rng_state()
    assert embed_ids({"embeds": wide}, {})["embeds_ids"].shape == (2, 4)
    assert torch.equal(state, torch.get_rng_state())


def test_a_float_attention_mask_of_zeros_and_ones_is_kept_as_integers():
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    kept = float_mask({"attention_mask": mask}, {})["float_attention_mask"]
    assert kept.dtype == np.int64 and kept.tolist() == [[1] * 6, [1] * 4 + [0, 0]]
    assert float_mask({"attention_mask": torch.full((2, 6), float("-inf"))}, {}) == {}  # (additive: not a 0/1 mask)
    assert float_mask({"attention_mask": mask}, {"attention_mask": mask.long().numpy()}) == {}  # (kept already)
    assert float_mask({"attention_mask": torch.ones(2, 1, 6, 6)}, {}) == {}
