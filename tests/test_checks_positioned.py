"""checks/positioned.py: the positions a model call hands its rotary embedding against the keys each query sees."""

from __future__ import annotations

from pathlib import Path
import numpy as np

from checkbugs import check_bug, first, traced
from types import SimpleNamespace

from maskcli.checks.positioned import _folded, _within

POSITIONS = Path(__file__).parent / "data" / "positions"


def _depths(parents: list[int]) -> list[int]:
    """Each node's depth, walking its parents (the reference)."""
    found = []
    for node in range(len(parents)):
        depth, up = 0, parents[node]
        while up >= 0:
            depth, up = depth + 1, parents[up]
        found.append(depth)
    return found


def test_mlxcel_tree_verify_positions_at_span_index(tmp_path):
    """lablup/mlxcel#1214 (written blind, batch blind-ex): the flattened draft tree verified at offset + span index;
    node 2 (the root's second child, depth 1) sits at 11, not offset 9 + its depth."""
    hit = check_bug(tmp_path, "mlxcel_mtp_tree_verify_rope_positions_span_index", "positions-vs-keys")[0]
    depth = _depths([-1, 0, 0, 1, 3])[2]
    assert hit["expected"] == f"position {9 + depth}" and "query 2" in hit["message"] and "pos of Target" in hit["source"]


def test_sglang_eagle_draft_decode_positions_advanced_before_forward(tmp_path):
    """sgl-project/sglang#25015 (written blind, batch blind-ex): positions.add_(1) before each draft decode forward;
    request 0's first draft step (7 prompt keys, one more written) ran at 8."""
    hit = check_bug(tmp_path, "sglang_eagle_worker_draft_decode_positions_advanced_before_forward",
                    "positions-vs-keys")[0]
    assert hit["expected"] == "position 7" and "yet its position is 8" in hit["message"]


def test_mlc_llm_chain_draft_cache_not_popped(tmp_path):
    """mlc-ai/mlc-llm#2939 (written blind, batch blind-ex): the draft model's cache never rolled back after chain
    drafting: round 1's first draft step at position 6 sees 10 keys (5 prompt + 1 pending + 4 drafts of round 0)."""
    hit = check_bug(tmp_path, "mlc_llm_batch_verify_chain_draft_kv_not_popped", "positions-vs-keys")[0]
    assert hit["expected"] == "7 keys" and "sees 10 keys" in hit["message"]


def test_medusa_tree_position_ids_flat_index_left_padded(tmp_path):
    """Written another way: a Medusa-style tree over a left-padded batch, position_ids = prompt length + arange(T)
    beside a bool ancestor mask; the fix's prompt length + depth is quiet."""
    hit = check_bug(tmp_path, "medusa_tree_verify_position_ids_flat_index_left_padded", "positions-vs-keys", POSITIONS)[0]
    assert hit["expected"] == f"position {6 + _depths([-1, 0, 0, 1, 2])[2]}"


def test_decode_position_from_the_mask_after_appending(tmp_path):
    """Written another way: a batched generate loop whose position_ids are attention_mask.sum(-1) after the new
    token's 1 is appended, left-padded; row 0's first decode step (5 prompt tokens) runs at 6."""
    hit = check_bug(tmp_path, "decode_position_from_mask_sum_after_append_left_padded", "positions-vs-keys", POSITIONS)[0]
    assert hit["expected"] == "position 5" and "batch row 0" in hit["message"]


def test_assisted_draft_cache_not_cropped(tmp_path):
    """Written another way: HF-style assisted generation whose assistant's past_key_values are not cropped after a
    rejection (a softmax written by hand, learned position embeddings): 8 tokens up to position 7, 9 keys seen."""
    hit = check_bug(tmp_path, "assisted_draft_past_key_values_not_cropped", "positions-vs-keys", POSITIONS)[0]
    assert hit["expected"] == "8 keys" and "sees 9 keys" in hit["message"]


def test_lag_llama_decode_rotary_table_built_for_one_position(tmp_path):
    """lag-llama 4a2d099 (written blind, batch blind-fg): at each cached decode step RoPE was built for seq_len=T=1 and
    applied with position_ids=None, so the query and all 32 cached keys were rotated at position 0. The fix rotates q
    at position -1 of a table over the 32 keys. Both runs keep lag-llama#81's non-causal prefill (causal-lm-both-ways,
    true of both): the fix says nothing else wrong or suspicious."""
    name = "lag_llama_kv_cache_decode_rotary_positions_all_zero"
    status, found, report = traced(tmp_path, name, False)
    hits = [f for f in found if f["code"] == "positions-vs-keys" and f["severity"] == "wrong"]
    assert status == 1 and hits, report
    # a query rotated at position 0 can count one key (its own place) at most: every key past the first it sees is
    # one whose distance the rotation lost (the decode query sees all 32 keys of the sliding cache)
    assert tuple(hits[0]["cell"]) == first((2, 1, 32), lambda b, q, k: k > 0)
    assert "sees 32 keys" in hits[0]["message"] and "encodes no position past 0" in hits[0]["message"]
    assert hits[0]["expected"] == "position 31 or after"
    status, fixed, report = traced(tmp_path, name, True)
    assert {f["code"] for f in fixed if f["severity"] in ("wrong", "suspicious")} == {"causal-lm-both-ways"}, report


def test_meta_llama_freqs_cis_sliced_from_zero_left_padded(tmp_path):
    """Written another way: a precomputed complex freqs_cis (no rotary module: position 0 read as cos 1, sin 0), a
    (B, T, H, D) cache grown by torch.cat, eager softmax, prompts left-padded by 2 and 0. Decode step 1 of row 0 sees
    its 5 real keys (2-6) with the table of position 0."""
    hit = check_bug(tmp_path, "meta_llama_decode_freqs_cis_sliced_from_zero_left_padded", "positions-vs-keys",
                    POSITIONS)[0]
    pads = (2, 0)
    # (row 0's keys before its pads are not seen: the first key past the one a position-0 query can count)
    assert tuple(hit["cell"]) == first((2, 1, 7), lambda b, q, k: k >= pads[b] + 1)
    assert "sees 5 keys" in hit["message"] and "freqs_cis" in hit["message"]


