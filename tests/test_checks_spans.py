"""checks/spans.py: bidirectional spans from the model call's token types (Gemma 3's images, PaliGemma's prefix,
Gemma 4's vision on sliding layers), on reproductions of published bugs and on masks built by a double loop."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkbugs import check_bug, runner
from pathlib import Path

from maskcli import tracefile
from maskcli.checks.context import Run, Top
from maskcli.checks.spans import FAMILIES, check, explained, one_span, runs
from maskcli.commands import app

BUGS = [
    ("gemma3_images_see_later_images", "span-leak"),  # huggingface/transformers#38053, fixed by #38080
    ("paligemma_suffix_sees_ahead", "span-leak"),  # huggingface/transformers#30918, fixed by #30967
    ("gemma3_generate_drops_image_spans", "span-not-bidirectional"),  # huggingface/transformers#39389
    # written blind (batch blind-dx): VikParuchuri/surya 2791d60: under SDPA an unpadded batch's mask came back None,
    # so SuryaModel skipped create_eoi_mask's unmasking (config.unmask_image) and SDPA ran is_causal over the image
    ("surya_recognition_unmask_image_dropped_under_sdpa", "span-not-bidirectional"),
]
PORTS = [  # hand-written ports: the family read off the config class's name (no transformers, no model_type)
    ("gemma3_image_tokens_attend_future_images", "span-leak"),  # huggingface/transformers#38053, written blind
    # huggingface/transformers#38295 (written blind, blind-hw, round 54): transformers 4.53's Gemma 3 took two image
    # tokens as one image where `abs(kv_idx - q_idx) <= tokens_per_image`, so an image saw a neighbouring later one;
    # a port with a config class of its own (Cfg): the family read off its model class, Gemma3Model (before tuning its
    # fix raised decoder-mask-not-causal, its image blocks unread)
    ("transformers_gemma3_image_block_by_token_distance", "span-leak"),
]


@pytest.mark.parametrize("name, code", PORTS)
def test_each_port_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


def test_paligemma_port_suffix_sees_ahead(tmp_path):
    """Written another way: a PaliGemmaConfig dataclass; the suffix un-masked as the prefix is. The first cell is a
    double loop's over later keys in the suffix (token type 1) of the query's own row."""
    from checkbugs import first, traced

    folder = Path(__file__).parent / "data" / "held"
    status, found, report = traced(tmp_path, "paligemma_port_suffix_sees_ahead", False, folder)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "span-leak")
    types = [[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]]
    assert tuple(hit["cell"]) == first((2, 7, 7), lambda b, q, k: k > q and types[b][q] == 1 and types[b][k] == 1)
    status, found, report = traced(tmp_path, "paligemma_port_suffix_sees_ahead", True, folder)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_a_paligemma_port_named_by_its_model_class_whose_prefix_runs_causal(tmp_path):
    """Written another way (round 54's Gemma 3 port): a SimpleNamespace config, so only the model class,
    PaliGemmaForConditionalGeneration, names the family; the prefix (token type 0) runs causal. The first cell is a
    double loop's over later keys of the query's own prefix among its row's real tokens."""
    from checkbugs import first

    folder = Path(__file__).parent / "data" / "held"
    [hit] = check_bug(tmp_path, "paligemma_namespace_config_prefix_run_causal", "span-not-bidirectional", folder)
    prefix = [5, 4]
    assert tuple(hit["cell"]) == first((2, 8, 8), lambda b, q, k: q < k < prefix[b])
    assert "token_type_ids say causal | blocks(0,0,0,0,0,-1,-1,-1)" in hit["message"]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    pytest.importorskip("transformers")
    check_bug(tmp_path, name, code)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=6, max_size=6), min_size=1, max_size=3))
def test_block_ids_are_transformers_own(types):
    """runs() numbers the spans as Gemma 3's and Gemma 4's get_block_sequence_ids_for_mask do
    (models/gemma3/modeling_gemma3.py:671-679, models/gemma4/modeling_gemma4.py:2206-2215)."""
    torch = pytest.importorskip("torch")
    gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    types = np.array(types)
    tensor = torch.from_numpy(types)
    assert (runs(types == 1) == gemma3.get_block_sequence_ids_for_mask(tensor).numpy()).all()
    assert (runs((types == 1) | (types == 2)) == gemma4.get_block_sequence_ids_for_mask(tensor, "cpu").numpy()).all()
    assert (FAMILIES["paligemma"].spans(types) == np.where(types == 0, 0, -1)).all()  # modeling_paligemma.py:243
    assert (FAMILIES["molmo2"].spans(types) == np.where(types == 1, 0, -1)).all()  # modeling_molmo2.py:862


