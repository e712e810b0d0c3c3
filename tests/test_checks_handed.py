"""checks/handed.py: the window the program holds on the way to the kernel, dropped on some path or narrower."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkbugs import caught, check_bug, first, traced

QUIET = Path(__file__).parent / "data" / "quiet"

BUGS = [
    # karpathy/nanochat#452: the SDPA fallback's Tq == 1 branch attends the whole cache (window_size=(8, 0) held)
    ("nanochat_sdpa_kvcache_decode_ignores_sliding_window", "window-dropped"),
    # flagos-ai/vllm-plugin-FL#489: q_len == 1 takes the unmasked path although window_left >= 0
    ("vllm_fl_txda_sdpa_decode_skips_window", "window-dropped"),
    # sgl-project/sglang#31501: the SWA paged prefill wrapper planned without window_left; the kernel is called per
    # query tile over all the keys, so the fix is quiet only where no query placing is assumed
    ("sglang_flashinfer_swa_paged_prefill_window_left_not_planned", "window-dropped"),
    # sgl-project/sglang#33601: an ENCODER_ONLY RadixAttention's sliding_window_size = 2 (|q - k| <= 2) handed on only
    # if causal: the local layers attend every key
    ("sglang_torch_native_encoder_sliding_window_gated_on_causal", "window-dropped"),
    # PrimeIntellect-ai/prime-rl#2352 / #2417 (blind-nf, caught before tuning): the ring-attention path writes the window
    # only under `window_size`, and FA3's forward names it window_size_left / _right: every rank attends causal
    ("prime_rl_ring_fa3_varlen_window_size_key_dropped", "window-dropped"),
    # allenai/OLMo-core#388: a mask cache keyed without the window hands layer 1 (window_size=(4, 0)) layer 0's window(2)
    ("olmo_core_torch_backend_window_mask_cache_key_no_window", "window-narrower"),
    # NVIDIA/TransformerEngine#1212: window_size=(2, 0) handed unchanged to cuDNN, whose left bound is exclusive
    ("transformer_engine_cudnn_window_left_exclusive", "window-narrower"),
    # tenstorrent/tt-metal#30362: the window's first tile fills its whole first face when the window starts at column
    # 15 (sliding_window = 64 and cur_pos = 78 held: 63 keys seen)
    ("tt_metal_paged_sdpa_decode_sliding_window_face_start", "window-narrower"),
    # openvinotoolkit/openvino#38034: partitions counted from max_context_len drop the shorter sequence's newest block
    # (sliding_window = 32 and seq_len = 41 held: 23 keys seen)
    ("openvino_paged_attention_swa_decode_partitions_from_max_context_len", "window-narrower"),
    # InternLM/lmdeploy#3772: the sliding-window block manager frees the blocks Gemma 3's global layer still reads
    # (window_size = -1 and kv_seqlens = 15 held: 11 keys seen)
    ("lmdeploy_gemma3_window_block_manager_frees_global_layers", "keys-dropped"),
    # unslothai/unsloth#4100: the decode step slices its cache with `1 - sliding_window` (sliding_window = 4 and
    # seq_len held: 3 keys handed and seen; written blind)
    ("unsloth_gemma2_decode_sliding_window_keeps_one_key_short", "window-narrower"),
    # labscommunity/cascadia#151: Gemma 4's export masks every layer with the plain causal mask, sliding ones too
    # (sliding_window = 3 and seq_len = 6 held in the layer forward: a prefill query sees 6 keys)
    ("cascadia_gemma4_export_sliding_layers_unwindowed", "window-dropped"),
]


def test_a_square_call_that_sees_later_keys_within_its_window_is_causalitys_to_say(tmp_path):
    """meta-pytorch/torchtune#1835 (written blind, batch blind-ao): Gemma2Attention's torch.where(sliding_mask == 1,
    mask, -2.38e38) makes the bool causal mask additive, so the band |q - k| < 4 is all visible. The window it holds
    (sliding_window_size = 4: a query at p sees p - 4 .. p) bounds the keys before a query, and no query reaches
    further back than that (a double loop over the band): the keys after it are a lost causality, which the loss's
    targets name (sees-its-target), not a dropped window."""
    check_bug(tmp_path, "torchtune_gemma2_sliding_mask_where_float_unmasks_future", "sees-its-target")
    _, found, _ = traced(tmp_path, "torchtune_gemma2_sliding_mask_where_float_unmasks_future", False)
    assert max(q - min(k for k in range(12) if abs(q - k) < 4) for q in range(12)) <= 4
    assert [f for f in found if f["code"] == "window-dropped"] == []


def test_transformer_engine_window_and_padding_masks_joined_with_and(tmp_path):
    """NVIDIA/TransformerEngine#1281 (written blind, blind-im, round 57; caught before tuning): the unfused backend's
    get_swa_mask joined the padding mask (True = masked) and the window's with AND, so a key was hidden only where it
    was both padding and outside window_size = (3, 0); "padding_causal" lost its causal part. Right-padded rows of 12,
    9 and 6 tokens: the first real query that sees a real key more than 3 before it, by a double loop over that mask."""
    [hit, *_] = check_bug(tmp_path, "transformer_engine_unfused_swa_padding_mask_combined_with_and", "window-dropped")
    lengths, window = [12, 9, 6], 3

    def seen(b, q, k):
        outside = not (q - window <= k <= q)
        return not (k >= lengths[b] and outside)  # (hidden only where padding AND outside the window)

    # (the keys after a query are causality's: the window bounds those before it)
    wide = first((3, 12, 12), lambda b, q, k: q < lengths[b] and seen(b, q, k) and k < q - window)
    assert tuple(hit["cell"]) == wide and "window_size = (3, 0)" in " ".join(hit["message"].split())


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


def test_a_left_padded_batch_through_an_eager_softmax_handed_window_size(tmp_path):
    """Written otherwise: a module keeps window_size=(3, 0) and hands it to its attention function; left-padded batch,
    eager softmax; the decode path masks the padding alone. Its first cell against a loop over absolute positions:
    at the first decode step (query 6 over keys 0..6) a real key more than 3 back."""
    hit = caught(tmp_path, "window_left_decode_softmax", ("window-dropped",))
    real = np.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=bool)
    b, q, k = first((2, 7, 7), lambda b, q, k: q == 6 and real[b, k] and q - k > 3)
    assert tuple(hit["cell"]) == (b, q, k) and hit["expected"] == "window(4)"


def test_a_global_layer_beside_a_local_one_keeps_no_window(tmp_path):
    """Gemma 2 style, hand-written: one attend() holds window_size=(3, 0) for every layer and the global layer passes
    use_window=False. Layer 0 keeps to the window at that step, so layer 1's causal mask is a choice per layer, not a
    window dropped on a path: no window-dropped (the decode shortcut that drops it is still caught above)."""
    status, found, report = traced(tmp_path, "window_held_global_layer", False, QUIET)
    assert [f for f in found if f["code"] == "window-dropped"] == [], report
    assert status == 0, report
    assert "window(4)" in report and " causal\n" in report


def test_query_tiles_of_a_chunked_prefill_that_drop_the_window(tmp_path):
    """Written otherwise: queries in tiles of 3 over every key of a right-padded batch (lengths 9 and 7), the function
    holding window_size=(2, 0); tiles after the first mask causality and padding alone. Where a tile's queries sit is
    nowhere stated (trace places them at the end of the keys); the span of keys a row sees says it. Its first cell
    against a loop over absolute positions: the first real query that sees a real key more than 2 back."""
    hit = caught(tmp_path, "window_tiles_prefill_drops_window", ("window-dropped",))
    lengths = (9, 7)
    b, q, k = first((2, 9, 9), lambda b, q, k: q >= 3 and k <= q < lengths[b] and q - k > 2)
    assert tuple(hit["cell"]) == (b, q, k) and hit["expected"] == "window(3)"


def test_a_left_padded_window_left_written_exclusive(tmp_path):
    """Written otherwise: a module keeps window_left = 3 and builds `j > i - window_left` for an eager softmax over a
    left-padded batch (3 pads in row 0): every query sees 3 keys, not 4. Its first cell against a loop over absolute
    positions: the first real key inside the held window (k >= q - 3) that the mask built (k > q - 3) hides, for a
    query whose window no sequence end cuts."""
    hit = caught(tmp_path, "window_left_exclusive_left_padded", ("window-narrower",))
    real = np.array([[0] * 3 + [1] * 7, [1] * 10], dtype=bool)
    start = real.argmax(axis=1)
    b, q, k = first((2, 10, 10), lambda b, q, k: real[b, q] and k == q - 3 and k >= start[b] and q < 9)
    assert tuple(hit["cell"]) == (b, q, k) and hit["expected"] == "window(4)"


def test_a_ring_buffer_decode_holding_a_plain_int_window(tmp_path):
    """Written otherwise: one query per step through an eager softmax over an 8-slot ring buffer (slots are not
    positions), `attend_step` holding window_size = 5 and start_pos, the bound written exclusive. Against a loop over
    absolute positions: the first step whose query sees fewer keys than min(W, p + 1)."""
    hit = caught(tmp_path, "window_int_decode_ring_exclusive", ("window-narrower",))
    for p in range(11):
        want = sum(1 for k in range(p + 1) if p - k < 5)
        seen = sum(1 for k in range(max(0, p - 7), p + 1) if p - k < 4)
        if seen < want:
            break
    assert f"query at position {p} sees {seen} " in hit["message"] and hit["expected"] == f"{want} keys"


def test_a_decode_cache_sliced_one_key_short_of_a_plain_int_window(tmp_path):
    """Written otherwise: SDPA handed no mask at each decode step, its keys sliced out of the growing cache by
    `start_pos - sliding_window + 2` (one too many cut), `sliding_window = 5` and `start_pos` held in the frame. Against
    a loop over absolute positions: the query at position 7 (a 7-token prompt) has 5 keys in its window; the slice
    hands it 4, every one seen."""
    hit = caught(tmp_path, "window_int_decode_keys_sliced_short", ("window-narrower",))
    p, window = 7, 5
    want = sum(1 for k in range(p + 1) if p - k < window)
    handed = len(range(p - window + 2, p + 1))
    assert f"the query at position {p} sees {handed} of the call's {handed} keys" in hit["message"]
    assert hit["expected"] == f"{want} keys" and "cut to fewer than the window" in hit["message"]


def test_a_global_layer_whose_cache_is_trimmed_to_the_local_window(tmp_path):
    """Written otherwise: per-layer dict caches trimmed after each step by one routine that cuts every layer to the
    window of 4, the global layer (`sliding_window = -1` beside `start_pos` in `attend`) included. Against a loop over
    absolute positions: the first decode step's global query (position 7 after a 7-token prompt) should see every
    position 0 .. 7; the trimmed cache holds the last 4 and its own."""
    hit = caught(tmp_path, "global_layer_cache_trimmed_to_window", ("keys-dropped",))
    p = 7
    want = sum(1 for k in range(p + 1) if k <= p)
    seen = sum(1 for k in range(p - 4, p + 1))
    assert f"the query at position {p} sees {seen} keys" in hit["message"] and hit["expected"] == f"{want} keys"


def test_two_branches_in_one_run_the_window_claims_one(tmp_path):
    """Native sparse attention (lucidrains' d1f5d41 fix, blind reproduction): one forward_inference attends the new
    token by a block-causal fine branch (up to its block of 4 keys) and a sliding branch (3 keys): the window claims
    the sliding branch, not the fine one (no window-dropped). Written otherwise: a prefill module holding
    window_size=(2, 0) sums a block-causal and a sliding SDPA over the same queries, quiet; with --drop its sliding
    branch masks causality alone, so no call of the run keeps to the window: still caught, its first cell against a
    loop over absolute positions."""
    blind = Path(__file__).parent / "data" / "blind"
    status, found, report = traced(tmp_path, "nsa_inference_fine_block_causal_window_off_by_one", True, blind)
    assert [f for f in found if f["code"] == "window-dropped"] == [] and status == 0, report
    status, found, report = traced(tmp_path, "window_and_block_branches", False, QUIET)
    assert [f for f in found if f["severity"] == "wrong"] == [] and status == 0, report
    status, found, report = traced(tmp_path, "window_and_block_branches", False, QUIET, ("--drop",))
    hits = [f for f in found if f["code"] == "window-dropped" and f["severity"] == "wrong"]
    assert status == 1 and len(hits) == 2, report
    assert tuple(hits[0]["cell"]) == first((2, 8, 8), lambda b, q, k: k <= q and q - k > 2 and q // 4 == k // 4)


def test_selected_blocks_gathered_per_position_are_another_branch(tmp_path):
    """lucidrains/native-sparse-attention-pytorch 36837b2 (written blind, batch blind-fv): SparseAttention holds
    sliding_window_size = 4; its sliding branch is a LocalAttention child, its fine branch scores keys gathered per
    position with einsum("bhgid,bhijd->bhgij") (read as 40 planes of 2 kv heads x 20 positions, 2 grouped-head
    queries each, its columns slots). Both runs were flagged window-dropped on that branch: its columns are no
    positions, and the layer's run keeps to the window in its child. Written otherwise: a layer holding
    sliding_window_size = 3 over a left-padded batch, its selected blocks gathered the same way beside an SDPA sliding
    child: quiet; with --drop the child masks causality and the padding only, and the sliding call alone is
    window-dropped, its first cell against a double loop over absolute positions."""
    for fixed in (True, False):
        status, found, report = traced(tmp_path, "nsa_interpolated_importance_score_selects_future_blocks", fixed)
        assert [f for f in found if f["code"] == "window-dropped"] == [], report
    windows = Path(__file__).parent / "data" / "windows"
    name = "selected_blocks_gathered_beside_sliding_submodule"
    status, found, report = traced(tmp_path, name, False, windows)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [] and status == 0, report
    status, found, report = traced(tmp_path, name, False, windows, ("--drop",))
    hits = [f for f in found if f["code"] == "window-dropped"]
    assert status == 1 and len(hits) == 1 and hits[0]["severity"] == "wrong", report
    lengths = (12, 9)
    real = lambda b, p: p >= 12 - lengths[b]  # noqa: E731 (left padding)
    assert tuple(hits[0]["cell"]) == first((2, 12, 12), lambda b, q, k: real(b, q) and real(b, k) and q - k > 3)
    assert "sliding_window_size = 3" in hits[0]["message"]


def test_a_right_padded_prefill_that_holds_a_plain_int_window_and_masks_causality(tmp_path):
    """Written otherwise: `attend` holds sliding_window = 4 beside kv_len (the model keeps it as `self.w`, no config
    field), SDPA with a boolean mask over a right-padded batch (lengths 9 and 6); the prefill branch masks causality
    and padding only. W keys or W + 1 by its convention: against a loop over absolute positions, the first real query
    that sees a real key more than 4 back."""
    hit = caught(tmp_path, "window_int_prefill_sdpa_unbanded", ("window-dropped",))
    lengths = (9, 6)
    b, q, k = first((2, 9, 9), lambda b, q, k: k <= q < lengths[b] and q - k > 4)
    assert tuple(hit["cell"]) == (b, q, k) and hit["expected"] == "window(4)"


def test_a_plain_int_window_chosen_per_layer_or_held_as_one_side_of_a_band(tmp_path):
    """Quiet: one attend() holds sliding_window = 3 for both layers and the global one masks causality alone (the
    local one keeps to the window over the same queries); and an encoder's sliding_window = 2 held as one side of
    |q - k| <= 2 (its queries see later keys)."""
    status, found, report = traced(tmp_path, "window_int_layers_and_band", False, QUIET)
    assert [f for f in found if f["code"] == "window-dropped"] == [] and status == 0, report
    assert "window(3)" in report and " causal" in report
    status, found, report = traced(tmp_path, "window_int_layers_and_band", False, QUIET, ("--symmetric",))
    assert [f for f in found if f["severity"] == "wrong"] == [] and status == 0, report
    assert "band(3)" in report


WINDOWS = Path(__file__).parent / "data" / "windows"


def test_keras_hub_flash_branch_returns_before_the_window(tmp_path):
    """keras-hub#2186: Gemma 2's flash branch returns before `_mask_sliding_window`; its `padding_mask` is True on the
    tokens (read so where the mask keeps to it exactly: checks/real.py), right-padded prompts of 8 and 6 in a cache of
    12. Query 4 of row 0 is the first real query that sees further back than sliding_window_size = 4 (read as
    p - 4 .. p). The fix's decode steps write into the shorter row's padded slots: no padding lost there."""
    found = check_bug(tmp_path, "keras_hub_gemma2_flash_branch_skips_sliding_window", "window-dropped")
    lengths, window = (8, 6), 4
    assert tuple(found[0]["cell"]) == first(
        (2, 12, 12), lambda b, q, k: k <= q < lengths[b] and k < lengths[b] and q - k > window)


def test_keras_hub_qwen3_sliding_window_condition_inverted(tmp_path):
    """keras-hub#2289 (commit cf8aedf; written blind, batch blind-db): Qwen3Attention's `if not
    self.sliding_window_size:` skips the band whenever a window is configured; rows of 12 and 9 tokens (the causal and
    padding mask of Qwen3Decoder), sliding_window_size = 4. The first real query that sees further back than p - 4, by
    a double loop."""
    found = check_bug(tmp_path, "keras_hub_qwen3_attention_sliding_window_condition_inverted", "window-dropped")
    lengths, window = (12, 9), 4
    assert tuple(found[0]["cell"]) == first(
        (2, 12, 12), lambda b, q, k: k <= q < lengths[b] and k < lengths[b] and q - k > window)


def test_an_sdpa_fallback_whose_window_condition_is_inverted(tmp_path):
    """Written another way than keras-hub#2289: `window_size = (3, 0)` held as FlashAttention holds it, an SDPA fallback
    that bands the mask only when no window is set, left-padded rows of 9, 6 and 4; the first real query that sees a
    real key further back than p - 3, by a double loop."""
    found = check_bug(tmp_path, "sdpa_fallback_window_condition_inverted_left_padded", "window-dropped", WINDOWS)
    lengths, size = (9, 6, 4), 9
    assert tuple(found[0]["cell"]) == first(
        (3, size, size), lambda b, q, k: size - lengths[b] <= k <= q and q - k > 3)


def test_flax_port_pad_mask_branch_drops_the_window(tmp_path):
    """Written another way: a Flax port's `pad_mask` (True on the tokens) whose padded branch leaves the window out;
    the first real query that sees a key further back than sliding_window_size = 3, by a double loop."""
    found = check_bug(tmp_path, "flax_port_pad_mask_branch_drops_window", "window-dropped", WINDOWS)
    lengths, window = (8, 5), 3
    assert tuple(found[0]["cell"]) == first(
        (2, 8, 8), lambda b, q, k: k <= q < lengths[b] and k < lengths[b] and q - k > window)


WINDOWS = Path(__file__).parent / "data" / "windows"


def test_a_window_held_both_ways_as_window_left_and_window_right(tmp_path):
    """Written otherwise (blind-ax's ModernBERT flash path, whose fix was called window-dropped): a local encoder layer
    holds window_left = 2 and window_right = 2 (|i - j| <= 2) over a right-padded batch (lengths 10, 6). The fix's band
    is quiet; the buggy fast path masks the padding alone. Its first cell against a loop over positions: the first real
    query that sees a real key more than 2 away either way."""
    hit = check_bug(tmp_path, "window_left_right_encoder_eager_softmax", "window-dropped", WINDOWS)[0]
    lengths = (10, 6)
    b, q, k = first((2, 10, 10), lambda b, q, k: q < lengths[b] and k < lengths[b] and abs(q - k) > 2)
    # (the finding names the query and the first key it sees: the buggy path's every real key, from 0)
    assert tuple(hit["cell"]) == (b, q, 0) and hit["expected"] == "band(3)"
    assert "window_left = 2 and window_right = 2" in hit["message"] and "p - 2 .. p + 2" in hit["message"]


def test_sglang_flashinfer_swa_extend_over_a_cached_prefix_drops_its_window(tmp_path):
    """sgl-project/sglang#26513 (written blind, blind-qo, caught before any rule changed for it): FlashInfer's extend
    over a cached prefix in a sliding-window model handed neither wrapper its window_left, so the ragged pass over the
    step's own 6 keys lets query 4 see keys 0 .. 4, five real keys where RadixAttention's sliding_window_size 3 spans
    four. The fix (window_left on both, the paged pass cut to the prefix's last window) is quiet (test_checks_owncut)."""
    hits = check_bug(tmp_path, "sglang_flashinfer_swa_ragged_prefix_extend_paged_reads_unwritten_slots", "window-dropped")
    assert tuple(hits[0]["cell"]) == (0, 4, 0) and "sliding_window_size = 3" in hits[0]["message"], hits


def test_a_mask_keeping_the_configs_sliding_window_beside_a_flash_tuple_one_wider(tmp_path):
    """eole's SelfMHA (written as a correct program, quiet-r107a; told window-narrower before): the module holds
    `window_size = (sliding_window, 0)` for its FlashAttention path (W + 1 keys) while its CPU mask path keeps
    `q - sliding_window + 1 .. q`, the W keys the config's `sliding_window` counts (transformers' Mistral): the mask
    keeps a window the program states, so it is no narrower window than held. A mask narrower than both stays found
    (nanochat's and the other bugs above)."""
    status, found, report = traced(tmp_path, "quiet_eole_left_pad_sliding_window_chunked_prefill_dynamic_cache_greedy",
                                   False, Path(__file__).parent / "data" / "quiet_blind")
    assert (status, [f for f in found if f["severity"] in ("wrong", "suspicious")]) == (0, []), report


def test_transformer_engine_decoder_layer_self_attention_gets_the_enc_dec_window(tmp_path):
    """NVIDIA/TransformerEngine#1069 (a326e351; written blind, blind-rj, caught before tuning with a false alarm on its
    fix): TransformerLayer handed its self-attention `enc_dec_window_size`, so the causal window (2, 0) it holds was
    dropped, and its cross-attention kept its own "no_mask" type. The fix's cross-attention was told window-dropped
    against the layer's self-attention window: its MultiheadAttention says `attention_type="cross"`, four modules up
    from TE's `nn.Softmax` (trace/crossing.py no longer counts torch's leaf modules), so it is read as cross-attention."""
    found = check_bug(tmp_path, "transformer_engine_decoder_layer_self_attn_gets_enc_dec_window", "window-dropped")
    assert all(f["cell"] is None or f["cell"][1] >= 3 for f in found)  # (queries 3 on: a window of 3 cuts there)


def test_image_blocks_both_ways_inside_a_one_sided_window(tmp_path):
    """Gemma 3's sliding layers (gemma_pytorch, written blind, quiet-r117b, a false alarm): an image's tokens attend
    each other both ways and the window (3, 0) bounds only the keys before a query, so an image token's span runs
    past the window's width through the later tokens of its image. Those keys are causality's business, not the
    window's: the prefill is quiet, and the decode shortcut that drops the window (nanochat#452's) is still found.
    Its first cell against a loop over absolute positions: the first decode query (position 11) and a real key more
    than 3 back, in the unpadded row 0."""
    hit = check_bug(tmp_path, "image_block_sliding_layer_decode_drops_window", "window-dropped",
                    Path(__file__).parent / "data" / "handed")[0]
    real = np.array([[1] * 11, [0, 0, 0] + [1] * 8], dtype=bool)
    b, _, k = first((2, 1, 11), lambda b, q, k: real[b, k] and 11 - k > 3)
    assert tuple(hit["cell"]) == (b, 11, k) and hit["expected"] == "window(4)", hit


def test_megatron_bridge_gemma2_sliding_window_built_only_with_a_mask(tmp_path):
    """NVIDIA-NeMo/Megatron-Bridge#4308, fixed by c60434f90 (written blind, blind-sv, caught before any rule changed for
    it): Gemma2DotProductAttention built the sliding-window mask only `if attention_mask is not None`, and pretraining
    hands none, so the sliding layers (window_size = (8, 0) here) attended the whole causal prefix. By a double loop
    over that causal prefix of 20 unpadded tokens: the first query that sees a key more than 8 back."""
    hit = check_bug(tmp_path, "megatron_bridge_gemma2_swa_gate_skipped_without_attention_mask", "window-dropped")[0]
    b, q, k = first((2, 20, 20), lambda b, q, k: k <= q and q - k > 8)
    assert tuple(hit["cell"]) == (b, q, k) and hit["expected"] == "window(9)", hit


def test_jax_local_window_size_dropped_where_no_mask_is_given(tmp_path):
    """jax-ml/jax#32300 (written blind, blind-yw): jax.nn.dot_product_attention's XLA path returned the scores early
    where no mask, no is_causal and no lengths were given, never reading `local_window_size`: a local encoder's
    softmax (by hand, masking nowhere) attended every frame. jax's (left, right) window, an int both ways, is read
    from the frames (trace/windows.py); a site that masks nowhere is judged where it holds one. Written another way:
    an SDPA helper that builds the window only beside a given mask. The fixes quiet."""
    found = check_bug(tmp_path, "jax_dot_product_attention_local_window_dropped_without_mask", "window-dropped")
    assert "local_window_size = (2, 2) (a query at p sees keys p - 2 .. p + 2), but query 0 of batch row 0 sees keys " \
           "0 .. 9" in " ".join(found[0]["message"].split())
    found = check_bug(tmp_path, "local_window_size_dropped_where_no_mask_is_given", "window-dropped", WINDOWS)
    assert "local_window_size = (3, 3)" in " ".join(found[0]["message"].split())
