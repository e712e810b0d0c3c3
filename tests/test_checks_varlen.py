"""checks/varlen.py: documents given to the model call by cu_seq_lens / cu_seqlens / seq_idx, on reproductions of
published bugs and on programs written here, each against documents and cells worked out in the test."""

from __future__ import annotations

import json

import numpy as np
import pytest

from checkbugs import check_bug, first, runner, traced
from maskcli.checks.varlen import expression, given
from maskcli.checks.context import Top
from maskcli.commands import app


def test_flattened_batch_with_an_all_ones_mask(tmp_path):
    # huggingface/transformers#46634: masking_utils.py lines 862-870 read packed documents from position_ids only when
    # attention_mask is None, so SDPA runs causal over the flattened row
    pytest.importorskip("transformers")
    check_bug(tmp_path, "flattened_batch_ones_mask", "varlen-leak")


def test_cu_seqlens_overwritten_from_the_attention_mask(tmp_path):
    check_bug(tmp_path, "fla_cu_seqlens_overwritten", "varlen-leak")  # fla-org/flash-linear-attention#842


def test_exporter_reshapes_ragged_vision_segments_into_equal_chunks(tmp_path):
    """huggingface/transformers#47871 (written blind, batch blind-aw): the export-safe vision attention cut the flat
    sequence into `num_segments` equal chunks, so cu_seqlens [0, 24, 32] became two chunks of 16: the second holds
    the end of the first image and the whole second one, and they attend each other."""
    [hit] = check_bug(tmp_path, "transformers_exporter_vision_segments_reshaped_uniform", "varlen-leak")
    assert hit["cell"] == [1, 0, 8], hit  # (flat token 16, of image 0, sees flat token 24, of image 1)


def test_the_leak_is_said_once_with_the_documents_it_crosses(tmp_path):
    """The flattened batch's position_ids restart where cu_seq_lens say (DataCollatorWithFlattening writes both):
    the leak is one finding, naming the documents as the collator's lengths give them, at the first cell a double
    loop over the positions finds."""
    pytest.importorskip("transformers")
    status, found, report = traced(tmp_path, "flattened_batch_ones_mask", fixed=False)
    lengths = [3, 4, 2]  # the samples the program flattens
    document = [n for n, size in enumerate(lengths) for _ in range(size)]
    first = next((q, k) for q in range(9) for k in range(q + 1) if document[q] != document[k])  # causal, crossing
    assert [f["code"] for f in found if f["severity"] == "wrong"] == ["varlen-leak"], report
    assert found[0]["expected"] == "document(sizes=[3,4,2])" and found[0]["cell"] == [0, *first]
    assert found[0]["source"] == "cu_seq_lens_q/k of LlamaForCausalLM"


HYBRID = '''
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

class Attention(nn.Module):
    def forward(self, x, seq_idx=None, cu_seq_lens_q=None, cu_seq_lens_k=None):
        q = k = v = x[:, None]
        if seq_idx is None and cu_seq_lens_q is not None:
            seq_idx = torch.repeat_interleave(torch.arange(len(cu_seq_lens_q) - 1), cu_seq_lens_q.diff())[None]
        if "--bug" in sys.argv or seq_idx is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        n = x.shape[1]
        same = seq_idx[:, :, None] == seq_idx[:, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(same & torch.ones(n, n, dtype=torch.bool).tril())[:, None])

class HybridModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Attention()])

    def forward(self, inputs_embeds, **kwargs):
        for layer in self.layers:
            inputs_embeds = layer(inputs_embeds, **kwargs)
        return inputs_embeds

torch.manual_seed(0)
seq_idx = torch.tensor([[0, 0, 1, 1, 1, 2]], dtype=torch.int32)
extra = {}
if "--cu" in sys.argv:
    extra = dict(cu_seq_lens_q=torch.tensor([0, 2, 4, 6]), cu_seq_lens_k=torch.tensor([0, 2, 4, 6]))
HybridModel()(torch.randn(1, 6, 4), seq_idx=seq_idx, **extra)
'''


def _run(tmp_path, source: str, *args: str) -> tuple[int, list[dict]]:
    script = tmp_path / "program.py"
    script.write_text(source)
    out = tmp_path / "t.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(script), *args])
    return result.exit_code, [f for group in json.loads(out.read_text())["groups"] for f in group["findings"]]