TYPES = np.array([[0, 0, 1, 1, 1, 0, 1, 1, 0], [0, 1, 1, 0, 0, 1, 1, 1, 0]])  # Gemma 3: 1 = an image token
REAL = np.array([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])  # the first row left-padded by two
IMAGE = [[-1, -1, 0, 0, 0, -1, 1, 1, -1], [-1, 0, 0, -1, -1, 1, 1, 1, -1]]  # each run of 1s its own image


def reference(window: int | None = None, spans: bool = True, rows=IMAGE, real=REAL) -> np.ndarray:
    """Bool (B, 1, L, L) as transformers builds Gemma 3's masks: (causal | same image) [& kv > q - W] & real key,
    a double loop over positions (masking_utils.py:981-1000 or-s the blocks on before the padding is and-ed)."""
    batch, length = len(rows), len(rows[0])
    cells = np.zeros((batch, 1, length, length), dtype=bool)
    for b in range(batch):
        for q in range(length):
            for k in range(length):
                same = spans and rows[b][q] == rows[b][k] and rows[b][q] >= 0
                cells[b, 0, q, k] = (k <= q or same) and (window is None or k > q - window) and real[b][k] == 1
    return cells


def call(cells: np.ndarray, index: int, layer: int, where: str = "model.language_model.layers.{}.self_attn"):
    shape = (cells.shape[0], 2, *cells.shape[2:])
    return SimpleNamespace(index=index, where=where.format(layer), step=0, api="sdpa", shape=shape, stored=tracefile.from_dense(cells, shape),
                           mask=str(index), details={"layer": layer})


def config(model_type: str = "gemma3", layer_types=("sliding_attention", "full_attention"), **text):
    text_config = SimpleNamespace(layer_types=list(layer_types), sliding_window=3, **text)
    return SimpleNamespace(model_type=model_type, get_text_config=lambda: text_config)


def findings(cells_by_layer, model_type="gemma3", argument="token_type_ids", types=TYPES, real=REAL, **text):
    calls = [call(cells, i, i) for i, cells in enumerate(cells_by_layer)]
    top = Top("Gemma3ForConditionalGeneration", config(model_type, **text), {argument: types, "attention_mask": real},
              0, len(calls))
    return [(c.index, f) for c, f in check(Run(calls, [top]))]


def test_quiet_on_the_masks_transformers_builds():
    assert findings([reference(window=3), reference()]) == []


def test_an_image_token_that_does_not_see_a_later_token_of_its_image():
    cells = reference()
    cells[0, 0, 3, 4] = False  # query 3 and key 4 are both image 0 of the first row
    [(index, found)] = findings([reference(window=3), cells])
    assert (index, found.code, found.cell) == (1, "span-not-bidirectional", (0, 3, 4))
    assert found.expected == "causal | blocks(-1,-1,0,0,0,-1,1,1,-1)"
    assert "layer 1, row 0: query 3 does not see later key 4 of its own image 0" in found.message


def test_a_causal_mask_on_a_sliding_layer_is_judged_within_the_window_only():
    """A span cell W or more keys ahead is not judged on a sliding layer (a symmetric window would cut it); the
    ones within are: image 1 of row 1 is keys 5-7, so query 5 must see 6 and 7 (W = 3)."""
    [(index, found)] = findings([reference(window=3, spans=False), reference()])
    assert (index, found.code, found.cell) == (0, "span-not-bidirectional", (0, 2, 3))
    assert found.expected.startswith("(causal | blocks(") and found.expected.endswith(") & lookback(3)")


def test_an_image_that_sees_the_next_image_or_text_that_sees_ahead():
    cells = reference()
    cells[1, 0, 2, 5] = True  # row 1: image 0's last token sees image 1
    [(_, found)] = findings([reference(window=3), cells])
    assert (found.code, found.cell) == ("span-leak", (1, 2, 5))
    assert "query 2 (image 0) sees later key 5 (image 1)" in found.message
    cells = reference()
    cells[0, 0, 5, 6] = True  # row 0: a text token sees the image after it
    [(_, found)] = findings([reference(window=3), cells])
    assert (found.code, found.cell) == ("span-leak", (0, 5, 6))
    assert "query 5 (text) sees later key 6 (image 1)" in found.message


