"""checks/dropped.py: what the program said of its attention that never reached the kernel (a causal flag in its
config, a mask it handed in), each caught in the published bug's reproduction (tests/data/bugs) and in a program
written another way (tests/data/dropped), quiet on the fixes; the flagged cell against a double loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkbugs import check_bug, first, traced

BLIND = Path(__file__).parent / "data" / "blind"
DROPPED = Path(__file__).parent / "data" / "dropped"
QUIET = Path(__file__).parent / "data" / "quiet"


def test_an_export_wrappers_forced_causal_mask_that_masks_nothing_is_found(tmp_path):
    found = check_bug(tmp_path, "torch_to_nnef_export_causal_mask_from_batch_dim", "causal-config-ignored")
    b, q, k = first((1, 3, 5), lambda b, q, k: k > q + 2)  # 3 new queries after 2 cached keys: positions 2..4
    assert tuple(found[0]["cell"]) == (b, q + 2, k)
    assert "force_causal_mask=True (wrapper (SimpleNamespace) in main()" in found[0]["message"]


def test_a_dataclass_causal_flag_on_a_padded_batch_masked_only_by_padding_is_found(tmp_path):
    found = check_bug(tmp_path, "causal_args_padding_only", "causal-config-ignored", folder=DROPPED)
    lengths = (6, 4)  # right-padded: row 1's keys 4, 5 are padding, never judged
    assert tuple(found[0]["cell"]) == first((2, 6, 6), lambda b, q, k: q < lengths[b] and k < lengths[b] and k > q)
    assert "causal=True (self.args of Block (ModelArgs))" in found[0]["message"]


def test_an_entity_mask_a_flash_path_never_passes_is_found(tmp_path):
    found = check_bug(tmp_path, "veomni_flux_flash_path_drops_entity_mask", "mask-argument-dropped")
    assert "attn_mask of flash_attention()" in found[0]["message"]
    b, q, k = found[0]["cell"]
    assert k <= q  # what the kernel (causal) sees there and the entity mask masks: a cell below the diagonal


def test_an_additive_4d_mask_read_as_a_keep_mask_by_a_dit_is_found(tmp_path):
    # nishide-dev/unturtle#56 (written blind, blind-hu, round 54; caught before tuning): MDLM-DiT's
    # _normalize_attention_mask took a 4-D additive float mask (0 keep, the float minimum masked) for a bool keep-mask:
    # its SDPA sees the very cells the program's mask masks
    [hit, *_] = check_bug(tmp_path, "unturtle_mdlm_dit_additive_4d_mask_read_as_keep_mask", "mask-argument-dropped")
    assert "the mask was inverted on its way to the kernel" in hit["message"]


def test_autogptq_fused_attention_prefill_that_runs_is_causal_without_the_padding_mask_is_found(tmp_path):
    # AutoGPTQ/AutoGPTQ#483 (commit ccb6386; written blind, blind-ih, round 57; caught before tuning): the fused Llama
    # attention's prompt pass called SDPA with attn_mask=None, is_causal=True, and LlamaModel's causal + padding mask
    # was dropped; a left-padded batch of prompts of 9 and 4 tokens
    [hit, *_] = check_bug(tmp_path, "autogptq_fused_llama_attn_prefill_drops_padding_mask", "mask-argument-dropped")
    assert "attention_mask of forward()" in hit["message"]
    pad = [[False] * 9, [True] * 5 + [False] * 4]
    assert tuple(hit["cell"]) == first((2, 9, 9), lambda b, q, k: k <= q and pad[b][k] and not pad[b][q])


def test_an_alibi_bias_the_mha_fast_path_cast_to_bool_is_found(tmp_path):
    """pytorch#107084 (written blind, blind-io, round 58; caught after tuning): nn.MultiheadAttention's native path in
    eval took a float ALiBi attn_mask, merged it with the key padding and cast it to bool in masked_softmax: every
    nonzero bias cell masked, each real query left its own key alone (the diagonal, where ALiBi is 0)."""
    status, found, report = traced(tmp_path, "pytorch_mha_fast_path_float_alibi_bias_cast_to_bool", False, BLIND)
    [hit] = [f for f in found if f["code"] == "mask-argument-dropped"]
    lengths = [10, 7, 4]
    # the first cell the bias keeps (a real key) that the kernel masks (any but the diagonal), by a double loop
    assert status == 1 and tuple(hit["cell"]) == first((3, 10, 10), lambda b, q, k: k < lengths[b] and k != q), report
    assert "nonzero = masked" in " ".join(hit["message"].split())
    status, found, report = traced(tmp_path, "pytorch_mha_fast_path_float_alibi_bias_cast_to_bool", True, BLIND)
    assert not [f for f in found if f["code"] == "mask-argument-dropped"], report


def test_an_alibi_bias_handed_to_sdpa_as_bool_is_found_and_its_fix_quiet(tmp_path):
    """Written another way: the bias plus -inf padding handed to SDPA as `attn_bias.bool()`, which keeps every nonzero
    cell (the padding too) and masks the zero diagonal."""
    status, found, report = traced(tmp_path, "alibi_bias_handed_to_sdpa_as_bool", False, DROPPED)
    [hit] = [f for f in found if f["code"] == "mask-argument-dropped"]
    lengths = [7, 5, 3]
    assert status == 1 and tuple(hit["cell"]) == first((3, 7, 7), lambda b, q, k: k < lengths[b] and k == q), report
    assert "nonzero = kept" in " ".join(hit["message"].split()) and "60 cells" in " ".join(hit["message"].split())
    status, found, report = traced(tmp_path, "alibi_bias_handed_to_sdpa_as_bool", True, DROPPED)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_opennmt_flash2_branch_that_drops_the_source_padding_mask_is_found(tmp_path):
    # OpenNMT/OpenNMT-py#2484 (written blind, blind-ia, round 55; caught before tuning, its fix then a false alarm): the
    # flash2 branch called `flash_attn_func(..., causal=False)` for encoder self-attention and context attention, no
    # mask; its fix hands SDPA `~mask` there and keeps the decoder's self-attention is_causal beside its padded
    # dec_mask, whose padding queries alone see what dec_mask masks (quiet now: their outputs are never read)
    [hit, *_] = check_bug(tmp_path, "opennmt_py_flash2_context_attention_drops_src_pad_mask", "mask-argument-dropped")
    assert "the mask was dropped on its way to the kernel" in hit["message"]


def test_a_decoder_run_is_causal_beside_its_padded_square_mask_is_quiet(tmp_path):
    """Written another way (OpenNMT#2464's fix): dec_mask = padding | future, (B, 1, T, T), and SDPA is_causal=True
    over a right-padded batch. A real query sees exactly its dec_mask row; only a padding query (its own key masked in
    every row of its batch row) sees cells dec_mask masks, and those are not judged."""
    status, found, report = traced(tmp_path, "decoder_is_causal_beside_padded_square_mask_correct", False, DROPPED)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_fairseq_encoder_layer_that_never_passes_its_context_mask_is_found(tmp_path):
    """fairseq#1339/#1682 (written blind): TransformerEncoderLayer converts attn_mask to -1e8 and calls self_attn
    without it. Its fix passes it: quiet, though a padding query whose window holds only padding keys is left with
    the -1e8 keys alone (uniform weights there, as MHA computes: no NaN, no alarm)."""
    found = check_bug(tmp_path, "fairseq_vggtransformer_encoder_layer_drops_context_attn_mask", "mask-argument-dropped")
    left, right = 2, 1  # transformer_context=(4, 2) over a subsampling of 2
    assert tuple(found[0]["cell"]) == first((2, 10, 10), lambda b, q, k: not q - left <= k <= q + right)
    assert "attn_mask of forward()" in found[0]["message"]


def test_a_folded_padding_mask_a_helper_never_passes_is_found(tmp_path):
    found = check_bug(tmp_path, "folded_padding_mask_not_passed", "mask-argument-dropped", folder=DROPPED)
    pads = (0, 2, 1)  # left padding: the first pads[b] keys of row b
    assert tuple(found[0]["cell"]) == first((3, 5, 5), lambda b, q, k: k < pads[b])
    assert "bias_mask of attend()" in found[0]["message"]



@pytest.mark.parametrize("name, sizes", [("mistral_inference_pixtral_block_mask_not_passed", (6, 4)),
                                         ("mistral_inference_pixtral_vision_block_drops_image_mask", (12, 4)),
                                         ("mistral_inference_pixtral_vision_encoder_block_mask_not_passed", (12, 8, 9))])
def test_a_block_diagonal_image_mask_object_a_block_never_passes_is_found(tmp_path, name, sizes):
    found = check_bug(tmp_path, name, "mask-argument-dropped")  # mistral-inference#218, written by three writers
    assert "mask of forward() (BlockDiagonalMask)" in found[0]["message"]
    image = [i for i, size in enumerate(sizes) for _ in range(size)]  # each patch's image: only its own are seen
    n = sum(sizes)
    assert tuple(found[0]["cell"]) == first((1, n, n), lambda b, q, k: image[q] != image[k])


def test_a_block_diagonal_causal_bias_object_a_fast_path_drops_is_found(tmp_path):
    found = check_bug(tmp_path, "packed_block_causal_bias_object_not_passed", "mask-argument-dropped", folder=DROPPED)
    doc = [0] * 3 + [1] * 4 + [2] * 2  # the kernel is causal only: a query sees the earlier documents' keys
    assert tuple(found[0]["cell"]) == first((1, 9, 9), lambda b, q, k: k <= q and doc[k] != doc[q])
    assert "attn_bias of attend() (BlockDiagonalCausalMask)" in found[0]["message"]
    assert "sees 26 of those cells" in found[0]["message"]  # every earlier-document cell at or below the diagonal


def test_a_block_diagonal_object_is_read_as_its_blocks_against_a_double_loop():
    import torch

    from maskcli.trace.given import block_diagonal

    class BlockDiagonalMask:
        def __init__(self, seqlens):
            self.seqlens = seqlens

    class BlockDiagonalCausalMask(BlockDiagonalMask):
        pass

    sizes = (2, 3, 1)
    doc = [i for i, n in enumerate(sizes) for _ in range(n)]
    start = [doc.index(d) for d in doc]
    for cls, causal in ((BlockDiagonalMask, False), (BlockDiagonalCausalMask, True)):
        keep = block_diagonal(cls(list(sizes)), 6, 6) == 0
        for q in range(6):
            for k in range(6):
                assert bool(keep[q, k]) == (doc[q] == doc[k] and (not causal or k - start[k] <= q - start[q]))
    assert block_diagonal(BlockDiagonalMask([2, 3]), 6, 6) is None  # blocks over other keys: not this call's
    assert block_diagonal(type("Segments", (), {"seqlens": [3, 3]})(), 6, 6) is None  # not named a block mask
    assert torch.isinf(block_diagonal(BlockDiagonalMask([3, 3]), 6, 6)[0, 3])

def test_the_cells_a_kernel_sees_of_a_handed_mask_are_counted_against_a_double_loop():
    import numpy as np
    import torch

    from maskcli.trace.given import dropped

    b, h, n = 2, 2, 5
    given = torch.zeros(b, 1, n, n)
    given[1, :, :, :2] = float("-inf")  # row 1: keys 0, 1 padding
    given[1, :, 0, :] = float("-inf")  # and its query 0 masked whole (unmasked on purpose by transformers: not judged)
    causal = np.tril(np.ones((n, n), bool))[None, None]  # the kernel: causal only, the padding dropped
    lost = dropped(("attn_mask of f()", given), lambda: causal, (b, h, n, n), {}, "k")
    bad = [(r, q, k) for r in range(b) for q in range(n) for k in range(n)
           if k <= q and given[r, 0, q, k] == float("-inf") and not (given[r, 0, q] == float("-inf")).all()]
    assert lost["cells"] == len(bad) and tuple(lost["cell"][i] for i in (0, 2, 3)) == bad[0]
    kept = np.broadcast_to(causal & (given.numpy() == 0), (b, 1, n, n))  # a kernel that keeps to the mask
    assert dropped(("attn_mask of f()", given), lambda: kept, (b, h, n, n), {}, "k2") is None


def test_a_key_padding_mask_as_long_as_the_queries_is_read_per_batch_row_too():
    """candle's e5 BertModel (written blind, blind-zo; mask-argument-dropped on the fix before): the layers are handed
    the (B, L) additive mask, 1.0 real and -inf pad, with B == L == 8, and add it as (B, 1, 1, L). Read only as (Lq, Lk),
    row b of the batch was taken for query b. The kernel keeps to its per-row reading: nothing dropped; a kernel that
    drops it is still found."""
    import numpy as np
    import torch

    from maskcli.trace.given import dropped

    n, h = 4, 2
    lengths = [4, 3, 2, 4]
    given = torch.tensor([[1.0 if k < lengths[b] else float("-inf") for k in range(n)] for b in range(n)])
    kept = np.array([[[[k < lengths[b] for k in range(n)]] * n] for b in range(n)])  # (B, 1, Lq, Lk)
    assert dropped(("attention_mask of forward()", given), lambda: kept, (n, h, n, n), {}, "k") is None
    everything = np.ones((1, 1, n, n), bool)
    lost = dropped(("attention_mask of forward()", given), lambda: everything, (n, h, n, n), {}, "k2")
    assert lost is not None  # (said by the reading that loses the fewest cells: here the one of queries by keys)
    b, q, k = (lost["cell"][i] for i in (0, 2, 3))
    assert k >= lengths[q]


def test_candle_e5_bert_example_runs_the_padded_batch_without_a_mask(tmp_path):
    # huggingface/candle#1085 (written blind, batch blind-zo; caught before any rule changed for it, but its fix drew
    # mask-argument-dropped: the (8, 8) key padding mask read as queries by keys)
    check_bug(tmp_path, "candle_pyo3_e5_bert_padded_batch_no_attention_mask", "padding-ignored")


@pytest.mark.parametrize("name", ["encoder_decoder_causal_config", "vlm_causal_config_vision_tower"])
def test_a_module_that_says_it_is_not_causal_speaks_for_itself(tmp_path, name):
    """One config says causal=True (a dataclass, a dict), but the encoder's (the vision tower's) attention module holds
    causal = False and attends both ways, as encoders do: no causal-config-ignored, not even suspicious, while the
    decoder is causal (torch.tril)."""
    status, found, report = traced(tmp_path, name, False, QUIET)
    assert [f for f in found if f["code"] == "causal-config-ignored"] == [], report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert status == 0, report
    assert "causal" in report and "full" in report


def _either_side(pad: list[list[int]]):
    """bad(b, q, k) of a bool key mask read either way round: query q and key k on opposite sides of row b's padding
    (one a pad, the other real), which a kernel that drops the mask lets the query see."""
    return lambda b, q, k: pad[b][q] != pad[b][k]


def test_diffusers_flux_attn_processor_drops_attention_mask(tmp_path):
    """huggingface/diffusers#11065: FluxAttnProcessor2_0 takes the [B, 1, 1, txt + img] bool mask from
    joint_attention_kwargs but calls SDPA without it, so the T5 padding stays visible in joint attention (written
    blind, batch blind-x; missed before, caught by reading the bool mask the processor was handed either way round).
    Its fix passes attn_mask=attention_mask: quiet."""
    [hit] = check_bug(tmp_path, "diffusers_flux_attn_processor_drops_attention_mask", "mask-argument-dropped")
    assert "attention_mask of __call__() (bool, read either way round)" in hit["message"]
    text = [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]]
    pad = [[1 - t for t in row] + [0] * 4 for row in text]  # the 4 image tokens are real
    b, q, k = hit["cell"]
    assert _either_side(pad)(b, q, k) and pad[b][q] == 0  # (read True = keep: a real query sees a padded key)


def test_a_bool_pad_mask_whose_fill_is_discarded_is_found(tmp_path):
    """Written another way (tests/data/dropped): the other polarity (True = padding), left-padded, an eager softmax, the
    mask named `mask` as (B, 1, 1, L), dropped by a masked_fill that is not in place. The fix assigns it: quiet."""
    found = check_bug(tmp_path, "bool_pad_mask_fill_discarded", "mask-argument-dropped", folder=DROPPED)
    [hit] = found
    assert "mask of attend() (bool, read either way round)" in hit["message"]
    pad = [[0, 0, 0, 0, 0], [1, 1, 0, 0, 0]]  # lengths 5 and 3 of 5, padded on the left
    # (said as read True = padding, the reading that keeps more tokens' own cells: a real query that sees a pad)
    assert tuple(hit["cell"]) == first((2, 5, 5), lambda b, q, k: not pad[b][q] and pad[b][k])


# an additive mask with axes of 1 between its batch and its cells (MaxText's (b, 1, 1, t, s), a grouped-query port's
# (batch, 1, 1, q, k)) is read as the (batch, 1, q, k) mask it broadcasts as (trace/given.py)

def test_maxtext_cudnn_te_causal_ignores_segment_mask(tmp_path):
    """AI-Hypercomputer/maxtext#878: the segment-aware mask handed to Transformer Engine's DotProductAttention with
    attn_mask_type="causal", which ignores it: packed documents see each other (written blind, batch blind-u; caught once
    the (b, 1, 1, t, s) layout was read). Fix ("padding_causal") quiet. The first cell against a double loop over the
    segment ids and the causal triangle: a query that sees an earlier key of another segment."""
    found = check_bug(tmp_path, "maxtext_cudnn_te_causal_ignores_segment_mask", "mask-argument-dropped")
    seg = [[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 2, 2, 2]]
    assert "mask of __call__()" in found[0]["message"]
    assert tuple(found[0]["cell"]) == first((2, 8, 8), lambda b, q, k: k <= q and seg[b][q] != seg[b][k] and seg[b][q] != 0)


def test_a_grouped_query_ports_five_axis_bias_dropped_for_is_causal_is_found(tmp_path):
    """The same bug written otherwise: a -1e9 `attn_bias` (batch, 1, 1, q, k) of a grouped-query port, dropped on its
    fused SDPA path for is_causal=True."""
    from checkbugs import caught

    hit = caught(tmp_path, "extended_additive_mask_dropped_for_is_causal", ("mask-argument-dropped",))
    assert "attn_bias of attend()" in hit["message"]


def test_a_three_axis_mask_is_read_per_batch_row_or_per_head_against_a_double_loop():
    """A (N, Lq, Lk) additive mask: torch broadcasts it over the heads, but a program that unsqueezes it (or adds it
    to scores permuted batch-first) applies it per batch row; either reading the kernel keeps to is no drop."""
    import numpy as np
    import torch

    from maskcli.trace.given import dropped

    b = h = 2
    n = 5
    lengths = (5, 3)
    given = torch.tensor([[[0.0 if q < lengths[r] and k < lengths[r] else -1e9 for k in range(n)] for q in range(n)]
                          for r in range(b)])  # (B, L, L), per batch row
    per_row = np.array([[[[q < lengths[r] and k < lengths[r] for k in range(n)] for q in range(n)]] for r in range(b)])
    assert dropped(("mask of f()", given), lambda: per_row, (b, h, n, n), {}, "rows") is None
    per_head = np.transpose(per_row, (1, 0, 2, 3))  # (1, H, L, L): as torch broadcasts it over the heads
    assert dropped(("mask of f()", given), lambda: per_head, (b, h, n, n), {}, "heads") is None
    everything = np.ones((1, 1, n, n), bool)  # a kernel that drops it: row 1's real queries see keys 3, 4
    lost = dropped(("mask of f()", given), lambda: everything, (b, h, n, n), {}, "none")
    bad = [(r, q, k) for r in range(b) for q in range(n) for k in range(n) if q < lengths[r] <= k]
    assert lost["cells"] == len(bad) and (lost["cell"][0], *lost["cell"][2:]) == bad[0]  # (said per batch row)


def test_a_batch_mask_unsqueezed_over_as_many_heads_as_rows_is_quiet(tmp_path):
    """Written after the kannada translator's fix (tests/data/blind, ajhalthor/Transformer-Neural-Network#15, which
    adds its (B, L, L) mask to scores permuted batch-first): a (B, L, L) -1e9 padding mask unsqueezed over the heads,
    batch size = head count, kept by the kernel: no mask-argument-dropped (it was read per head before)."""
    status, found, report = traced(tmp_path, "batch_mask_unsqueezed_heads_equal_batch", False, QUIET)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert status == 0, report
def test_tei_qwen3_equal_length_batch_without_its_causal_bias_is_found(tmp_path):
    """huggingface/text-embeddings-inference a361df6 (written blind): the causal bias added only to a padded batch's
    bias, so an equal-length batch attends both ways; the model's own `use_bidirectional_attention=False` says causal,
    and the same layers run causal for a lone text (calls of the very site: wrong, not suspicious)."""
    found = check_bug(tmp_path, "tei_candle_qwen3_equal_length_batch_no_causal", "causal-config-ignored")
    assert tuple(found[0]["cell"]) == first((2, 7, 7), lambda b, q, k: k > q)
    assert "use_bidirectional_attention=False (self.use_bidirectional_attention=False of Qwen3Model)" in found[0]["message"]


def test_a_causal_word_lost_on_a_padded_batch_at_the_same_layers_is_found(tmp_path):
    """Written another way: `use_bidirectional_attention=False` in a dataclass held as `self.config`, SDPA with
    is_causal=True for a lone text and the padding mask alone for a right-padded batch (lengths 5, 3)."""
    found = check_bug(tmp_path, "causal_lost_on_padded_batch", "causal-config-ignored", folder=DROPPED)
    lengths = (5, 3)
    assert tuple(found[0]["cell"]) == first((2, 5, 5), lambda b, q, k: q < lengths[b] and k < lengths[b] and k > q)
    assert "use_bidirectional_attention=False (self.config of Embedder (EmbedConfig))" in found[0]["message"]


def test_ipex_llm_first_token_sdp_causal_drops_mask(tmp_path):
    """intel/ipex-llm#11153: the first token's SDPA path runs is_causal alone and drops the padding mask (batch blind-
    ah); written blind and caught before any rule was changed for it. The fix is quiet."""
    check_bug(tmp_path, "ipex_llm_first_token_sdp_causal_drops_mask", "mask-argument-dropped")


def test_is_causal_the_program_set_on_a_transformers_config_is_its_own_word(tmp_path):
    """FGA-DIKU/BONSAI#343 (written blind, batch blind-an): `config.is_causal = True` on a ModernBertConfig, whose class
    defines no such field, and a ModernBertModel that never reads it: the encoder attends both ways. The field is the
    program's, set on the very config its layers are built from, so it speaks over transformers' ModernBertAttention's
    hard-coded is_causal=False. The fix hands the layers causal masks (its sliding one |q - k| <= 4 and causal: 5 keys,
    no off-by-one: test_checks_config.py)."""
    [hit] = check_bug(tmp_path, "corebehrt_modernbert_is_causal_update_attention_mask_never_called", "causal-config-ignored")
    b, q, k = first((2, 8, 8), lambda b, q, k: k > q)
    assert tuple(hit["cell"]) == (b, q, k) and "ModernBertConfig" in hit["source"]


def test_is_causal_passed_to_a_transformers_config_it_does_not_define_is_read(tmp_path):
    """Written another way (tests/data/addedfields): `BertConfig(..., is_causal=True)` over a right-padded batch, a
    BertModel that never reads it; the fix's own 4-D causal mask is quiet."""
    check_bug(tmp_path, "ehr_bert_config_is_causal_kwarg_unread", "causal-config-ignored",
              Path(__file__).parent / "data" / "addedfields")