def test_seq_idx_marks_the_documents_of_a_hybrid_models_attention(tmp_path):
    """seq_idx (GraniteMoeHybridFlashAttentionKwargs: each token's packed sequence) given to the model: a causal mask
    over it leaks; the same-document mask does not."""
    status, found = _run(tmp_path, HYBRID)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == []
    status, found = _run(tmp_path, HYBRID, "--bug")
    seq_idx = [0, 0, 1, 1, 1, 2]
    first = next((q, k) for q in range(6) for k in range(q + 1) if seq_idx[q] != seq_idx[k])
    assert status == 1
    assert [(f["code"], f["expected"], f["cell"]) for f in found if f["severity"] == "wrong"] == [
        ("varlen-leak", "document(sizes=[2,3,1])", [0, *first])]


def test_cu_seq_lens_that_disagree_with_seq_idx_are_wrong(tmp_path):
    """cu_seq_lens [0, 2, 4, 6] start documents at 0, 2, 4; seq_idx at 0, 2, 5: they part at token 4 first. Which
    documents leak depends on which one is right, so the disagreement is the one finding."""
    status, found = _run(tmp_path, HYBRID, "--cu")
    wrong = [f for f in found if f["severity"] == "wrong"]
    assert status == 1 and [f["code"] for f in wrong] == ["varlen-disagree"]
    assert wrong[0]["cell"] == [0, 4, 4] and "[0, 2, 4]" in wrong[0]["message"] and "[0, 2, 5]" in wrong[0]["message"]


def test_position_ids_that_restart_elsewhere_than_cu_seq_lens_are_wrong(tmp_path):
    """transformers' rule for position_ids (masking_utils.py find_packed_sequence_indices, lines 756-758): a new
    document wherever the position does not go up by 1."""
    source = HYBRID.replace('extra = {}', 'extra = {}\nposition_ids = torch.tensor([[0, 1, 0, 1, 2, 0]])').replace(
        "HybridModel()(torch.randn(1, 6, 4), seq_idx=seq_idx, **extra)",
        "HybridModel()(torch.randn(1, 6, 4), position_ids=position_ids, cu_seq_lens_q=torch.tensor([0, 2, 5, 6]), "
        "cu_seq_lens_k=torch.tensor([0, 2, 5, 6]))")
    source = source.replace("def forward(self, inputs_embeds, **kwargs):", "def forward(self, inputs_embeds, position_ids=None, **kwargs):")
    status, found = _run(tmp_path, source)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == []  # 0 1 | 0 1 2 | 0: they agree
    status, found = _run(tmp_path, source.replace("[[0, 1, 0, 1, 2, 0]]", "[[0, 1, 2, 0, 1, 0]]"))
    wrong = [f for f in found if f["severity"] == "wrong"]
    assert status == 1 and [f["code"] for f in wrong] == ["varlen-disagree"] and wrong[0]["cell"] == [0, 2, 2]