def test_padding_is_not_judged_here():
    """A padding key seen, or a padding query that sees ahead, is arguments.py's (padding-ignored), not a span's."""
    cells = reference()
    cells[0, 0, 0, :] = True  # a padding query of the left-padded row sees every key
    cells[0, 0, 4, 0] = True  # a real query sees a padding key (earlier: not this rule's)
    assert findings([reference(window=3), cells]) == []


def test_gemma4_spans_only_its_sliding_layers():
    """Gemma 4 with use_bidirectional_attention="vision" ors the spans onto its sliding layers only; its full layers
    stay causal (models/gemma4/modeling_gemma4.py:2143-2200); without "vision" no layer has them (:2476)."""
    good = [reference(window=3), reference(spans=False)]
    assert findings(good, "gemma4", "mm_token_type_ids", use_bidirectional_attention="vision") == []
    [(index, found)] = findings([reference(window=3), reference()], "gemma4", "mm_token_type_ids",
                                use_bidirectional_attention="vision")
    assert (index, found.code, found.expected) == (1, "span-leak", "causal")
    assert findings([reference(window=3), reference()], "gemma4", "mm_token_type_ids") == []


def test_paligemma_prefix_is_one_span():
    """PaliGemma: token_type_ids 0 (the image and the prompt) see each other both ways, the suffix is causal
    (models/paligemma/modeling_paligemma.py:240-243)."""
    types = np.array([[0, 0, 0, 0, 1, 1, 1]])
    prefix = one_span(types == 0).tolist()
    real = np.ones((1, 7), dtype=np.int64)
    good = reference(rows=prefix, real=real)
    assert findings([good], "paligemma", types=types, real=real, layer_types=("full_attention",)) == []
    full = np.ones_like(good)  # transformers#30918: every real token sees every real token
    [(_, found)] = findings([full], "paligemma", types=types, real=real, layer_types=("full_attention",))
    assert (found.code, found.cell) == ("span-leak", (0, 0, 4))
    assert "query 0 (prefix) sees later key 4 (suffix)" in found.message


def test_calls_the_token_types_do_not_place_are_left_alone():
    """A vision tower's attention inside the same model call, and a decode step given only its new token's type
    (which would read as position 0), are not judged; every language-model call of the prefill is."""
    tower = call(np.ones((2, 1, 9, 9), dtype=bool), 0, 0, "model.vision_tower.encoder.layers.{}.self_attn")
    decode = call(np.ones((2, 1, 1, 9), dtype=bool), 1, 1)
    decode.details["queries"] = (9, 10)
    language = call(reference(), 2, 1)
    top = Top("Gemma3ForConditionalGeneration", config(), {"token_type_ids": TYPES, "attention_mask": REAL}, 0, 3)
    run = Run([tower, decode, language], [top])
    assert check(run) == [] and explained(run) == {2}


GENERATE = '''
import sys
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, PaliGemmaConfig, PaliGemmaForConditionalGeneration

IMAGE, PAD = 60, 0
text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, sliding_window=3, layer_types=["sliding_attention", "full_attention"])
vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4)
if sys.argv[1] == "gemma3":
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE,
                          boi_token_index=61, eoi_token_index=62, pad_token_id=PAD)
    model = Gemma3ForConditionalGeneration
    input_ids = torch.tensor([[PAD, 5, 61, *[IMAGE] * 4, 62, 6], [5, 6, 61, *[IMAGE] * 4, 62, 7]])
    types = (input_ids == IMAGE).long()
else:
    text.pop("layer_types"); text.pop("sliding_window")
    config = PaliGemmaConfig(text_config=text, vision_config={**vision, "projection_dim": 16}, image_token_index=IMAGE,
                             projection_dim=16, pad_token_id=PAD)
    model = PaliGemmaForConditionalGeneration
    input_ids = torch.tensor([[PAD, PAD, *[IMAGE] * 4, 2, 5], [*[IMAGE] * 4, 2, 5, 6, 7]])
    types = torch.zeros_like(input_ids)
config._attn_implementation = sys.argv[2]
torch.manual_seed(0)
model = model(config).eval()
with torch.no_grad():
    model.generate(input_ids=input_ids, attention_mask=(input_ids != PAD).long(), token_type_ids=types,
                   pixel_values=torch.randn(2, 3, 8, 8), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
'''


