"""checks/cachedpositions.py: a cached step's stated query positions against the positions its prefill cached keys at."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

HERE = Path(__file__).parent / "data" / "cachedpositions"


def test_opentau_pi05_action_expert_positions_start_inside_the_cached_prompt(tmp_path):
    """TensorAuto/OpenTau#72 (written blind, batch blind-fn): pi05's denoise step numbered the action chunk from
    sum(prefix_pad_masks[:, :-discrete_action_max_length]), so its queries (keys [chunk | cached prefix], eager
    attention) sat at position 14 among the cached image + prompt tokens at 0..19 (row 0) and 0..14 (row 1). Fix
    (sum of the whole pad mask) quiet."""
    found = check_bug(tmp_path, "opentau_pi05_denoise_action_expert_positions_skip_prompt", "positions-inside-cache")
    images, lengths, chunk, prompt, dropped = 8, [12, 7], 8, 12, 6
    width = images + prompt

    def bad(b, q, k):  # key column k >= chunk is cached token k - chunk, at position k - chunk where it is real
        j = k - chunk
        start = images + min(lengths[b], prompt - dropped)  # the buggy count: the prompt's last 6 columns dropped
        return 0 <= j < images + lengths[b] and j >= start  # (every query of the chunk at start or after: q = 0 first)

    assert tuple(found[0]["cell"]) == first((2, chunk, chunk + width), bad)
    assert "the step's positions start inside the cache's" in found[0]["message"]


def test_a_soft_prompts_decode_positions_that_forget_the_prefix_are_found(tmp_path):
    """The same slip written another way: a soft prompt of 6 learned embeddings before left-padded text, a hand-kept
    cache (the cache's keys first), SDPA with a boolean mask, rotary positions counted inside the model from a start
    (GPT-2's past_length + arange); the decode loop starts each new token at the text's length alone. Fix (the whole
    prompt's count) quiet."""
    found = check_bug(tmp_path, "soft_prompt_decode_positions_skip_prefix_sdpa", "positions-inside-cache", folder=HERE)
    prefix, texts, width = 6, [7, 4, 2], 13

    def bad(b, q, k):  # key column k: a real prompt token at position k - pads where k >= pads
        pads = width - prefix - texts[b]
        return pads <= k < width and k - pads >= texts[b] + q  # the buggy position: the text's length, no prefix
    assert tuple(found[0]["cell"]) == first((3, 1, width + 1), bad)
    assert "real token the prefill at step 0 cached at position" in found[0]["message"]


def test_a_decode_numbered_after_every_cached_token_is_quiet(tmp_path):
    """A correct program of the same shape: an eager-softmax LM over a left-padded batch whose pad tokens carry
    position 1 (HF's masked_fill(mask == 0, 1)), decoding each token after every real token of its row: no finding."""
    status, found, report = traced(tmp_path, "left_padded_decode_pad_positions_one", False, HERE)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_cache_begun_anew_after_a_reference_run_at_the_same_layer_is_quiet(tmp_path):
    """DeepSparse's fixed-shape engines (written blind, quiet-r72b, a false alarm): a reference run of one prompt (all
    at once, positions 0..8) and then the next prompt's engine calls at the same layer, on a blank cache of fixed
    columns. The new prompt's first call sees none of the keys the reference cached, so its cache is no longer that
    run's: its decode steps, numbered after its own 3 tokens, were judged against the reference's positions 0..8. The
    program flagged so before (tests/data/cachedpositions, written another way) is quiet, and matches its prompt run
    alone."""
    status, found, report = traced(tmp_path, "static_columns_new_prompt_after_a_reference_run", False, HERE)
    assert status == 0 and not [f for f in found if f["code"] == "positions-inside-cache"], report
    assert "matches B alone" in report, report


BLIND = Path(__file__).parent / "data" / "blind"


def test_fla_upper_layers_rotated_one_past_the_cache_at_each_step(tmp_path):
    """fla-org/flash-linear-attention#477 (written blind, batch blind-nt; missed before positions-past-cache): the
    cache counted a step's token as soon as layer 0 stored it, so every later layer read `seqlen_offset =
    get_seq_length()` one on and rotated the first decode step's query at 13 over a 12-token prompt cached at 0..11.
    The offset is a local its attention layer read off the cache (trace/positionsat.OFFSETS). Fix (counted once every
    layer stored) quiet."""
    found = check_bug(tmp_path, "fla_cache_seen_tokens_counted_at_layer0_shifts_upper_rope", "positions-past-cache",
                      folder=BLIND)
    assert found[0]["message"].startswith("batch row 0: query 0 of step 1, the first after the prefill at step 0, is "
                                          "at position 13 (seqlen_offset of Attention.forward), yet the prefill's last "
                                          "real token sits at position 11")
    assert found[0]["expected"] == "position 12"


def test_a_start_pos_counted_after_the_new_token_was_appended_is_found(tmp_path):
    """The same slip written another way: a Meta-llama-style `forward(tokens, start_pos)` with a cache that appends
    each call's keys, driven by a loop that appends the new token and then hands `start_pos=len(sequence)`: the first
    step sits at 9 over a prompt cached at 0..7 (both rows). Fix (`len(sequence) - 1`) quiet, and its last step
    matches an uncached pass."""
    found = check_bug(tmp_path, "start_pos_counted_after_append_llama_loop", "positions-past-cache", folder=HERE)
    assert "is at position 9 (start_pos of Attention.forward)" in found[0]["message"], found[0]["message"]
    assert "position 8 is skipped" in found[0]["message"]
    _, _, report = traced(tmp_path, "start_pos_counted_after_append_llama_loop", True, HERE)
    assert "last step matches an uncached pass: True" in report


def test_bigdl_llm_gptj_speculative_positions_from_the_caches_head_axis(tmp_path):
    """intel/ipex-llm#10141 (1508d6b; written blind, blind-qu, caught before any rule changed for it): BigDL-LLM's
    self-speculative decoding counted GPT-J's position_ids from `past_key_values[0][0].size(1)`, the cache's head axis
    (4 heads) rather than its 12 cached tokens: step 1's query 0 sits at position 4 and sees the key the prefill
    cached there."""
    hit = check_bug(tmp_path, "bigdl_llm_gptj_speculative_cpu_position_ids_from_head_dim", "positions-inside-cache")[0]
    assert tuple(hit["cell"]) == (0, 0, 4) and "not after its 12 real tokens" in hit["message"], hit


def test_a_draft_tree_checked_by_a_longer_plain_pass_is_quiet(tmp_path):
    """EAGLE-2's dynamic draft tree (written blind, quiet-r115a, a false alarm): the draft checked itself with a plain
    causal pass over a longer chain at its layer, then drafted on from its own shorter cache, several nodes a depth at
    one position; the tree steps were judged against the check's positions. Written another way
    (tests/data/cachedpositions): a prompt's cache of 9, a check of 12, then two nodes a depth. The first step has
    fewer keys than the check's and its own, so the cache the tree grows is not the check's."""
    status, found, report = traced(tmp_path, "draft_tree_checked_by_a_plain_pass_first", False, HERE)
    assert status == 0 and not [f for f in found if f["code"].startswith("positions-")], report


def _first_key_at_or_after(cached: list[int], position: int) -> int:
    """The reference: the first cached key column whose position is the query's or later (a token not before it)."""
    return next(j for j, p in enumerate(cached) if p >= position)


def test_tiny_llm_decode_offset_numbered_inside_the_prompt(tmp_path):
    """skyzh/tiny-llm#65 (written blind, blind-tw; missed before tuning): the loop started at `offset = tokens.size`
    and advanced by the sampled token's size, so the prompt of 10 was rotated at [10, 20) and the first decoded token
    at 11. `offsets`, an int the attention's `__call__` was handed three frames out from its softmax helper
    (trace/positionsat.py), states the queries' position. The fix (offset 0, advanced by each call's tokens) quiet."""
    found = check_bug(tmp_path, "tinyllm_kv_cache_decode_offset_restarts_inside_prompt", "positions-inside-cache",
                      BLIND)
    prompt = 10
    assert tuple(found[0]["cell"]) == (0, 0, _first_key_at_or_after(list(range(prompt, 2 * prompt)), prompt + 1))
    assert f"is at position {prompt + 1} (offsets of Qwen2MultiHeadAttention.__call__)" in " ".join(
        found[0]["message"].split())


def test_an_mlx_ports_decode_offset_counting_generated_tokens_only_is_found(tmp_path):
    """Written another way: plain classes with __call__ handed `offset`, a softmax helper of the port's own, a cache
    grown by torch.cat; the loop hands each step the tokens generated so far, so the first generated token sits at 1
    inside the prompt's 0..6. The fix (prompt length + generated) quiet."""
    found = check_bug(tmp_path, "mlx_port_offset_counts_generated_tokens_only", "positions-inside-cache", HERE)
    assert tuple(found[0]["cell"]) == (0, 0, _first_key_at_or_after(list(range(7)), 1))


def test_tiny_llm_draft_steps_numbered_at_the_first_drafts_position_are_found(tmp_path):
    """skyzh/tiny-llm 4bd66e0, #83 (written blind, blind-vk; missed before): draft_generate handed every drafted token
    the same `offset`, so from the second draft on each query sat at the first draft's position while the draft cache
    held that draft's key there. Judged against every key the steps since the prefill cached, each at the position its
    step stated (the prefill alone says nothing: the first draft is right). The fix (current_offset += 1) quiet."""
    found = check_bug(tmp_path, "tinyllm_speculative_draft_generate_offset_not_advanced", "positions-inside-cache")
    prompt = 7  # (the draft's prefill: positions 0..6; the first draft cached at 7)
    assert tuple(found[0]["cell"]) == (0, 0, _first_key_at_or_after(list(range(prompt + 1)), prompt))
    assert "a real token step 1 cached at position 7" in " ".join(found[0]["message"].split())


def test_a_start_pos_frozen_after_the_first_decode_step_is_found(tmp_path):
    """Written another way: Meta's-Llama-style `forward(tokens, start_pos)` with a cache grown by torch.cat; the greedy
    loop computes the first new token's position once and hands it to every step. Step 2's query sits at 6 and sees
    key 6, step 1's own. The fix (start_pos + step) quiet."""
    found = check_bug(tmp_path, "decode_start_pos_frozen_after_first_step", "positions-inside-cache", HERE)
    prompt = 6
    assert tuple(found[0]["cell"]) == (0, 0, _first_key_at_or_after(list(range(prompt + 1)), prompt))
    assert f"is at position {prompt} (start_pos of Attention.forward)" in " ".join(found[0]["message"].split())