def test_only_fields_a_transformers_config_class_defines_nowhere_are_the_programs():
    """configread.added: BertConfig defines is_decoder (a class field) and no is_causal; one set on it is added, and a
    program's own class's fields are read by its __init__'s parameters and its class attributes."""
    BertConfig = pytest.importorskip("transformers").BertConfig

    from maskcli.checks.configread import added

    config = BertConfig(is_causal=True)
    assert config.is_causal is True and added(config, ["is_causal", "is_decoder"]) == ("is_causal",)

    class Own:
        sliding_window = 4

        def __init__(self, is_causal=True):
            self.is_causal, self.causal = is_causal, True

    assert added(Own(), ["is_causal", "sliding_window", "causal"]) == ("causal",)


def test_dreamer4_encoder_attend_fn_built_without_its_causal_kwargs_is_found(tmp_path):
    """lucidrains/dreamer4#2: encode() builds `attend_kwargs = dict(causal=True, ...)` and then the attend fn without
    it, so no call of the encoder's softmax site ever masks (engine.py sets such sites apart). The dict's own name says
    it is the attention's. Against a double loop over the 15 tokens: the first cell of a later key."""
    [hit] = check_bug(tmp_path, "dreamer4_video_tokenizer_encoder_attend_not_causal", "causal-config-ignored")
    assert tuple(hit["cell"]) == first((1, 15, 15), lambda b, q, k: k > q)
    assert "causal=True (attend_kwargs (dict) in encode()" in hit["message"]