@pytest.mark.parametrize("family, attn", [("gemma3", "eager"), ("paligemma", "sdpa")])
def test_no_false_alarm_on_a_left_padded_generate(tmp_path, family, attn):
    """A correct Gemma 3 / PaliGemma with an image per row, left-padded, prefill and two decode steps: no wrong
    finding, and no sees-later where the token types account for the later keys."""
    pytest.importorskip("transformers")
    script, out, saved = tmp_path / "generate.py", tmp_path / "t.json", tmp_path / "run.pt"
    script.write_text(GENERATE)
    result = runner.invoke(app, ["trace", "--json", str(out), "--save", str(saved), str(script), family, attn])
    data = json.loads(out.read_text())
    found = [f for group in data["groups"] for f in group["findings"]]
    assert data["exit_status"] == 0 and result.exit_code == 0, result.output
    assert [f for f in found if f["severity"] == "wrong" or f["code"] == "sees-later"] == [], result.output
    trace = tracefile.load(str(saved))
    prefill = [c for c in trace["calls"] if c["where"].startswith("model.language_model") and c["shape"][2] > 1]
    later = [np.triu(tracefile.keep_of(c, trace)[1, 0], 1).any() for c in prefill]  # the unpadded row
    assert prefill and all(later), result.output  # every layer's prefill has its span seen both ways, and was judged


# spans a hand-written model call states without token_type_ids

def test_a_prefix_lm_boundary_one_token_short_is_found_by_the_prefix_len_the_model_is_called_with(tmp_path):
    from checkbugs import caught, first

    hit = caught(tmp_path, "prefix_lm_one_short", ("span-not-bidirectional",))
    prefix = 5  # the first 5 tokens see each other both ways; the program's mask made the first 4 so
    expected = first((1, 8, 8), lambda b, q, k: q < k < prefix and not (k < prefix - 1 and q < prefix - 1))
    assert tuple(hit["cell"]) == expected


def test_an_image_span_placed_from_another_rows_image_mask_is_found_on_a_left_padded_batch(tmp_path):
    from checkbugs import caught, first

    hit = caught(tmp_path, "image_span_first_row", ("span-not-bidirectional",))
    image = [[0, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0]]  # one image per row
    # what the program let through above the diagonal: row 0's image, in every row
    expected = first((2, 8, 8), lambda b, q, k: q < k and image[b][q] and image[b][k] and not (image[0][q] and image[0][k]))
    assert tuple(hit["cell"]) == expected


def test_image_tokens_a_model_attends_causally_are_quiet(tmp_path):
    """LLaVA attends its image tokens causally: an image_mask says where they are, not that they are bidirectional."""
    import json

    from checkbugs import runner
    from maskcli.commands import app

    script = tmp_path / "llava.py"
    script.write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "class M(nn.Module):\n"
        "    def forward(self, x, image_mask):\n"
        "        return F.scaled_dot_product_attention(x, x, x, is_causal=True)\n"
        "M()(torch.randn(1, 2, 6, 4), torch.tensor([[0, 1, 1, 1, 0, 0]]).bool())\n")
    out = tmp_path / "t.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
    found = [f for g in json.loads(out.read_text())["groups"] for f in g["findings"]]
    assert result.exit_code == 0 and [f for f in found if f["severity"] != "note"] == [], result.output


def test_spans_stated_by_a_hand_written_model_calls_arguments_match_a_loop_over_positions():
    import numpy as np

    from maskcli.checks.context import Top
    from maskcli.checks.spans import _stated

    mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])  # row 0 left-padded by 2

    def ids(found):
        return found[1].tolist()

    def loop(span):  # block ids: each run of span tokens numbered 0, 1, ... per row, -1 elsewhere
        out = []
        for row in span:
            number, before, ids_ = -1, False, []
            for inside in row:
                number += inside and not before
                ids_.append(number if inside else -1)
                before = inside
            out.append(ids_)
        return out

    starts = [2, 0]
    prefix = [[starts[b] <= t < starts[b] + 3 for t in range(8)] for b in range(2)]
    assert ids(_stated(Top("M", arguments={"attention_mask": mask, "prefix_len": 3}), 2, 8)) == loop(prefix)
    images = [[starts[b] <= t < starts[b] + 2 for t in range(8)] for b in range(2)]
    found = _stated(Top("M", arguments={"attention_mask": mask, "num_image_tokens": 2}), 2, 8)
    assert ids(found) == loop(images) and not found[0].stated
    at = np.array([[3, 4, 6], [1, 2, 6]])
    placed = [[t in at[b].tolist() for t in range(8)] for b in range(2)]
    assert ids(_stated(Top("M", arguments={"pixel_positions": at}), 2, 8)) == loop(placed)
    assert _stated(Top("M", arguments={"attention_mask": mask}), 2, 8) is None


