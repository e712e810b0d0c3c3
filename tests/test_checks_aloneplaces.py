"""checks/aloneplaces.py and trace/tables.py: a stretch of a batch row attended as a sequence of its own whose table of
absolute positions is read at other rows than the program's run of the same tokens alone, on the published bugs'
reproductions (tests/data/bugs) and programs written another way (tests/data/aloneplaces), each quiet fixed; the
findings against the rows a loop over each row's layout places each sequence at."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from checkbugs import check_bug
from maskcli.trace.tables import table

ALONEPLACES = Path(__file__).parent / "data" / "aloneplaces"


def misplaced(layout: list[list[tuple[int, int]]]) -> list[tuple[int, int, int]]:
    """(batch row, first token, first row read) of each sequence (start, length) of each row read at the row's slots
    (start, start + 1, ...) where alone it is read from 0: a plain loop, the tests' reference."""
    found = []
    for b, sequences in enumerate(layout):
        for start, length in sequences:
            if any(start + j != j for j in range(length)):
                found.append((b, start, start))
    return found


def flagged(found: list[dict]) -> list[tuple[int, int, int]]:
    """(batch row, first token, first row read in the batch) of each finding, read off its cell and its message."""
    return [(f["cell"][0], f["cell"][1], int(re.search(r"reads them at rows (\d+)", f["message"]).group(1)))
            for f in found]


def test_a_left_padded_ppo_batch_scored_without_position_ids_is_found(tmp_path):
    # CarperAI/trlx#509 (commit fbc9e04; written blind, batch blind-dm): prompts of 7, 3, 5 left-padded to 7, responses
    # of 6, 4, 6 right-padded; GPT-2 counts positions from each row's first slot; the program scores each alone
    found = check_bug(tmp_path, "trlx_ppo_make_experience_ref_forward_no_mask_position_ids", "positions-unlike-alone")
    layout = [[(7 - p, p + r)] for p, r in ((7, 6), (3, 4), (5, 6))]
    assert sorted(flagged(found)) == misplaced(layout)
    assert "another call of m" in found[0]["message"] and "each 4 rows on" in found[0]["message"]


def test_packed_reward_samples_whose_positions_run_on_are_found(tmp_path):
    # OpenRLHF/OpenRLHF b2e226f ("reset packing position ids"; written blind, batch blind-dm): four samples of 7, 5, 4
    # and 8 tokens packed in one row, segment ids as the mask, position_ids a cumsum over the whole row
    found = check_bug(tmp_path, "openrlhf_rm_packing_position_ids_not_reset_per_segment", "positions-unlike-alone")
    starts = (0, 7, 12, 16)
    assert sorted(flagged(found)) == misplaced([[(s, n) for s, n in zip(starts, (7, 5, 4, 8))]])


def test_a_nanogpt_left_padded_batch_placed_from_each_rows_first_slot_is_found(tmp_path):
    found = check_bug(tmp_path, "nanogpt_left_padded_batch_positions_from_slot", "positions-unlike-alone",
                      folder=ALONEPLACES)
    lengths = (6, 3, 4)  # left-padded to 6
    assert sorted(flagged(found)) == misplaced([[(6 - n, n)] for n in lengths])


def test_packed_sentences_of_an_encoder_placed_along_the_row_are_found(tmp_path):
    found = check_bug(tmp_path, "bert_packed_sentences_positions_run_on", "positions-unlike-alone", folder=ALONEPLACES)
    assert sorted(flagged(found)) == misplaced([[(0, 5), (5, 4), (9, 6)]])
    assert "each 5 rows on" in found[0]["message"]


def test_the_table_is_the_one_embedding_of_positions_not_the_tokens_of_as_many_rows():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel

    gpt2 = GPT2Model(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=64))
    assert table(gpt2) is gpt2.wpe.weight  # (the vocabulary as many rows as the positions: told apart by name)
    llama = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, max_position_embeddings=64))
    assert table(llama) is None  # (rotary: no table)
    two = torch.nn.ModuleDict({"encoder": torch.nn.ModuleDict({"embed_positions": torch.nn.Embedding(8, 4)}),
                               "decoder": torch.nn.ModuleDict({"embed_positions": torch.nn.Embedding(8, 4)})})
    assert table(two) is None  # (an encoder's and a decoder's: which one a call read is not known)


def test_a_left_padded_opt_batch_placed_from_its_mask_by_the_model_itself_is_quiet(tmp_path):
    # OPT counts positions from the attention_mask when handed none: each row read from its first real token, as alone
    from checkbugs import traced

    status, found, report = traced(tmp_path, "opt_left_padded_batch_positions_from_mask", False, ALONEPLACES)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_nnsight_left_padded_invokes_batched_without_position_ids(tmp_path):
    """ndif-team/nnsight#673 (written blind, batch blind-mm; caught before any rule changed for it): LanguageModel
    left-padded several invokes into one batch and handed GPT-2 no position_ids, so a shorter prompt's tokens were read
    at positions shifted by its padding, unlike the same prompt traced alone. The fix numbers them from the mask."""
    hit = check_bug(tmp_path, "nnsight_language_model_left_padded_batch_no_position_ids", "positions-unlike-alone")[0]
    assert "reads them at rows 8-13" in " ".join(hit["message"].split())