def test_rotary_positions_from_the_mask_with_every_row_left_padded_are_quiet(tmp_path):
    """A transformers-style rotary module (inv_freq, one (cos, sin) row per batch row) fed cumsum positions, both rows
    left-padded (by 1 and 3): each decode query's table stops at the position its real keys count, per row."""
    status, found, report = traced(tmp_path, "quiet_rotary_position_ids_from_mask_all_rows_left_padded", False,
                                   POSITIONS)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report


def test_roformer_cached_decode_sinusoidal_pos_restarts_at_zero(tmp_path):
    """transformers#22416 (written blind, batch blind-fo): RoFormer's cache branch joined the new key unrotated and
    RoFormerEncoder built `sinusoidal_pos` (sin | cos on the last axis, no inv_freq: position 0 read alone) from 0 at
    every step; the fix rotates at positions from past_key_values_length. Decode step 1 of a 12-token prompt: the query
    sees 13 keys (no padding) with a table of position 0."""
    hit = check_bug(tmp_path, "transformers_roformer_causal_lm_cached_decode_rotary_positions_restart",
                    "positions-vs-keys")[0]
    # a query at position 0 can count one key (its own place): the first key past it whose distance is lost
    assert tuple(hit["cell"]) == first((2, 1, 13), lambda b, q, k: k >= 1)
    assert "sees 13 keys" in hit["message"] and "sinusoidal_pos" in hit["message"]
    assert hit["expected"] == "position 12 or after"


def test_gptj_sincos_positions_restart_left_padded(tmp_path):
    """Written another way: a GPT-J-style joined `sincos` (an inv_freq module, read exactly), a dict config, SDPA behind
    a bool mask, prompts of 5 and 8 left-padded to 8: the first decode step numbers its token 0 while row 0's query
    sees its 6 real keys (3-8); the fix's cumsum positions stop where each row's real keys count."""
    hit = check_bug(tmp_path, "gptj_sincos_decode_positions_restart_left_padded", "positions-vs-keys", POSITIONS)[0]
    pads = (3, 0)
    assert tuple(hit["cell"]) == first((2, 1, 9), lambda b, q, k: k >= pads[b] + 1)
    assert "sees 6 keys" in hit["message"] and "sincos" in hit["message"]


def test_rerotated_rolling_cache_numbered_from_zero_is_quiet(tmp_path):
    """A rolling cache of unrotated keys re-rotated at 0..S-1 every step: positions restart at 0 yet reach as far as
    the keys count (the table read through inv_freq: its last position is the query's)."""
    status, found, report = traced(tmp_path, "quiet_sincos_rerotated_rolling_cache_positions_from_zero", False,
                                   POSITIONS)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report


def _tree_cells(parents: list[int], history: int) -> np.ndarray:
    """Bool (1, T, history + T): every node sees the history, itself and its ancestors (a double loop)."""
    n = len(parents)
    cells = np.zeros((1, n, history + n), dtype=bool)
    for i in range(n):
        cells[0, i, :history] = True
        j = i
        while j >= 0:
            cells[0, i, history + j] = True
            j = parents[j]
    return cells


def test_within_a_call_positions_follow_depths_not_indices():
    parents, history = [-1, 0, 1, 0, 3, 3], 4
    seen = _tree_cells(parents, history)
    placed = np.ones((1, len(parents)), dtype=bool)
    depths = np.array(_depths(parents))
    assert _within(seen, placed, history + depths[None]) is None
    b, j, i, more, moved = _within(seen, placed, history + np.arange(len(parents))[None])
    assert (b, j, i) == (0, 3, 0) and more == depths[3] - depths[0] and moved == 3


def test_within_a_call_a_sliding_window_and_packed_documents_are_quiet():
    """Keys a window drops are no earlier query's subset; a packed row's second document sees none of the first's."""
    q = np.arange(8)
    window = (q[None, :] <= q[:, None]) & (q[:, None] - q[None, :] < 3)
    assert _within(window[None], np.ones((1, 8), dtype=bool), q[None]) is None
    docs = (q[None, :] <= q[:, None]) & ((q[:, None] < 5) == (q[None, :] < 5))
    restart = np.where(q < 5, q, q - 5)
    assert _within(docs[None], np.ones((1, 8), dtype=bool), restart[None]) is None


def test_within_a_call_an_unpadded_row_kept_at_its_padded_positions_is_quiet():
    """Recurrent Memory Transformer's check (quiet_blind round 60): a segment [memory; real tokens; memory] with its pads
    taken out, every token kept at the position it had in the padded batch, causal over what is left. Adjacent queries
    one key apart sit several positions apart where pads were taken out (3 memory slots, 3 pads, 4 tokens): the places
    of tokens no longer there. A draft tree whose node sits at its index is still said (its parent is no neighbour)."""
    positions = np.array([[0, 1, 2, 6, 7, 8, 9, 13, 14, 15]])
    n = positions.shape[1]
    causal = np.tri(n, dtype=bool)[None]
    assert _within(causal, np.ones((1, n), dtype=bool), positions) is None
    parents, history = [-1, 0, 1, 0, 3, 3], 4
    assert _within(_tree_cells(parents, history), np.ones((1, 6), dtype=bool), history + np.arange(6)[None]) is not None


def test_specforge_eagle3_ttt_steps_rotated_at_step_zero_positions(tmp_path):
    """SpecForge#424 (written blind, batch blind-fp): EAGLE-3's sdpa LlamaAttention rotated every training-time-test
    step with position_ids where step lck stands for tokens lck further on (the flex path and mrope added lck). The
    trace reads the cos/sin factors the queries were multiplied by (trace/rotated.py): at each step after the first,
    the queries see the keys they saw at the step before and their own key of the step just cached, yet are rotated
    at the same positions 0..47. Its fix (position_ids + lck) is quiet, suspicious findings included (the finfo.min
    causal + padding sum keeps each row's own key finite: fill-became-inf no longer says it)."""


    name = "specforge_eagle3_sdpa_ttt_rope_positions_not_offset_by_step"
    hit = check_bug(tmp_path, name, "positions-vs-keys")[0]
    real = [[True] * 48, [True] * 40 + [False] * 8]  # the program's attention_mask
    # the reference, from the upstream code's meaning: at TTT step s query j sees step 0's keys 0..j, then its own key
    # of each later step cached (the scores' columns past 48, one a step: the last, this step's own, is left out as a
    # sink column by the trace); rotated at j, not j + s, it is the first real query to see a key appended after step 0
    # (step 2's call: 49 columns) whose position was not moved on
    assert tuple(hit["cell"]) == first((2, 48, 49), lambda b, q, k: k >= 48 and k - 48 == 0 and real[b][q])
    assert "rotated at the same positions as then" in hit["message"] and "1 more appended" in hit["message"]
    status, fixed, report = traced(tmp_path, name, True)
    assert status == 0 and [f for f in fixed if f["severity"] in ("wrong", "suspicious")] == [], report