def test_gemma4_vision_spans_stated_by_a_config_of_the_programs_own_and_the_image_token_id(tmp_path):
    """vllm#47217 (written blind): a dataclass config in main() whose text_config states use_bidirectional_attention=
    "vision" and whose outer config the image_token_id, flattened (L,) input ids; the 8-token image over the window
    ran causal on the sliding layer. Written another way: a dict at the top of the program (`image_token_index`), a
    batch of 2, overlay on the wrong layer by `i % 2` (causal sliding layer, bidirectional full one). Both fixes quiet."""
    from checkbugs import ROWS, caught, first

    found = check_bug(tmp_path, "vllm_gemma4_image_bidirectional_range_dropped_over_window", "span-not-bidirectional")
    ids = [2, 11] + [7] * 8 + [12] + [7] * 3 + [13, 14]
    # the first later key of a query's own image within the window, that the causal sliding layer hides
    image = [i for i, t in enumerate(ids) if t == 7 and 2 <= i <= 9]
    expected = first((1, 16, 16), lambda b, q, k: q in image and k in image and q < k < q + 6)
    assert tuple(found[0]["cell"]) == expected
    hit = caught(tmp_path, "vision_spans_on_wrong_layers_dict_config", ("span-not-bidirectional", "span-leak"))
    rows = [[1, 9, 9, 9, 4, 5, 6], [1, 2, 3, 9, 9, 9, 7]]
    assert tuple(hit["cell"]) == first((2, 7, 7), lambda b, q, k: rows[b][q] == rows[b][k] == 9 and q < k < q + 4)


def test_gemma4_images_made_bidirectional_where_the_config_leaves_them_causal(tmp_path):
    """NVIDIA-NeMo/Megatron-Bridge#5333 (written blind): a SimpleNamespace config held by Gemma4VLModel, its text
    config's use_bidirectional_attention None (gemma-4-E2B), yet the image blocks are or-ed on; the fix returns the
    causal mask. The first cell: a double loop over later keys of the same image run in the program's ids."""
    from checkbugs import first

    [hit, *_] = check_bug(tmp_path, "megatron_bridge_gemma4_vl_image_block_bidirectional_unconditional", "span-leak")
    ids = [[2, 3, 7, 7, 7, 7, 4, 5, 6], [2, 7, 7, 7, 3, 4, 5, 6, 8]]
    assert tuple(hit["cell"]) == first((2, 9, 9), lambda b, q, k: q < k and ids[b][q] == ids[b][k] == 7
                                       and all(t == 7 for t in ids[b][q:k + 1]))
    assert "use_bidirectional_attention=None" in hit["message"]


def test_gemma4_port_with_a_dict_config_left_padded(tmp_path):
    """Written another way (tests/data/fixq2): the config a dict at the program's top level (model_type "gemma4"),
    a left-padded batch, an additive mask for an eager softmax. The cells counted are a loop's: later real keys of
    the query's own image run (all of them, as the config says causal)."""
    from checkbugs import first

    folder = Path(__file__).parent / "data" / "fixq2"
    [hit] = check_bug(tmp_path, "gemma4_port_dict_config_image_block_unconditional", "span-leak", folder)
    ids = [[0, 0, 2, 9, 9, 9, 3, 4], [2, 3, 9, 9, 9, 9, 9, 4]]
    same = lambda b, q, k: q < k and all(t == 9 for t in ids[b][q:k + 1])
    cells = sum(same(b, q, k) for b in range(2) for q in range(8) for k in range(8))
    assert f"({cells} cells)" in hit["message"] and tuple(hit["cell"]) == first((2, 8, 8), same)


def test_a_none_use_bidirectional_attention_speaks_only_for_gemma4():
    """Gemma 3's field is a bool about text (its images are bidirectional whatever it says): None there, or in a
    config naming no family, states nothing of the images; a Gemma 4 one does."""
    from maskcli.checks.intent import Stated, fields_of
    from maskcli.checks.spans import _images_causal

    def top(config, holder):
        return Top("M", stated=(Stated(f"self.config of {holder} (SimpleNamespace)", "", fields_of(config)),))

    text = SimpleNamespace(hidden_size=8, use_bidirectional_attention=None)
    config = SimpleNamespace(image_token_id=5, text_config=text)
    assert _images_causal(top(config, "Gemma4ForConditionalGeneration")) == (5, "self.config of "
                                                                            "Gemma4ForConditionalGeneration (SimpleNamespace)")
    assert _images_causal(top(config, "Gemma3ForConditionalGeneration")) is None
    assert _images_causal(top(config, "VisionLanguageModel")) is None
    vision = SimpleNamespace(image_token_id=5, text_config=SimpleNamespace(use_bidirectional_attention="vision"))
    assert _images_causal(top(vision, "Gemma4ForConditionalGeneration")) is None