def test_attention_options_at_the_top_of_the_program_never_passed_are_found(tmp_path):
    """Written otherwise (tests/data/dropped): `attention_opts = {"causal": True, "dropout": 0.0}` at the main module's
    top level (no field names attention: the variable's name does), a functional matmul-softmax attention the blocks
    call without it, two equal-length rows. The fix passes `**attention_opts`: quiet."""
    [hit] = check_bug(tmp_path, "attention_opts_causal_never_passed", "causal-config-ignored", folder=DROPPED)
    assert tuple(hit["cell"]) == first((2, 9, 9), lambda b, q, k: k > q)
    assert "causal=True (attention_opts (dict) at the top of" in hit["message"]


def test_tei_qwen3_equal_length_batch_written_blind_is_found(tmp_path):
    """huggingface/text-embeddings-inference#882 (blind-ax; the same bug as tei_candle_qwen3_equal_length_batch_no_causal
    by another hand): the causal bias added only onto a padding bias; the config class states
    use_bidirectional_attention = False. Against a double loop over the 6 tokens: the first later key seen."""
    [hit] = check_bug(tmp_path, "tei_qwen3_equal_length_batch_drops_causal_mask", "causal-config-ignored")
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: k > q)


def test_a_group_isolation_mask_handed_on_through_kwargs_that_the_layer_never_reads_is_found(tmp_path):
    # HXMap/MapQR#12: MapTRv2Head's (36, 36) bool self_attn_mask (True = masked) reaches DetrTransformerDecoderLayer
    # only in **kwargs; its self-attention reads attn_masks (None): one2one queries (the first 3 * 4) see one2many ones
    found = check_bug(tmp_path, "mapqr_one2many_self_attn_mask_dropped", "mask-argument-dropped")
    group = lambda i: i // 4 < 3  # noqa: E731 - (one2one polyline points first)
    assert tuple(found[0]["cell"]) == first((1, 36, 36), lambda b, q, k: group(q) != group(k))
    assert "self_attn_mask in **kwargs" in found[0]["message"]