def test_hass_draft_block_keys_rotated_at_step_zero_positions(tmp_path):
    """The same bug written another way: a dict config, SDPA over every step's keys laid block after block (step 0's
    causal block, then each later step's block on its diagonal), right padding, and a rotary module that rotates q and
    k itself (no table in the attention's frame: only the factors tell where the queries were rotated)."""
    name = "hass_draft_ttt_sdpa_block_keys_rope_not_offset_right_padded"
    hit = check_bug(tmp_path, name, "positions-vs-keys", POSITIONS)[0]
    real = [[True] * 12, [True] * 9 + [False] * 3]
    # step 1: query j sees step 0's keys 0..j and step 1's key 12 + j (its own draft); the first real query whose
    # appended key it sees, rotated at j rather than j + 1
    assert tuple(hit["cell"]) == first((2, 12, 24), lambda b, q, k: k == 12 + q and real[b][q])
    assert "rotated at the same positions as then (0 to 11)" in hit["message"]


def test_chunked_prefill_and_decode_rotated_further_on_are_quiet(tmp_path):
    """A prompt in equal chunks over a growing cache, then decode steps, two layers at one call site: each step that
    grew the cache moved the rotary positions by as many keys (the reference: the program's own arange per chunk)."""
    status, found, report = traced(tmp_path, "chunked_prefill_two_layers_rope_offset_quiet", False, POSITIONS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def _first_decode(prompts: list[list[int]]) -> list[tuple[int, int]]:
    """(right, wrong) position of each left-padded row's first decoded token: its prompt's real tokens, and the padded
    width (the keys its cache holds, pads included). The reference: the prompts as each program builds them."""
    width = max(map(len, prompts))
    return [(len(p), width) for p in prompts]


def test_mosaicgpt_decode_positions_count_the_left_padding(tmp_path):
    """mosaicml/examples#257 (written blind, batch blind-gf): MosaicGPT numbers its tokens in its own forward (`pos`,
    looked up in `wpe`; no position_ids handed to it) and sliced the pad column to the new tokens before counting, so
    a left-padded row's decode step sits at the padded width. Read off the model's forward (trace/positionsat.py): the
    module holds a position table, so the positions its forward numbers are the ones embedded."""
    hit = check_bug(tmp_path, "mosaic_gpt_kv_cache_left_pad_positions_cumsum_sliced_first", "positions-vs-keys")[0]
    right, wrong = _first_decode([[5, 17, 23, 8, 41, 12], [9, 30, 4]])[1]
    assert hit["expected"] == f"position {right}" and f"yet its position is {wrong}" in hit["message"]
    assert f"counts the row's {wrong - right} padding keys" in hit["message"] and hit["source"] == "pos held by MosaicGPT.forward"


def test_learned_positions_numbered_in_forward_count_the_left_padding(tmp_path):
    """Written another way (tests/data/positions): token and position tables in an `Embeddings` module, SDPA with a
    boolean mask, `position_ids` from the mask at the prompt and `past_length + arange` at decode."""
    hit = check_bug(tmp_path, "learned_positions_decode_counts_left_padding", "positions-vs-keys", POSITIONS)[0]
    right, wrong = _first_decode([[5, 7, 9, 11, 13], [21, 23]])[1]
    assert hit["expected"] == f"position {right}" and f"yet its position is {wrong}" in hit["message"]


def test_a_rotary_models_forward_positions_are_not_read_as_the_layers(tmp_path):
    """A module with no position table (SpecForge's EAGLE-3 draft: rotary, its layers rotate at position_ids + lck) holds
    positions in its forward that no layer need use as they are: its fix stays quiet (test above), and nothing held
    there is marked embedded."""
    import torch

    from maskcli.trace.positionsat import _embeds_positions

    assert not _embeds_positions(torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 2)))
    assert _embeds_positions(torch.nn.ModuleDict({"wpe": torch.nn.Embedding(4, 2)}))
    assert _embeds_positions(torch.nn.ModuleDict({"emb": torch.nn.ModuleDict({"position_embeddings": torch.nn.Embedding(4, 2)})}))


def test_blip2_text_positions_after_cached_learned_queries_are_quiet(tmp_path):
    """The Q-Former's image-grounded generation pass (tests/data/quiet_blind, written blind) caches its 8 learned
    queries, which have no position, and numbers its text from 0 in BertModel.forward (`pos` for
    `position_embeddings`): a text query sees the queries' keys and its own, more keys than its position counts, by
    design. A table's positions may number some of the tokens only: nothing is said."""
    status, found, report = traced(tmp_path, "blip2_qformer_itc_itm_itg_masks", False,
                                   Path(__file__).parent / "data" / "quiet_blind")
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def _starts(masks: list[list[int]]) -> list[tuple[int, int]]:
    """(row, column) of each sequence's first token in a batch of 0/1 key masks (the reference: a row's real tokens
    begin where its mask first holds 1)."""
    return [(b, row.index(1)) for b, row in enumerate(masks)]


def test_openrlhf_reward_and_critic_score_left_padded_rows_at_shifted_positions(tmp_path):
    """OpenRLHF/OpenRLHF#217 (written blind, batch blind-gh): the actor, reward model and critic forwards hand
    GPT2Model input_ids and attention_mask only; GPT-2 takes position_ids and numbers its columns when handed none, so
    the row left-padded by 4 embeds its first real token at position 4. Read off transformers' own GPT2Model.forward
    (trace/positionsat.py); the fix hands `attention_mask.cumsum(-1) - 1` and is quiet."""
    hit = check_bug(tmp_path, "openrlhf_reward_critic_left_padded_no_position_ids", "positions-vs-keys")[0]
    pads = _starts([[1] * 14, [0] * 4 + [1] * 10, [0] * 2 + [1] * 12])
    assert f"batch row 1: query {pads[1][1]} starts a sequence" in hit["message"]
    assert hit["expected"] == "position 0" and "GPT2Model.forward" in hit["source"]
    assert "the model takes position_ids and the call handed none" in hit["message"]