def test_an_image_prefix_stated_by_unmask_image_and_the_eoi_token_runs_causal_on_an_unpadded_batch(tmp_path):
    """surya 2791d60's bug written another way (tests/data/rows): a dict config held as `self.cfg` states
    unmask_image with eoi_token_id; the mask builder's fast path for an unpadded batch hands SDPA is_causal and skips
    the image prefix, which its padded path (a left-padded batch, quiet) or-s on. The first cell and the count are a
    double loop's over the unpadded batch: a real query at or before its row's EOI that misses a later key there."""
    from checkbugs import caught, first

    hit = caught(tmp_path, "ocr_decoder_unpadded_fast_path_skips_image_prefix", ("span-not-bidirectional",))
    eoi = [3, 5]  # the unpadded batch: each row's EOI token at its own place
    inside = lambda b, q, k: q < k <= eoi[b]
    cells = sum(inside(b, q, k) for b in range(2) for q in range(8) for k in range(8))
    assert tuple(hit["cell"]) == first((2, 8, 8), inside) and f"({cells} cells)" in hit["message"]
    assert "unmask_image=True" in hit["message"]


def test_the_eoi_prefix_is_each_rows_start_to_its_first_eoi_token():
    """eoiprefix.prefix's block ids against a loop over the ids: 0 through the row's first EOI token (the padding
    before it too: the judge leaves padding out), -1 after it and in a row with none; nothing without unmask_image."""
    from maskcli.checks import eoiprefix
    from maskcli.checks.intent import Stated, fields_of

    ids = np.array([[0, 0, 5, 6, 7, 6], [5, 5, 5, 5, 6, 7], [5, 7, 7, 7, 7, 7]])
    call = SimpleNamespace(where="layers.0", shape=(3, 1, 6, 6), index=0)

    def run(config):
        top = Top("M", arguments={"input_ids": ids}, stated=(Stated("self.cfg of M (dict)", None, fields_of(config)),),
                  first=0, end=1)
        return Run([call], [top]), top

    said, top = run({"unmask_image": True, "eoi_token_id": 6})
    assert eoiprefix.stated(top)
    argument, blocks = eoiprefix.prefix(said, call, top)
    expected = [[0 if 6 in row.tolist() and t <= row.tolist().index(6) else -1 for t in range(6)] for row in ids]
    assert blocks.tolist() == expected and "eoi_token_id=6" in argument
    for config in ({"unmask_image": False, "eoi_token_id": 6}, {"unmask_image": True}):
        said, top = run(config)
        assert not eoiprefix.stated(top)


def test_gemma4_port_whose_dataclass_config_holds_its_text_config_as_a_field(tmp_path):
    """Automodel#1891's shape written another way (tests/data/fixq2): a composite dataclass config with no
    get_text_config(), its `text_config` field stating use_bidirectional_attention="vision", and mm_token_type_ids
    ignored by the mask builder (each image causal on the sliding layer). The cell: a loop over later keys of the
    query's own image within the window."""
    from checkbugs import first

    folder = Path(__file__).parent / "data" / "fixq2"
    [hit] = check_bug(tmp_path, "gemma4_port_dataclass_text_config_images_causal", "span-not-bidirectional", folder)
    ids = [[2, 9, 9, 9, 9, 4, 0, 0], [2, 3, 9, 9, 9, 5, 6, 4]]
    same = lambda b, q, k: q < k < q + 3 and all(t == 9 for t in ids[b][q:k + 1])
    assert tuple(hit["cell"]) == first((2, 8, 8), same)


def test_a_ports_text_config_field_is_its_text_part():
    from maskcli.checks.configread import text_part

    text = SimpleNamespace(use_bidirectional_attention="vision")
    assert text_part(SimpleNamespace(text_config=text)) is text
    plain = SimpleNamespace(text_config={"hidden_size": 8})
    assert text_part(plain) is plain
    assert text_part(text) is text