def test_a_keep_mask_parameter_named_self_attention_mask_that_sdpa_is_never_handed_is_found(tmp_path):
    found = check_bug(tmp_path, "group_detr_keep_mask_parameter_unused", "mask-argument-dropped", folder=DROPPED)
    assert tuple(found[0]["cell"]) == first((2, 10, 10), lambda b, q, k: q // 5 != k // 5)
    assert "self_attention_mask of forward()" in found[0]["message"]


def test_diffusers_npu_backend_additive_text_mask_cast_to_bool_and_inverted(tmp_path):
    # huggingface/diffusers#14397 (written blind, batch blind-br): dispatch_attention_fn hands the LTX-2 cross-attention
    # the additive [B, 1, 1, S_text] bias; the npu path casts it to bool and inverts it for a kernel that discards True,
    # so the 12 video queries see exactly the padded text tokens (rows of 5 and 7 real tokens of 8)
    found = check_bug(tmp_path, "diffusers_npu_backend_additive_mask_cast_to_bool_inverted", "mask-argument-dropped")
    real = (5, 7)
    padded = [(b, q, k) for b in range(2) for q in range(12) for k in range(8) if k >= real[b]]
    b, q, k = first((2, 12, 8), lambda b, q, k: (b, q, k) in padded)
    assert tuple(found[0]["cell"]) == (b, q, k)
    assert f"sees {len(padded)} of those cells" in found[0]["message"] and "inverted on its way" in found[0]["message"]
    assert "attn_mask of dispatch_attention_fn()" in found[0]["message"]


def test_an_extended_additive_mask_cast_to_bool_for_sdpa_over_a_padded_batch(tmp_path):
    found = check_bug(tmp_path, "bert_fused_path_extended_mask_to_bool", "mask-argument-dropped", folder=DROPPED)
    real = (6, 3, 4)  # row 0 unpadded: the mask keeps every key of it, so no row of it is read
    padded = [(b, q, k) for b in range(3) for q in range(6) for k in range(6) if k >= real[b]]
    assert tuple(found[0]["cell"]) == first((3, 6, 6), lambda b, q, k: (b, q, k) in padded)
    assert f"sees {len(padded)} of those cells" in found[0]["message"] and "inverted on its way" in found[0]["message"]


HANDED = Path(__file__).parent / "data" / "handedmask"


def test_a_local_window_mask_a_decoder_layer_rebinds_to_none_is_found(tmp_path):
    # samvanstroud/hepattn#148 (written blind, batch blind-ch): the decoder hands each layer its local phi-window
    # cross-attention mask, (1, 8 queries, 32 hits) bool, but layers built with mask_attention=False rebind
    # `attn_mask = None`: the mask is read from the layer's module call (torch's _call_impl frame), and its
    # cross-attention keeps to neither reading of it
    [hit] = check_bug(tmp_path, "hepattn_local_strided_ca_window_mask_dropped", "mask-argument-dropped")
    assert "attn_mask of MaskFormerDecoderLayer's call (bool, read either way round)" in hit["message"]
    window = set()  # each query i at hit 4i (stride 32 / 8), window_size 4: hits 4i-2 .. 4i+2, wrapping around
    for i in range(8):
        for d in range(-2, 3):
            window.add((i, (4 * i + d) % 32))
    assert len(window) == 40 and f"{len(window)} cells masked" in hit["message"]  # (its True cells, read as masked)
    b, q, k = hit["cell"]
    assert b == 0 and (q, k) in window


def test_a_padded_sector_mask_a_latent_block_rebinds_to_none_is_found(tmp_path):
    """Written another way (tests/data/handedmask): a Perceiver's latents over a right-padded batch of point clouds, an
    eager softmax, the (B, latents, points) mask (True = masked) handed positionally to blocks that drop it."""
    [hit] = check_bug(tmp_path, "perceiver_latent_block_rebinds_cross_mask_to_none", "mask-argument-dropped",
                      folder=HANDED)
    assert "cross_attn_mask of LatentBlock's call (bool, read either way round)" in hit["message"]
    kept = 0  # the sector cells each latent keeps, by a double loop over the two clouds (20 and 13 points)
    for length in (20, 13):
        share = length / 4
        for i in range(4):
            for k in range(20):
                kept += max(0, int(i * share - share)) <= k < min(length, int((i + 2) * share) + 1)
    masked = 2 * 4 * 20 - kept
    counts = {2 * kept, 2 * masked}  # (either reading, over the 2 heads)
    assert any(f"{n} cells masked" in hit["message"] for n in counts)


# one sample's mask taken for the whole batch: the kernel applies row r of the handed mask to every batch row

def test_octo_pytorch_encoder_block_takes_the_first_samples_mask_for_the_batch(tmp_path):
    """s1lent4gnt/octo-pytorch 3380db5 (written blind, batch blind-co): Encoder1DBlock reduces the BlockTransformer's
    (batch, 1, seq, seq) bool mask to `attention_mask[0, 0]`, so samples 1 and 2, whose first timestep is padding,
    attend with sample 0's mask (before: mask-argument-dropped said the mask was dropped). Fix: the mask expanded per
    head and handed whole: quiet. The cell against a double loop over the block rules and the timestep padding."""
    [hit] = check_bug(tmp_path, "octo_pytorch_encoder_block_first_sample_attention_mask_for_batch", "mask-argument-dropped")
    assert "only batch row 0's mask reached the kernel" in hit["message"]
    group = [-1] * 3 + [0, 0, 0, 1, 1, 1]  # 3 task tokens, then per timestep 2 obs tokens and a readout token
    readout = [False] * 3 + [False, False, True] * 2
    first_step_padded = [True] * 3 + [False, False, True] + [True] * 3  # (samples 1 and 2: timestep 0's obs padding)
    real = [[True] * 9, first_step_padded, first_step_padded]

    def rule(q, k):  # task: causal over the task; obs: task and obs of its timestep or before; readout: all of those
        if group[q] < 0:
            return group[k] < 0
        return group[k] <= group[q] and (not readout[k] or readout[q])

    handed = lambda b, q, k: rule(q, k) and real[b][k]  # noqa: E731
    # (a padding query, whose own key no query of its row keeps, is not judged: where it looks is the pad's business)
    assert tuple(hit["cell"]) == first((3, 9, 9), lambda b, q, k: handed(0, q, k) and not handed(b, q, k)
                                       and any(handed(b, q, j) for j in range(9))
                                       and any(handed(b, i, q) for i in range(9)))


def test_a_gpt_block_that_takes_the_first_rows_additive_mask_is_found(tmp_path):
    """Written another way (tests/data/dropped): a GPT over a left-padded batch of three, an additive (B, 1, L, L) mask
    of causal and padding, `mask[0, 0]` before SDPA in every block; row 0 is unpadded, so rows 1 and 2 see their
    padding. The fix hands the mask whole: quiet."""
    found = check_bug(tmp_path, "gpt_block_first_row_padding_mask_for_batch", "mask-argument-dropped", folder=DROPPED)
    [hit] = found
    assert "only batch row 0's mask reached the kernel" in hit["message"]
    pads = (0, 4, 2)  # left padding of the prompts of 7, 3 and 5 tokens
    keep = lambda b, q, k: k <= q and (k >= pads[b] or k == q)  # noqa: E731  (a padding query sees itself)
    assert tuple(hit["cell"]) == first((3, 7, 7), lambda b, q, k: keep(0, q, k) and not keep(b, q, k))


def test_one_row_is_the_handed_row_every_batch_row_is_attended_with():
    import numpy as np

    from maskcli.trace.given import one_row

    given = np.ones((3, 1, 4, 4), bool)
    given[1, :, :, 0] = given[2, :, :, :2] = False  # rows differ by their padding
    assert one_row(given, np.broadcast_to(given[1], given.shape)) == 1
    assert one_row(given, given) is None  # each row its own mask
    assert one_row(np.ones((3, 1, 4, 4), bool), np.ones((3, 1, 4, 4), bool)) is None  # the rows alike: nothing to say


def test_colt5_heavy_attention_drops_its_routed_key_padding_mask(tmp_path):
    """lucidrains/CoLT5-attention 0f34926: Attention.forward pads the routed key/values' mask for the null key, then
    calls `self.attend(q, k, v)` without it, so the heavy branch attends to the padding tokens routed in (written blind,
    batch blind-da; caught before, but said as "only batch row 0's mask reached the kernel": row 0's mask keeps every
    key, and a kernel that masks nothing took no row's mask but none). Its fix hands mask=mask: quiet."""
    [hit] = check_bug(tmp_path, "colt5_attention_heavy_attention_drops_key_padding_mask", "mask-argument-dropped")
    assert "mask of forward() (bool, read either way round)" in hit["message"]
    assert "the mask was dropped on its way to the kernel" in hit["message"]
    routed = [list(range(0, 12, 2)), [0, 1, 2, 3, 6, 9]]  # the routed key positions; lengths 12 and 4
    keep = [[True] + [i < n for i in row] for row, n in zip(routed, (12, 4))]  # (the null key first, always kept)
    assert tuple(hit["cell"]) == first((2, 4, 7), lambda b, q, k: not keep[b][k])


def test_a_routed_sink_attention_that_never_hands_its_mask_to_attn_is_found(tmp_path):
    """Written another way (tests/data/dropped): Hugging Face style, a left-padded batch of three, a bool (B, 1, 1, L)
    mask padded in front for a learned sink key, an eager softmax `_attn` called without it. The fix passes it: quiet."""
    [hit] = check_bug(tmp_path, "routed_sink_attention_extended_mask_not_passed", "mask-argument-dropped",
                      folder=DROPPED)
    assert "the mask was dropped on its way to the kernel" in hit["message"]
    pads = (0, 4, 2)  # left padding of 7, 3 and 5 tokens in 7
    keep = lambda b, q, k: k == 0 or k - 1 >= pads[b]  # noqa: E731  (key 0: the sink)
    assert tuple(hit["cell"]) == first((3, 7, 8), lambda b, q, k: q >= pads[b] and not keep(b, q, k))


def test_one_row_is_none_where_the_kernel_masks_nothing():
    import numpy as np

    from maskcli.trace.given import one_row

    given = np.ones((2, 1, 3, 4), bool)
    given[1, :, :, 2:] = False  # row 0 keeps every key, row 1 masks its last two
    assert one_row(given, np.ones_like(given)) is None  # no row's mask reached the kernel: none did
    seen = np.broadcast_to(given[1], given.shape)
    assert one_row(given, seen) == 1


def test_a_cross_attention_beside_its_layers_causal_mask_is_quiet(tmp_path):
    """fairseq's TransformerDecoderLayer (tests/data/quiet): the layer holds the decoder's future mask
    `self_attn_mask` and the source's `encoder_padding_mask` (None: no source pad); its encoder_attn gets no attn_mask,
    and targets as long as their sources make the future mask as wide as its scores. The layer names its memory's
    mask beside the other, so the other is its self-attention's: quiet (found before, as TrOCR's decoder layer was)."""
    status, found, report = traced(tmp_path, "fairseq_decoder_layer_cross_attention_equal_lengths", False, QUIET)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_decoder_layer_dropping_its_encoder_mask_is_found_by_that_mask(tmp_path):
    """A BART-style layer whose cross-attention is called without `encoder_attention_mask` (tests/data/dropped): found
    by the encoder's mask, not by the layer's causal `attention_mask` of the same width; the first cell the kernel
    sees that the padding hides, against a double loop."""
    found = check_bug(tmp_path, "decoder_layer_cross_attention_drops_encoder_mask", "mask-argument-dropped",
                      folder=DROPPED)
    lengths = (5, 3)
    assert "encoder_attention_mask of forward()" in found[0]["message"]
    assert tuple(found[0]["cell"]) == first((2, 5, 5), lambda b, q, k: k >= lengths[b])


def test_megabyte_flash_path_alibi_bias_holding_the_causal_mask_never_handed_to_sdpa(tmp_path):
    """lucidrains/MEGABYTE-pytorch 4c3ec34 (written blind): Attend.flash_attn folds the causal mask into the ALiBi
    `attn_bias`, sets causal = False and calls SDPA with `attn_mask=mask` (None). Found at both stages (the global
    transformer's 9 patches, the local one's 5 bytes); the cell and count against a double loop."""
    found = check_bug(tmp_path, "megabyte_pytorch_attend_flash_alibi_causal_mask_dropped", "mask-argument-dropped")
    for hit, n in zip(found, (9, 5)):
        assert tuple(hit["cell"]) == first((2, n, n), lambda b, q, k: k > q)
        later = sum(k > q for q in range(n) for k in range(n))
        assert f"attn_bias of flash_attn(), {4 * later} cells masked" in hit["message"]  # (4 heads, one bias for the batch)


def test_a_relative_bias_holding_causal_and_left_padding_never_handed_to_sdpa(tmp_path):
    """Written another way (tests/data/dropped): a T5-bucket decoder on a left-padded batch adds its additive
    `attention_mask` (causal and padding) to the position bias, clears is_causal and calls SDPA with neither. The first
    cell and the count of masked cells on rows that keep some key, against a double loop."""
    [hit] = check_bug(tmp_path, "rel_bias_causal_folded_not_passed", "mask-argument-dropped", folder=DROPPED)
    pads = (0, 2, 1)
    masked = lambda b, q, k: k > q or k < pads[b]
    kept_some = lambda b, q: q >= pads[b]
    assert tuple(hit["cell"]) == first((3, 6, 6), lambda b, q, k: kept_some(b, q) and masked(b, q, k))
    count = sum(masked(b, q, k) for b in range(3) for q in range(6) for k in range(6) if kept_some(b, q))
    assert f"attention_mask of _attn(), {count} cells masked" in hit["message"]


def test_a_routed_heavy_branch_that_builds_its_kv_padding_mask_and_attends_without_it_is_found(tmp_path):
    """lucidrains/CoLT5-attention 0f34926 (written blind): the routed key/values' padding mask, padded for the null kv,
    is built and `self.attend(q, k, v)` called without it. Row 0 holds no padding, row 1 six pads; the null key 0 is
    kept."""
    found = check_bug(tmp_path, "colt5_attention_routed_heavy_attention_drops_kv_padding_mask", "mask-argument-dropped")
    b, q, k = found[0]["cell"]
    assert b == 1 and k >= 1
    assert "mask of forward()" in found[0]["message"]


def test_top_k_selected_keys_whose_gathered_padding_mask_is_never_passed_are_found(tmp_path):
    """The same bug written another way: left padding (row 1: five pads first), keys picked by topk and
    take_along_dim, their padding spread over the queries as a (B, Lq, Lk) bool that the helper never passes on."""
    found = check_bug(tmp_path, "topk_selected_kv_padding_mask_not_passed", "mask-argument-dropped", folder=DROPPED)
    assert found[0]["cell"][0] == 1  # (row 0 holds no padding)
    assert "attn_mask of attend()" in found[0]["message"]


def test_text_part_is_the_one_text_config_or_the_config_itself_where_several_are_named():
    """MusicGen's config names two text parts (text_encoder, decoder) and its get_text_config() raises ValueError:
    trace ended in 'unexpected ValueError ... (a maskcli bug)' on a correct MusicGen generate (quiet-zp). No part is
    chosen for a rule then; Gemma 3's one text part is still read."""
    transformers = pytest.importorskip("transformers")
    from maskcli.checks.configread import text_part

    musicgen = transformers.MusicgenConfig()
    with pytest.raises(ValueError):
        musicgen.get_text_config()
    assert text_part(musicgen) is musicgen
    gemma = transformers.Gemma3Config()
    assert text_part(gemma) is gemma.text_config
    plain = {"sliding_window": 4}
    assert text_part(plain) is plain


def test_a_decoder_layers_self_attention_bias_is_not_dropped_by_its_cross_attention(tmp_path):
    """THUMT's beam search (tests/data/quiet_blind, written blind, batch quiet-r71a) written another way
    (tests/data/dropped): a decoder layer `forward(x, attn_bias, encdec_bias, memory)` hands the causal bias to its
    self-attention and `encdec_bias` (tensor2tensor's name for the source's bias) to its attention over the memory. The
    source is as long as the target and unpadded, so the cross-attention masks nothing while the (T, T) causal bias
    beside it fits its shape: that bias is the self-attention's (mask-argument-dropped said it was dropped before)."""
    status, found, report = traced(tmp_path, "thumt_style_decoder_layer_self_bias_beside_encdec_bias", False, DROPPED)
    assert status == 0, report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_block_handed_two_masks_that_passes_one_on_is_no_dropped_mask():
    """Meta's Llama 4 reference (written blind, quiet-r89b, a false alarm): every TransformerBlock is handed both
    global_attn_mask (additive causal) and local_attn_mask (bool, chunks of 4) and passes one on (the NoPE layers the
    global one). The block holds the kernel's own mask under one name: the other is the mask it chose against, not one
    dropped on the way. A block that passes neither on (SDPA with no mask) still drops them."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import maskcli

    class Block(nn.Module):
        def __init__(self, local: bool | None):
            super().__init__()
            self.local = local

        def forward(self, x, global_attn_mask, local_attn_mask):
            if self.local is None:
                return F.scaled_dot_product_attention(x, x, x)  # (neither passed on)
            mask = local_attn_mask if self.local else global_attn_mask
            return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)

    n = 8
    causal = torch.full((n, n), float("-inf")).triu(1)
    chunks = torch.tensor([[k // 4 == q // 4 and k <= q for k in range(n)] for q in range(n)])  # by a double loop
    x = torch.randn(1, 2, n, 4)
    with torch.no_grad(), maskcli.trace() as t:
        Block(True)(x, causal, chunks)
        Block(False)(x, causal, chunks)
        Block(None)(x, causal, chunks)
    local, full, none = t.calls
    assert (local.keep()[0, 0] == chunks.numpy()).all() and (full.keep()[0, 0] == ~causal.isinf().numpy()).all()
    found = {g.calls[0].index: [f.code for f in g.findings] for g in t.groups()}
    assert "mask-argument-dropped" not in found[local.index] + found[full.index]
    assert "mask-argument-dropped" in found[none.index]


def test_fms_gpt_oss_sinks_attention_builds_its_own_causal_mask_over_left_padding(tmp_path):
    """foundation-model-stack 09380a97 (written blind, blind-pp, caught before tuning): GPT-OSS's
    `_math_attention_with_sinks_op` never read the padding mask fms's batched generate hands it and built its own
    causal triangle, so a left-padded prompt attends its pads; the fix applies the mask it was given."""
    [hit, *_] = check_bug(tmp_path, "fms_gpt_oss_sinks_attention_ignores_padding_mask", "mask-argument-dropped")
    assert "_math_attention_with_sinks_op()" in hit["message"], hit