def test_llamafactory_neat_packing_numbers_each_packed_sample_on(tmp_path):
    """hiyouga/LlamaFactory#7318 (written blind, batch blind-gh): neat packing's block-diagonal 4D mask with no
    position_ids, so GPT-2 numbers the packed row 0..L-1 and the second sample of row 0 starts at the first one's
    length. The reference: the samples the program packs (prompt + response + eos tokens)."""
    import re

    hit = check_bug(tmp_path, "llamafactory_neat_packing_no_position_ids_gpt2", "positions-vs-keys")[0]
    lengths = {prompt + response + 1 for prompt, response in [(4, 5), (3, 4), (5, 6), (2, 3)]}
    column, position = (int(x) for x in re.search(r"batch row 0: query (\d+) starts a sequence .* at position (\d+),",
                                                  hit["message"], re.S).groups())
    assert column == position and column in lengths and hit["expected"] == "position 0"


def test_learned_positions_classifier_left_padded_without_position_ids(tmp_path):
    """Written another way (tests/data/positions): a hand-written scorer whose forward takes `position_ids=None` and
    numbers `arange(L)` when handed none, eager softmax over a finfo.min bias; the caller hands the mask only."""
    hit = check_bug(tmp_path, "learned_positions_classifier_left_padded_position_ids_not_handed", "positions-vs-keys",
                    POSITIONS)[0]
    b, j = _starts([[1] * 6, [0] * 2 + [1] * 4])[1]
    assert f"batch row {b}: query {j} starts a sequence (it sees only itself, and the next query sees it) at " \
           f"position {j}" in hit["message"] and hit["expected"] == "position 0"


def test_a_library_generation_loop_that_numbers_a_left_padded_prompt_is_quiet(tmp_path):
    """transformers' generate calls WhisperForCausalLM on left-padded prompts and hands its decoder no position_ids:
    the library's numbering, not the program's call (tests/data/positions, correct as written)."""
    status, found, report = traced(tmp_path, "quiet_whisper_decoder_generate_left_padded_prompt", False, POSITIONS)
    assert status == 0 and [f for f in found if f["code"] == "positions-vs-keys"] == [], report


def test_a_forward_that_takes_no_positions_states_its_own_numbering():
    """_accepts: the place of a positions parameter among a forward's arguments, None where it takes none (a
    hand-written GPT's `forward(idx)` numbers by column of its own statement)."""
    import torch

    from maskcli.trace.positionsat import _accepts

    class Takes(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, position_ids=None):
            return input_ids

    class Numbers(torch.nn.Module):
        def forward(self, idx):
            return idx

    assert _accepts(Takes().forward) == 2 and _accepts(Numbers().forward) is None


def _left_padded_jump(lengths: list[int], width: int, heads: int) -> tuple[int, int, int]:
    """(the call's folded row, the right position, the position handed) of the first left-padded row at the first
    decode step, by a loop: the step's position counted by the cache's length against the row's real tokens."""
    for b, n in enumerate(lengths):
        if n < width:
            return b * heads, n, width
    raise AssertionError


def test_xglm_left_padded_decode_positions_count_the_padding(tmp_path):
    """huggingface/transformers#22828 (written blind, round 52): before position_ids, XGLM numbered a cached step by the
    cache's length, so a left-padded row's first new token counts its pads; the eager softmax folds 2 heads into the
    batch (4 rows for the 2 prompts)."""
    [hit] = check_bug(tmp_path, "transformers_xglm_incoder_left_padded_decode_positions_count_pads", "positions-vs-keys")
    row, right, handed = _left_padded_jump([14, 6], 14, 2)
    assert hit["message"].startswith(f"batch row {row}: query 0 sees one key more than the site's previous step's last "
                                     f"query (at position {right - 1}), yet its position is {handed}, not {right}")


def test_folded_heads_decode_numbered_by_the_cache_length(tmp_path):
    """Written another way: a fairseq-style (B * H, L, L) softmax over a left-padded batch, each decode step handed
    `position = cache length`."""
    [hit] = check_bug(tmp_path, "folded_heads_left_padded_decode_positions_count_pads", "positions-vs-keys", POSITIONS)
    row, right, handed = _left_padded_jump([6, 3], 6, 2)
    assert f"batch row {row}: query 0" in hit["message"] and f"yet its position is {handed}, not {right}" in hit["message"]
    assert "counts the row's 3 padding keys" in hit["message"]


def _call(cells: np.ndarray):
    return SimpleNamespace(shape=(cells.shape[0], 1, *cells.shape[1:]))