def test_cu_seqlens_a_model_builds_for_its_layers_against_its_own_position_ids(tmp_path):
    """huggingface/nanotron#341 (written blind, batch blind-iu): Qwen2Model built cu_seqlens of `torch.where(position_ids
    == 0)[0]` on the 2-D position_ids (the rows of the starts, not their offsets) and handed them to each layer; its
    stand-in varlen kernel followed them across documents. Written another way: a packed decoder that lays the first
    row's document starts on every row. The documents the layers were handed are read against the model call's own
    position_ids (where they restart at 0), as the model call's own cu_seq_lens are; the first disagreeing token by a
    loop over the flattened starts."""
    from pathlib import Path

    data = Path(__file__).parent / "data"
    [hit] = check_bug(tmp_path, "nanotron_qwen2_cu_seqlens_row_indices_from_2d_position_ids", "varlen-disagree",
                      data / "blind")
    assert "starts documents at [0, 1] by cu_seqlens, at [0, 10] by position_ids" in hit["message"]
    [hit] = check_bug(tmp_path, "packed_rows_cu_seqlens_from_first_rows_positions", "varlen-disagree", data / "varlen")
    sizes = [[5, 3], [2, 6]]  # the program's documents, two rows of 8
    by_positions = [t for row in sizes for n in row for t in [True] + [False] * (n - 1)]
    by_cu = [t for _ in sizes for n in sizes[0] for t in [True] + [False] * (n - 1)]
    at = next(i for i in range(16) if by_positions[i] != by_cu[i])
    assert hit["cell"] == [at // 8, at % 8, at % 8]


@pytest.mark.parametrize("cu", [[0, 3, 7, 9], [0, 9], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
def test_documents_from_cumulative_lengths_against_a_loop(cu):
    top = Top("m", arguments={"cu_seq_lens_q": np.array(cu), "cu_seq_lens_k": np.array(cu), "position_ids": np.zeros((1, 9), int)})
    (name, labels), = given(top)
    expected = [[next(i for i in range(len(cu) - 1) if cu[i] <= t < cu[i + 1]) for t in range(9)]]
    assert name == "cu_seq_lens_q" and labels.tolist() == expected
    assert expression(labels) == f"document(sizes=[{','.join(str(b - a) for a, b in zip(cu, cu[1:]))}])"


def test_cumulative_lengths_over_other_tokens_or_differing_q_and_k_are_not_read():
    """A cu_seqlens that does not cover the call's tokens from 0 is pack's lengths-sum; q and k that differ are not one
    self-attention's documents (pack's q-k-differ)."""
    assert given(Top("m", arguments={"cu_seqlens": np.array([0, 3, 7]), "position_ids": np.zeros((1, 9), int)})) == []
    assert given(Top("m", arguments={"cu_seq_lens_q": np.array([0, 3, 9]), "cu_seq_lens_k": np.array([0, 4, 9])})) == []


@pytest.mark.parametrize("name, folder", [
    ("qwen3_asr_audio_encoder_window_mask_not_built", None),  # QwenLM/Qwen3-ASR#103: SDPA never got the windows
    ("inner_layer_cu_seqlens", "windows"),  # eager blocks one key past each boundary
])
def test_documents_handed_to_each_layer_by_keyword(tmp_path, name, folder):
    from pathlib import Path

    if folder is None:
        check_bug(tmp_path, name, "varlen-leak")
    else:
        check_bug(tmp_path, name, "varlen-leak", Path(__file__).parent / "data" / folder)


def test_window_blocks_handed_window_cu_seqlens_but_the_full_image_seqlens(tmp_path):
    # vllm-project/vllm#15200 (regression from #14377), written blind: the xformers `seqlens` pre-computed once from
    # the full-image cu_seqlens reach every block, so a windowed block handed cu_seqlens=cu_window_seqlens (windows of
    # 4x4 patches) runs a BlockDiagonalMask over whole images (96 + 32 patches)
    from checkbugs import first

    [hit] = check_bug(tmp_path, "vllm_qwen2_5_vl_vision_window_seqlens_precomputed_from_full", "varlen-leak")
    image = [0] * 96 + [1] * 32
    window = [p // 16 for p in range(128)]  # the windows the program's get_window_index cuts, in window order
    assert tuple(hit["cell"]) == first((1, 128, 128), lambda b, q, k: image[q] == image[k] and window[q] != window[k])


def test_window_layers_reading_a_mask_cached_from_the_images_lengths_written_another_way(tmp_path):
    # the same bug written another way: a config dataclass's window_layers, one additive mask cached by the encoder
    # from the images' lengths (12, 8, 16 patches) and read by every layer, windows of 4 handed by keyword
    from pathlib import Path

    from checkbugs import first

    [hit] = check_bug(tmp_path, "window_layers_mask_cached_from_global_lengths", "varlen-leak",
                      Path(__file__).parent / "data" / "windows")
    image = [i for i, size in enumerate((12, 8, 16)) for _ in range(size)]
    assert tuple(hit["cell"]) == first((1, 36, 36), lambda b, q, k: image[q] == image[k] and q // 4 != k // 4)


def test_documents_a_call_was_handed_are_read_where_the_model_call_has_none():
    class Call:
        details = {"documents": {"cu_seqlens_q": np.array([0, 2, 5])}}

    found = given(Top("encoder", None, {}), Call())
    want = np.array([[0, 0, 1, 1, 1]])
    assert [name for name, _ in found] == ["cu_seqlens"] and np.array_equal(found[0][1], want)


def test_query_and_key_lengths_that_differ_are_no_documents():
    class Call:
        details = {"documents": {"cu_seqlens_q": np.array([0, 2, 5]), "cu_seqlens_k": np.array([0, 4, 9])}}

    assert given(Top("attention", None, {}), Call()) == []


def test_cu_seqlens_a_plain_attention_function_ignores(tmp_path):
    """Tencent-Hunyuan/HunyuanVideo PR #310: attention(mode="vanilla", cu_seqlens_q/kv=...) builds its bias without
    them, so image tokens see the text padding; the fix's block-diagonal bias is quiet."""
    found = check_bug(tmp_path, "hunyuanvideo_vanilla_attention_ignores_cu_seqlens", "varlen-leak")
    lengths = [[7, 0], [5, 2]]  # per row: the valid segment, then the padding segment (get_cu_seqlens)
    segment = [[s for s, size in enumerate(row) for _ in range(size)] for row in lengths]
    first = next((b, q, k) for b in range(2) for q in range(7) for k in range(7) if segment[b][q] != segment[b][k])
    assert found[0]["cell"] == list(first)


@pytest.mark.parametrize("name, rows, folder", [
    # kohya-ss/musubi-tuner 5bb0a34: attn_varlen_func's split_attn loop attended each sample's whole padded
    # [image + text] row, the cu_seqlens it holds never read (12 image tokens; prompts of 4 and 7 padded to 10)
    ("musubi_framepack_split_attn_ignores_text_padding_mask", [[16, 6], [19, 3]], None),
    # the same bug written another way: an eager softmax loop over the batch inside the attention module, handed
    # cu_seqlens by keyword (8 video tokens; prompts of 3, 5 and 2 padded to 6)
    ("per_sample_softmax_loop_ignores_cu_seqlens", [[11, 3], [13, 1], [10, 4]], "windows"),
])
def test_a_loop_over_batch_rows_that_attends_each_whole_padded_row(tmp_path, name, rows, folder):
    """Each call attends one row of the flattened [valid, padding] segments: its row read from where its queries sit
    in their batch (musubi's q[i:i + 1]), else every row it may be; the first cell that crosses a segment of that row,
    by a double loop, is the one said. The fixes attend each row's valid tokens alone: quiet."""
    from pathlib import Path

    found = check_bug(tmp_path, name, "varlen-leak", *((Path(__file__).parent / "data" / folder,) if folder else ()))
    segment = [[s for s, size in enumerate(row) for _ in range(size)] for row in rows]
    length = sum(rows[0])
    cell = next((b, q, k) for b in range(len(rows)) for q in range(length) for k in range(length)
                if segment[b][q] != segment[b][k])
    assert found[0]["cell"] == list(cell)
    assert found[0]["expected"] == f"document(sizes=[{';'.join(','.join(map(str, row)) for row in rows)}])"


PLAIN = '''
import sys
import torch
import torch.nn.functional as F

def attend(q, k, v, cu_seqlens):
    """One flattened row of packed documents; --bug: causal over all of it, the documents never looked at."""
    n = q.shape[2]
    if "--bug" in sys.argv:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if "--each" in sys.argv:  # one call per document, as Qwen2-VL's eager vision blocks do
        return torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
                          for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())], dim=2)
    document = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff())
    same = (document[:, None] == document[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same)

q = torch.randn(1, 2, 9, 4)
attend(q, q, q, torch.tensor([0, 3, 7, 9], dtype=torch.int32))
'''


@pytest.mark.parametrize("args,leaks", [(("--bug",), True), ((), False), (("--each",), False)])
def test_cu_seqlens_of_a_function_that_attends_over_one_flattened_row(tmp_path, args, leaks):
    """A plain function given cu_seqlens (another name, one flattened row, SDPA's is_causal): a causal mask over all
    its tokens leaks from the first document into the second at query 3, key 0; the same-document causal mask, and one
    call per document, are quiet."""
    status, found = _run(tmp_path, PLAIN, *args)
    wrong = [f for f in found if f["severity"] == "wrong"]
    document = [0, 0, 0, 1, 1, 1, 1, 2, 2]
    first = next((0, q, k) for q in range(9) for k in range(q + 1) if document[q] != document[k])
    if leaks:
        assert status == 1 and [f["code"] for f in wrong] == ["varlen-leak"] and wrong[0]["cell"] == list(first)
        assert wrong[0]["expected"] == "document(sizes=[3,4,2])"
    else:
        assert status == 0 and wrong == []


def test_segment_ids_held_by_the_mask_object_the_model_drops(tmp_path):
    # marin-community/marin#9029: Levanter's AttentionMask(segment_ids=...) replaced by a plain causal one
    found = check_bug(tmp_path, "levanter_snowball_drops_segment_ids", "varlen-leak")
    assert "segment_ids (of its attn_mask argument)" in found[0]["message"]
    assert "document(sizes=[5,3])" in found[0]["message"]
    assert found[0]["cell"][1:] == [5, 0]  # the first token of the second segment sees the first segment's first


def test_segment_ids_argument_of_padded_rows_ignored_by_sdpa(tmp_path):
    from pathlib import Path

    found = check_bug(tmp_path, "segment_ids_argument_ignored", "varlen-leak", Path(__file__).parent / "data" / "packed")
    # cells across segments a causal mask keeps, by a double loop over the segment ids the program hands
    segments = [[1, 1, 1, 2, 2, 2, 2, 3, 3], [1, 1, 1, 1, 1, 2, 2, 0, 0]]
    across = sum(1 for row in segments for q in range(9) for k in range(q) if row[q] != row[k])
    assert f"({across} such cells)" in found[0]["message"]


def test_segment_ids_read_from_an_argument_object_statically():
    import torch

    from maskcli.trace.tops import _held_segments

    class Mask:
        def __init__(self, ids):
            self.segment_ids = ids

        def __getattr__(self, name):  # the program's own: never run by the read
            raise AssertionError(name)

    ids = torch.tensor([[0, 0, 1, 1]])
    held = _held_segments({"mask": Mask(ids), "x": torch.zeros(1, 4)})
    assert held["segments_held_by"] == "mask" and held["segment_ids"].tolist() == [[0, 0, 1, 1]]
    assert _held_segments({"batch": {"segment_ids": ids}})["segment_ids"].tolist() == [[0, 0, 1, 1]]
    assert _held_segments({"mask": Mask(torch.zeros(4)), "n": 3}) == {}  # (not per-token rows: nothing)

    class Batch(dict):
        def get(self, name, default=None):  # the program's own: never run by the read
            raise AssertionError(name)

    assert _held_segments({"batch": Batch(segment_ids=ids)})["segment_ids"].tolist() == [[0, 0, 1, 1]]


def test_decoder_segment_ids_of_a_packed_decoder_are_read(tmp_path):
    """maxtext#4476 (written blind, batch blind-be): the cuDNN flash training branch is handed decoder_segment_ids
    and passes a causal mask only, so the second packed segment (tokens 7-11) sees the first."""
    found = check_bug(tmp_path, "maxtext_cudnn_flash_jax_train_ignores_decoder_segment_ids", "varlen-leak")
    segments = [1] * 7 + [2] * 5
    across = sum(1 for q in range(12) for k in range(q) if segments[q] != segments[k])
    assert found[0]["message"].startswith("decoder_segment_ids given to Decoder")
    assert f"({across} such cells)" in found[0]["message"] and found[0]["cell"] == [0, 7, 0]


def test_decoder_segment_ids_with_padding_in_a_t5x_port(tmp_path):
    """Written another way: a T5X-style decoder-only port, two packed rows (segment 0 = padding), a hand-written
    softmax with the causal mask only; its fix ANDs the segment mask. Cells across segments, by a double loop."""
    from pathlib import Path

    found = check_bug(tmp_path, "t5x_decoder_only_packed_causal_ignores_segments", "varlen-leak",
                      Path(__file__).parent / "data" / "segments")
    segments = [[1, 1, 1, 1, 2, 2, 2, 3, 3], [1, 1, 1, 1, 1, 0, 0, 0, 0]]
    across = sum(1 for row in segments for q in range(9) for k in range(q + 1) if row[q] != row[k])
    assert f"({across} such cells)" in found[0]["message"]


def test_decoder_segment_ids_beside_an_encoder_are_not_read():
    import torch

    from maskcli.trace.tops import _decoder_segments

    ids = torch.tensor([[1, 1, 2, 2]])
    assert _decoder_segments({"decoder_segment_ids": ids})["segment_ids"].tolist() == [[1, 1, 2, 2]]
    assert _decoder_segments({"decoder_segment_ids": ids, "encoder_input_tokens": torch.zeros(1, 3)}) == {}
    assert _decoder_segments({"decoder_segment_ids": ids.float()}) == {}


def test_cu_seqlens_that_unpad_the_attention_mask_over_the_real_tokens(tmp_path):
    """prescient-design/lobster fd2fbe2 (PR #112; bug from #105): without flash-attn, Ume's unpadded FlexBERT layers run
    SDPA over all the batch's real tokens with no mask, holding the cu_seqlens unpad_input made of the attention_mask."""
    [hit] = check_bug(tmp_path, "lobster_ume_unpadded_sdpa_attends_across_sequences", "varlen-leak")[:1]
    lengths = [20, 7, 13]  # the real tokens of each row, flattened one after another
    document = [n for n, size in enumerate(lengths) for _ in range(size)]
    assert hit["expected"] == "document(sizes=[20,7,13])"
    assert tuple(hit["cell"]) == first((1, 40, 40), lambda b, q, k: document[q] != document[k])


def test_cu_seqlens_handed_by_keyword_over_a_left_padded_batchs_real_tokens(tmp_path):
    """Written another way: a MosaicBERT-style encoder unpads a left-padded batch and hands each layer `cu_seqlens=`;
    its eager fallback softmaxes over every real token at once. The fix pads back and adds the key-padding bias."""
    from pathlib import Path

    [hit] = check_bug(tmp_path, "mosaicbert_style_unpadded_eager_attention_over_all_tokens", "varlen-leak",
                      Path(__file__).parent / "data" / "packed")[:1]
    document = [n for n, size in enumerate([9, 5, 7]) for _ in range(size)]
    assert hit["expected"] == "document(sizes=[9,5,7])"
    assert tuple(hit["cell"]) == first((1, 21, 21), lambda b, q, k: document[q] != document[k])


def test_cu_seqlens_of_another_mask_are_not_the_unpadding():
    """cu_seqlens whose lengths are not each row's real tokens are no unpadding of the model call's mask."""
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert given(Top("m", arguments={"cu_seqlens": np.array([0, 3, 5]), "attention_mask": mask}))[0][1].tolist() == \
        [[0, 0, 0, 1, 1]]
    assert given(Top("m", arguments={"cu_seqlens": np.array([0, 2, 5]), "attention_mask": mask})) == []


def test_keras_nlp_merged_mask_with_an_extra_axis_mixing_batch_into_heads_is_flagged_and_its_fix_is_not(tmp_path):
    # keras-team/keras-hub#783 (fixed by #790, 600cbf1; written blind, blind-iz, round 60; caught before tuning): a
    # (B, T) padding mask given an extra axis beside a (B, T, T) attention mask broadcasts to (B, B, T, T), so with
    # batch == heads head h of every row reads row h's documents and padding
    check_bug(tmp_path, "keras_nlp_merge_padding_and_attention_mask_extra_axis_mixes_batch_into_heads", "varlen-leak")


def test_threads_running_model_calls_of_their_own_are_read_each_against_its_own(tmp_path):
    """Context-parallel ranks as threads in one process (axolotl#2495's fix, blind: a false alarm before, each rank's
    cu_seqlens read against the other rank's position_ids): two threads each run a packed model call whose documents
    agree, their attention calls interleaved by a barrier. Each call is paired with its own thread's model call:
    quiet."""
    from pathlib import Path

    status, found, report = traced(tmp_path, "two_threads_packed_rows_own_documents_quiet", False,
                                   Path(__file__).parent / "data" / "varlen")
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_varlen_loop_over_the_documents_is_not_read_as_rows_of_a_batch(tmp_path):
    """A plain-torch flash_attn_varlen_func that attends document by document (2, 4 and 2 tokens packed): the 4-token
    call is that document alone, not a row of the 8 tokens cut in two rows of 4 (musubi-tuner's per-sample loop, which
    _one_row reads): quiet (a false alarm before, varlen-leak)."""
    from pathlib import Path

    status, found, report = traced(tmp_path, "varlen_loop_over_documents_quiet", False,
                                   Path(__file__).parent / "data" / "varlen")
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