def test_positions_are_laid_over_rows_folded_with_heads_or_tiled_as_the_masks_agree(monkeypatch):
    positions = np.array([[0, 1, 2], [-1, 0, 1]])
    real = np.array([[1, 1, 1], [0, 1, 1]], bool)
    causal = np.tril(np.ones((3, 3), bool))
    row = lambda b: causal & real[b][None, :]  # noqa: E731 - each prompt's mask, by its row
    interleaved = np.stack([row(b // 2) for b in range(4)])[:, None]  # (B * H): each row's heads together
    tiled = np.stack([row(b % 2) for b in range(4)])[:, None]  # (H * B): the batch repeated per head
    for cells, expected in ((interleaved, [positions[b // 2] for b in range(4)]),
                            (tiled, [positions[b % 2] for b in range(4)])):
        monkeypatch.setattr("maskcli.checks.positioned.keep", lambda call, cells=cells: cells)
        assert np.array_equal(_folded(_call(cells[:, 0]), positions), np.array(expected))
    mixed = np.stack([row(0), row(1), row(1), row(0)])[:, None]  # (neither: no reading)
    monkeypatch.setattr("maskcli.checks.positioned.keep", lambda call: mixed)
    assert _folded(_call(mixed[:, 0]), positions) is None


def test_a_diffusion_models_block_steps_over_a_dual_cache_are_quiet(tmp_path):
    """quiet-ye (written blind): Fast-dLLM's Dream decodes a left-padded batch block by block with a dual cache: each
    step's block of queries sees the prefix, itself and the cached suffix after it (both ways), then each prompt alone.
    No count of keys measures a position at such a site, and a square prefill of the next prompt starts a new cache.
    The program checks itself against each prompt decoded alone."""


    folder = Path(__file__).parent / "data" / "quiet_blind"
    status, found, report = traced(tmp_path, "quiet_fast_dllm_dream_dual_cache_left_padded_block_diffusion", False, folder)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert "MATCH\n" in report and "MISMATCH" not in report, report  # (the program's own comparison)


def test_both_ways_reads_real_queries_only():
    from maskcli.checks.positioned import _both_ways

    causal = np.tril(np.ones((4, 4), dtype=bool))[None]
    assert not _both_ways(causal, None)
    full = np.ones((1, 4, 4), dtype=bool)
    assert _both_ways(full, None)
    # left padding: the pad query (column 0) sees every key, as transformers unmasks a fully masked row; real ones causal
    padded = causal.copy()
    padded[0, 0, :] = True
    assert _both_ways(padded, None) and not _both_ways(padded, np.array([[False, True, True, True]]))


def test_image_tokens_sharing_one_position_decode_over_more_keys_than_positions(tmp_path):
    """CogAgent's scheme (quiet-yt, written blind: a false alarm before): the image's tokens share one rotary position,
    so a cached step's query sits at a position below the keys it sees; the model call states that position and the
    table holds it: quiet. The same program with the table built for the step's own token (position 0 only, the
    stated position 7 and after past it) is found, at the first key past the one position 0 can count."""


    name = "shared_image_position_cached_decode"
    status, found, report = traced(tmp_path, name, False, POSITIONS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    status, found, report = traced(tmp_path, name, False, POSITIONS, ("--table-for-step",))
    hits = [f for f in found if f["code"] == "positions-vs-keys" and f["severity"] == "wrong"]
    assert status == 1 and hits, report
    assert tuple(hits[0]["cell"]) == first((1, 1, 10), lambda b, q, k: k > 0) and "sees 10 keys" in hits[0]["message"]


def test_a_rows_positions_rise_between_its_real_queries_only():
    """360-LLaMA-Factory's zigzag ring (blind-gd's fix, flaky under load: positions-vs-keys): a rank's local causal
    step over its chunks 0 and 3, positions [0, 1, 2, 3, 12] then padding at 15, 15, 15. Its real queries' positions
    rise, skipping the places of the tokens other ranks hold: no finding. A real query's position that goes back
    among them is read."""
    from maskcli.checks.positioned import _within

    seen = np.tril(np.ones((8, 8), dtype=bool))[None]
    real = np.array([[1, 1, 1, 1, 1, 0, 0, 0]], dtype=bool)
    assert _within(seen, real, np.array([[0, 1, 2, 3, 12, 15, 15, 15]])) is None
    assert _within(seen, np.ones((1, 8), bool), np.array([[0, 1, 2, 3, 12, 13, 14, 15]])) is None
    assert _within(seen, np.ones((1, 8), bool), np.array([[0, 1, 2, 3, 12, 13, 14, 14]])) is not None


BLIND = Path(__file__).parent / "data" / "blind"


def test_a_multimodal_rope_step_rotated_below_its_key_count_is_no_lost_offset(tmp_path):
    """transformers#43952's Qwen2-VL port (written blind, batch blind-oj; positions-vs-keys on its fix too, a false
    alarm): the model call hands (4, B, 1) multimodal rope positions, and the image's tokens share positions, so the
    second prompt's first decode step sits at 11 over 15 keys. A key count says nothing of a query's place where the
    model call states multimodal rope positions: the fix is quiet. (Its buggy second generate, which hands (1, B, L)
    text positions plus a stale offset, is still told positions-vs-keys, though the place it names, 14 or after, is
    not the right one, 11: kept in tests/data/blind.)"""


    name = "transformers_qwen2_vl_second_generate_reuses_stale_rope_deltas"
    status, found, report = traced(tmp_path, name, True, BLIND)
    assert [f for f in found if f["code"] == "positions-vs-keys"] == [], report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_transformers_chunked_prefill_positions_from_cache_position(tmp_path):
    """transformers#43132 (written blind, batch blind-oo; missed before tuning): generate's chunked prefill handed each
    chunk `cache_position` for its position_ids, counting a left-padded row's 5 pads, where the decode steps number
    from the attention mask. Row 1's last chunk ends at position 9 over 5 real keys; its first decode step sees those
    and one more at position 5: the two steps number the row two ways. The fix (positions from the mask, sliced per
    chunk) is quiet."""
    hit = check_bug(tmp_path, "transformers_generate_chunked_prefill_position_ids_from_cache_position",
                    "positions-vs-keys", BLIND)[0]
    assert hit["message"].startswith("batch row 1: query 0 sees one key more than the site's previous step's last "
                                     "query (at position 9), yet its position is 5, not 10: the previous step's "
                                     "positions count the row's 5 padding keys")
    assert hit["expected"] == "one numbering: position 10 here, or 4 for the previous step's last query"


def test_chunked_prefill_positions_from_slots_then_decode_from_the_mask(tmp_path):
    """Written another way: a hand-rolled loop over a GPT-2-style model (a learned position table, eager softmax, a
    torch.cat cache) prefilling a left-padded batch in chunks of 4 numbered by cache slot, then decoding from
    `attention_mask.sum(-1) - 1`. Row 1 (3 pads, 4 real tokens) ends its prefill at slot 6, position 6, over 4 real
    keys; its first decode step is handed 4 = 5 real tokens - 1."""
    hit = check_bug(tmp_path, "chunked_prefill_positions_from_slots_decode_from_mask", "positions-vs-keys",
                    POSITIONS)[0]
    pads, real, width = 3, 4, 7
    last_prefill = width - 1  # slot numbering: the last prompt token's cache slot
    first_decode = real + 1 - 1  # attention_mask.sum(-1) - 1 after the new token's 1
    assert f"(at position {last_prefill}), yet its position is {first_decode}, not {last_prefill + 1}" in hit["message"]
    assert f"count the row's {pads} padding keys" in hit["message"]


def test_multimodal_rope_positions_of_a_text_count_as_1d_ones(tmp_path):
    """transformers#40490 (written blind, blind-qx; missed before tuning: multimodal rope's (C, B, L) positions were
    left alone): Qwen2.5-VL's decode steps added the left padding's rope_deltas to positions counted past the padding,
    so the padded row's new token sat its 7 pads before the keys it sees. A text's positions (each token's t, h, w
    rows equal) count as 1-D ones. Written another way (tests/data/positions): a hand-written 3-row multimodal rope
    decoder whose decode step adds the deltas to `cumsum(mask) - 1`; its fix (`cache length + deltas`) quiet."""
    status, found, report = traced(tmp_path, "transformers_qwen2_5_vl_decode_positions_from_padded_cumsum_plus_rope_deltas",
                                   False, Path(__file__).parent / "data" / "blind")
    hits = [f for f in found if f["code"] == "positions-vs-keys"]
    assert status == 1 and hits and "7 places short, as many as the row's 7 padding keys" in hits[0]["message"], report
    status, found, report = traced(tmp_path, "transformers_qwen2_5_vl_decode_positions_from_padded_cumsum_plus_rope_deltas",
                                   True, Path(__file__).parent / "data" / "blind")
    assert [f for f in found if f["severity"] == "wrong"] == [], report
    hit = check_bug(tmp_path, "mrope_text_decode_positions_padding_taken_off_twice", "positions-vs-keys", POSITIONS)[0]
    prompts = [[5, 9, 14, 3, 22, 7, 11], [8, 2, 30]]  # (the program's: row 1 has 7 - 3 = 4 pads)
    pads = len(prompts[0]) - len(prompts[1])
    assert f"it sits {pads} places short, as many as the row's {pads} padding keys" in hit["message"]


def test_optimum_ort_causal_lm_left_padded_generation_no_position_ids(tmp_path):
    """huggingface/optimum#1381 (89d08c4c; written blind, blind-re, caught before any rule changed for it): the ORT
    causal LM's generate handed its decoder no position_ids, so GPT-2's learned positions counted the left padding:
    row 1's prompt starts at position 4 (its 4 pads), row 0's at 0. The fix hands cumsum(mask) - 1: quiet."""
    hit = check_bug(tmp_path, "optimum_ort_causal_lm_left_padded_generation_no_position_ids", "positions-vs-keys")[0]
    pads = 4  # (the program's input_ids: row 1 is [pad] * 4 + 4 tokens)
    assert f"batch row 1: query {pads} starts a sequence" in hit["message"] and f"at position {pads}" in hit["message"]


def test_transformerlens_bridge_left_padded_batch_handed_no_position_ids(tmp_path):
    """TransformerLensOrg/TransformerLens#1609, fixed by #1610 (written blind, blind-sa, caught before any rule changed
    for it): TransformerBridge handed the wrapped GPT-2 a left-padded batch's attention_mask but no position_ids, so the
    shorter prompt's tokens were embedded at their columns. The fix derives them from the mask."""
    [hit] = check_bug(tmp_path, "transformerlens_bridge_left_padded_no_position_ids", "positions-vs-keys")
    assert tuple(hit["cell"]) == (1, 4, 4) and "counting 4 tokens before them they do not see" in hit["message"], hit


def test_executorch_llama2_cached_decode_freqs_cos_sliced_from_zero(tmp_path):
    """pytorch/executorch#2010, fixed by 027ad541b5 (written blind, blind-sx; caught once trace/ropeat.py read the
    `freqs_cos` / `freqs_sin` pair llama2.c's model names its real tables): Transformer.forward sliced the tables
    `[:seqlen]` with the cache on, so each token fed one at a time at start_pos was rotated at position 0. Step 1
    already sees 2 keys with the table of position 0. Kept in tests/data/blind."""
    hit = check_bug(tmp_path, "executorch_llama2_kv_cache_rope_sliced_from_zero", "positions-vs-keys", BLIND)[0]
    assert tuple(hit["cell"]) == (0, 0, 1) and "freqs_cos/freqs_sin of Attention.forward" in hit["message"], hit


def test_llama2c_style_decode_tables_sliced_from_zero(tmp_path):
    """Written another way: llama2.c's precomputed freqs_cos / freqs_sin buffers (interleaved pairs, no inv_freq:
    position 0 read alone), a batch of 2 prompts of 6 read at once (SDPA causal), then a cache grown by torch.cat.
    Each decode step slices the tables' first row: step 1's query sees 7 keys with the table of position 0."""
    hit = check_bug(tmp_path, "llama2c_style_decode_freqs_sliced_from_zero", "positions-vs-keys", POSITIONS)[0]
    # (a query at position 0 counts one key, its own place: the first key past it is the one whose distance is lost)
    assert tuple(hit["cell"]) == first((2, 1, 7), lambda b, q, k: k >= 1)
    assert "sees 7 keys" in hit["message"] and "freqs_cos/freqs_sin" in hit["message"], hit


def test_qwen2_vl_prompt_tuning_decode_positions_from_a_missing_cache_position(tmp_path):
    """huggingface/transformers#42508 (written blind, blind-sz, caught before any rule changed for it): under PEFT's
    prompt tuning (4 virtual tokens prepended as inputs_embeds, the mask extended, cache_position dropped) Qwen2-VL's
    decode delta fell to 0 with cache_position None, so every generated token was rotated at position 0. The fix
    counts the cache's length. Row 0 (left-padded) sees its 9 real cached tokens and itself at decode step 1."""
    hit = check_bug(tmp_path, "transformers_qwen2vl_peft_prompt_tuning_decode_positions_from_none_cache_position",
                    "positions-vs-keys")[0]
    message = " ".join(hit["message"].split())
    assert tuple(hit["cell"][:2]) == (0, 0) and "sees 10 keys" in message and "no position past 0" in message, hit


def _pad_starts(lengths: list[int], fixed: bool) -> list[int]:
    """The reference: each left-padded row's first real token's position, the pads counted (x-transformers' sign bug:
    arange + pads, so 2 * pads) or taken off (0)."""
    width = max(lengths)
    return [0 if fixed else 2 * (width - n) for n in lengths]


def test_x_transformers_abs_pos_emb_offset_by_the_pads_is_found_in_the_table_it_reads(tmp_path):
    """lucidrains/x-transformers 013e60a (written blind, blind-sw; missed before tuning: the positions are counted in
    AbsolutePositionalEmbedding.forward, a frame gone before attention runs): `pos + seq_start_pos` where the fix takes
    the pads off. The rows its table `pos_emb.emb` was read at (trace/tables.py, the table named by the module around
    it) number each row itself, and the rows' first real tokens sit apart: row 1 (5 pads) at 10, row 0 at 0."""
    hit = check_bug(tmp_path, "x_transformers_abs_pos_emb_left_pad_offset_sign", "positions-vs-keys", BLIND)[0]
    starts = _pad_starts([8, 3, 5], fixed=False)
    message = " ".join(hit["message"].split())
    assert f"query 5 starts a sequence (it sees only itself, and the next query sees it) at position {starts[1]}" \
        in message and "the program numbers each row itself" in message, hit
    assert tuple(hit["cell"]) == (1, 5, 5)


def test_a_position_module_that_adds_each_rows_pad_count_is_found(tmp_path):
    """Written another way: a reward model's `positional_embedding` module (its table named `table`) counts positions
    from the attention_mask in its own forward, adding each row's pad count where the fix counts the mask; SDPA with a
    boolean causal & padding mask. Row 1 (4 pads) starts at 8, row 0 (none) at 0; the fix starts every row at 0."""
    hit = check_bug(tmp_path, "reward_model_position_module_adds_pad_count", "positions-vs-keys", POSITIONS)[0]
    starts = _pad_starts([8, 4, 6], fixed=False)
    message = " ".join(hit["message"].split())
    assert f"batch row 1: query 4 starts a sequence" in message and f"at position {starts[1]}" in message, hit


def test_vllm_cpu_backend_prompts_run_before_the_decodes_they_follow_are_no_finding(tmp_path):
    """vllm-project/vllm#27035's fix (written blind, blind-ub): the CPU backend's prompt calls run before the decode
    kernel, while the batch's positions hold the decode tokens first. A per-request split laid over the calls in call
    order put a decode's position on a prompt's first token; each request's slice must rise one by one, else the
    calls are not in the tokens' order and no split is read."""
    status, found, report = traced(tmp_path, "vllm_cpu_sdpa_mixed_batch_prefill_reads_decode_rows", True, BLIND)
    assert status == 0 and not [f for f in found if f["severity"] == "wrong"], report


def test_xlm_roberta_xl_decode_positions_counted_from_the_last_token_alone(tmp_path):
    """huggingface/transformers#35044 (written blind, blind-uo, caught before any rule changed for it):
    XLMRobertaXLForCausalLM's prepare_inputs_for_generation handed no position_ids, so each decode step's position was
    counted by create_position_ids_from_input_ids over the last token alone: padding_idx + 1 + the cache's length, the
    left pads counted. The reference: row 1's prompt of 4 real tokens, left-padded to 9, sits at padding_idx + 1 ..
    padding_idx + 4; its first decode token belongs at padding_idx + 5 and is read at padding_idx + 1 + 9."""
    pad, width, real = 1, 9, 4
    hit = check_bug(tmp_path, "hf_xlm_roberta_xl_causal_lm_decode_positions_from_last_token_only",
                    "positions-vs-keys")[0]
    message = " ".join(hit["message"].split())
    assert f"batch row 1: query 0 sees one key more than the site's previous step's last query (at position " \
        f"{pad + real}), yet its position is {pad + 1 + width}, not {pad + real + 1}" in message, hit


def test_gluonnlp_gpt2_decode_offset_read_off_the_heads_axis(tmp_path):
    """dmlc/gluon-nlp#1015 (fixed by 86bd0800; written blind, blind-un, missed before tuning: the table `_pos_embed`,
    a private attribute, was not read as the model's position table): GPT2Model numbered a cached step from
    `states[0].shape[1]`, the heads (4), not the cached length (`shape[2]`). The reference: a 9-token prompt ends at
    position 8, so the first step belongs at 9 and is read at num_heads."""
    prompt, heads = 9, 4
    hit = check_bug(tmp_path, "gluonnlp_gpt2_decode_positions_from_num_heads", "positions-vs-keys")[0]
    message = " ".join(hit["message"].split())
    assert f"(at position {prompt - 1}), yet its position is {heads}, not {prompt}: the position does not move on" \
        in message, hit


def test_a_private_position_table_indexed_inline_off_the_cache_heads_axis(tmp_path):
    """gluon-nlp#1015 written another way (tests/data/positions): a hand-written GPT's `_position_embedding` indexed
    inline (no local of positions to read), SDPA, a (2, B, H, T, D) cache whose offset is read at `size(2)` (3 heads)
    where the fix reads `size(3)`. A prompt of 6: step 1 belongs at 6 and reads row 3."""
    prompt, heads = 6, 3
    hit = check_bug(tmp_path, "private_pos_table_decode_offset_from_cache_heads_axis", "positions-vs-keys",
                    POSITIONS)[0]
    assert f"(at position {prompt - 1}), yet its position is {heads}, not {prompt}" in " ".join(hit["message"].split())


def test_unsloth_position_ids_from_the_shared_cache_position_over_a_left_padded_batch(tmp_path):
    """unslothai/unsloth#4100's position_ids (written blind, blind-vg; missed before: the positions were handed, the same
    in every row, and only positions numbered row by row were asked where sequences start): the generation hook set
    `position_ids = cache_position`, so GPT-2's learned table read the left-padded prompt of 4 (padded to 8) from row
    4. The reference: its first real token at column 8 - 4, the unpadded row's at 0."""
    width, short = 8, 4
    hit = check_bug(tmp_path, "unsloth_fast_prepare_inputs_position_ids_from_cache_position_left_padded",
                    "positions-vs-keys")[0]
    message = " ".join(hit["message"].split())
    assert f"batch row 0: query {width - short} starts a sequence (it sees only itself, and the next query sees it) at " \
        f"position {width - short}, where batch row 1's query 0 starts one at 0" in message, hit
    assert "number every row's columns alike, its padding counted" in message, hit


def test_a_learned_table_handed_one_column_numbering_for_a_left_padded_batch(tmp_path):
    """unsloth#4100 written another way (tests/data/positions): a hand-written scorer's `pos_embedding` handed
    `arange(L).expand(B, L)` over prompts of 7 and 4 left-padded with 0, SDPA with a bool mask; the fix counts from the
    mask. Row 1's first token (column 3) reads row 3 of the table."""
    hit = check_bug(tmp_path, "learned_table_left_padded_prefill_positions_arange_expanded", "positions-vs-keys",
                    POSITIONS)[0]
    assert "batch row 1: query 3 starts a sequence" in " ".join(hit["message"].split()), hit


def test_codeparrot_gpt2_left_padded_completion_numbered_from_the_first_column(tmp_path):
    """huggingface/transformers#7552 (before it, GPT-2's prepare_inputs_for_generation handed no position_ids; written
    blind, blind-vj, caught before any rule changed for it): a CodeParrot-style GPT-2 completing left-padded prompts
    numbers each row from its first column, pads counted. The reference: a character tokenizer over the three prompts,
    so the shortest (row 2) starts at column max(len) - len."""
    prompts = ["def add(a, b):\n    return", "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) +",
               "import os\n"]
    pads = max(map(len, prompts)) - len(prompts[2])
    hit = check_bug(tmp_path, "codeparrot_gpt2_left_padded_batch_completion_positions_from_zero", "positions-vs-keys")[0]
    assert f"batch row 2: query {pads} starts a sequence (it sees only itself, and the next query sees it) at position " \
        f"{pads}, where batch row 1's query 0 starts one at 0" in " ".join(hit["message"].split()), hit


def test_mlx_vlm_qwen3_omni_thinker_decode_rotated_at_position_zero(tmp_path):
    """Blaizzy/mlx-vlm#1983 (fixed by #1993; written blind, blind-wa, caught before any rule changed for it): the thinker
    rebuilt its positions with get_rope_index on every call, so each cached decode token was rotated at position 0
    beside a 40-token prompt. The reference: the first decode step sees the prompt's 40 keys and its own."""
    hit = check_bug(tmp_path, "mlx_vlm_qwen3_omni_thinker_decode_rope_position_zero", "positions-vs-keys")[0]
    assert "query 0 of this cached step sees 41 keys" in " ".join(hit["message"].split()), hit


def test_decision_transformer_window_left_padded_counts_its_padding(tmp_path):
    """huggingface/transformers#17946 (written blind, blind-xv; missed before round 153): DecisionTransformerModel
    handed its GPT-2 no position_ids, so wpe numbered every (return, state, action) token of the blog's left-padded
    get_action window by its column. The reference: a window of 8 steps, 3 tokens a step, 7 of them padding at the
    first action (21 tokens), 6 at the second (18): one row a call, its start at 21 and then at 18. The fix (position
    ids of zeros) quiet."""
    found = check_bug(tmp_path, "hf_decision_transformer_gpt2_wpe_positions_over_left_padded_window", "positions-vs-keys")
    message = " ".join(found[0]["message"].split())
    assert "call 0's batch row 0: query 21 starts a sequence (it sees only itself, and the next query sees it) at " \
           "position 21, where call 2's batch row 0's query 18 starts one at 18" in message


def test_prompts_scored_one_at_a_time_left_padded_without_positions(tmp_path):
    """Written another way: GPT-2 under a reward head, one prompt a call left-padded to a window of 10 (3, 6 and 4
    tokens: starts at 7, 4 and 6), no position_ids. The fix (the mask's cumsum) quiet; a rotary Llama scored the same
    way is quiet either way (a row shifted whole is the same text)."""
    found = check_bug(tmp_path, "gpt2_scored_one_left_padded_prompt_at_a_time", "positions-vs-keys", POSITIONS)
    assert "query 7 starts a sequence (it sees only itself, and the next query sees it) at position 7, where call " \
           "2's batch row 0's query 4 starts one at 4" in " ".join(found[0]["message"].split())
    for args in (("llama",), ("llama", "--fixed")):
        status, found, report = traced(tmp_path, "gpt2_scored_one_left_padded_prompt_at_a_time", False, POSITIONS, args)
        assert status == 0 and not [f for f in found if f["code"] == "positions-vs-keys"], report


def test_opennmt_tf_lm_generated_tokens_numbered_from_one_after_the_context(tmp_path):
    """OpenNMT/OpenNMT-tf#498 (written blind, blind-th; missed before round 154): the language model ran its context
    at positions 1..8 and then numbered each generated token from 1 again (its sinusoidal timing signal added by a
    position encoder whose frame is gone before attention: trace/sinusoid.py reads the positions back from the values
    added). The fix (the step offset by the context's length) quiet."""
    found = check_bug(tmp_path, "opennmt_tf_lm_generate_from_context_step_positions_restart", "positions-vs-keys")
    assert "(at position 8), yet its position is 1, not 9" in \
        " ".join(found[0]["message"].split())


def test_a_sinusoid_table_added_from_row_zero_at_every_step_is_found(tmp_path):
    """Written another way: the Annotated Transformer's interleaved `pe` buffer, sliced `pe[:, :n]` at every cached
    step (a prompt of 6 at 0..5, each generated token at 0 again). The fix (sliced from the cache's length) quiet."""
    found = check_bug(tmp_path, "sinusoid_table_decode_restarts_at_zero", "positions-vs-keys", POSITIONS)
    assert "(at position 5), yet its position is 0, not 6" in " ".join(found[0]["message"].split())


def test_opennmt_py_lm_fix_leaves_a_position_unused(tmp_path):
    """OpenNMT/OpenNMT-py#2099 (written blind, blind-xx): before it, generated tokens were numbered from 1 after a
    prompt of 7 (positions 0..6); its fix hands `step + src_lengths[0]`, so the first generated token sits at 8, one
    past the position the cache's next key holds: a true finding on the fix too, upstream's code as shipped."""
    folder = Path(__file__).parent / "data" / "blind"
    name = "opennmt_py_lm_generate_step_positions_restart_after_prompt"
    messages = {}
    for fixed in (False, True):
        status, found, report = traced(tmp_path, name, fixed, folder)
        said = [" ".join(f["message"].split()) for f in found if f["code"] == "positions-vs-keys"]
        assert status == 1 and said, report
        messages[fixed] = said[0]
    assert "(at position 6), yet its position is 1, not 7" in messages[False]
    assert "(at position 6), yet its position is 8, not 7: the position is ahead of the keys it writes" in messages[True]


def test_nanovllm_decode_position_one_past_its_key(tmp_path):
    """GeeeekExplorer/nano-vllm#67 (written blind, blind-ys): prepare_decode numbered the sampled token len(seq), one
    past the slot its key is written to and the keys context_lens counts. Its attention written out per request, a
    (heads, Lq, Lk) softmax each (the heads read as the call's rows), the positions one flat list over the requests.
    The fix (len(seq) - 1) quiet."""
    found = check_bug(tmp_path, "nanovllm_decode_positions_one_past_last_token", "positions-vs-keys")
    assert "(at position 6), yet its position is 8, not 7" in " ".join(found[0]["message"].split())
