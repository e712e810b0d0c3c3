"""`maskcli model`: the table at 60 and 120 columns, --expect, --json, --save read back by show, --png, one-line
refusals, and the command without transformers. The masks are checked against a double loop in tests/test_hf.py;
here against the same rule on the saved trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from maskcli.commands import app

os.environ["HF_HUB_OFFLINE"] = "1"
runner = CliRunner()


def model(*args, columns: int = 120):
    return runner.invoke(app, ["model", *map(str, args)], env={"COLUMNS": str(columns), "NO_COLOR": "1"})


def rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.split()[:1] in (["prefill"], ["decode"])]


def test_without_transformers_the_command_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    result = model("llama")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == 'maskcli: error: maskcli model needs transformers: pip install "maskcli[hf]" (in a clone of maskcli: pip install -e ".[hf]")\n'


def test_help_imports_neither_torch_nor_transformers():
    code = ("import sys\nfrom maskcli.commands import main\nsys.argv = ['maskcli', 'model', '--help']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('LOADED', [m for m in ('torch', 'transformers') if m in sys.modules], file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOADED []" in result.stderr and "FAMILY|CONFIG.json" in result.stdout, result.stderr[-500:]


def _installed() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


needs_hf = pytest.mark.skipif(not _installed(), reason="maskcli model needs the hf extra (transformers)")


@needs_hf
def test_the_table_names_each_layer_types_mask_at_each_step_at_120_and_60_columns():
    wide = model("gemma3_text", "--window", 3, "--lengths", "5,3", "--new-tokens", 2)
    assert wide.exit_code == 0, wide.output
    lines = wide.stdout.splitlines()
    assert lines[0] == "maskcli model gemma3_text: Gemma3TextConfig, 6 layers, 18 attention calls in 5 groups"
    assert lines[1] == "masks shaped by: sliding_window 3; layer_types sliding_attention x5, full_attention"
    assert lines[2] == "ids 1,2,3,4,5;0,0,8,9,10 (pad id 0, left padding); 3 steps"
    assert rows(wide.stdout) == [["prefill", "#0", "window(3)", "5x5", "#1", "causal", "5x5"],
                                 ["decode", "1", "#2", "causal", "1x3", "#3", "causal", "1x6"],
                                 ["decode", "2", "#2", "causal", "1x3", "#4", "causal", "1x7"]]
    assert "#0 window(3) (--lengths 5,3 --pad left) · sdpa (2,2,5,5) · model.layers.{0-4}.self_attn" in wide.stdout
    narrow = model("gemma3_text", "--window", 3, "--lengths", "5,3", "--new-tokens", 2, columns=60)
    assert narrow.exit_code == 0 and max(map(len, narrow.stdout.splitlines())) <= 60
    assert rows(narrow.stdout) == rows(wide.stdout)
    # under the table, a wrapped line stands under its text, never at column 0: a group's line under '#N '
    below = narrow.stdout.split("\n\n")[-1].splitlines()
    assert below[:2] == ["#0 window(3) (--lengths 5,3 --pad left) · sdpa (2,2,5,5) ·", "   model.layers.{0-4}.self_attn"]
    assert all(line.startswith(("#", "   ", "cache: ", "       ")) for line in below), below
    assert narrow.stdout.splitlines()[2] == "masks shaped by: sliding_window 3; layer_types"


@needs_hf
def test_expect_by_layer_type_holds_with_exit_0_and_fails_with_exit_1():
    held = model("gemma3_text", "--window", 3, "--attn", "eager", "--expect", "sliding_attention=window(3)", "--expect", "full*=causal")
    assert held.exit_code == 0, held.output
    assert "--expect: every call matched holds (2 expectations)" in held.stdout
    # a static cache: the prefill's queries face every slot, the ones not yet filled after them
    static = model("llama", "--cache", "static", "--expect", "full_attention=causal")
    assert static.exit_code == 0 and "causal (--kv-len 7 --lengths 7,5 --pad left) · sdpa (2,2,5,7)" in static.stdout, static.output
    assert model("llama", "--cache", "static", "--expect", "full_attention=window(2)").exit_code == 1
    wrong = model("mistral", "--window", 3, "--new-tokens", 1, "--expect", "sliding_attention=window(2)")
    assert wrong.exit_code == 1
    text = " ".join(wrong.stdout.split())
    assert ("--expect sliding_attention=window(2): call 0 (model.layers.0.self_attn prefill, sdpa) differs from window(2) "
            "with the padding found (--lengths 5,3 --pad left): batch 0 row 2: the call sees 0-2, window(2) sees 1-2") in text
    assert "3 more calls differ: 1-3" in text


@needs_hf
def test_json_has_every_call_and_save_is_a_trace_show_reads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = model("llama", "--lengths", "2,4", "--pad", "right", "--new-tokens", 1, "--json", "--save", "run.pt")
    # right padding in generate: row 0's first new token comes from the output of a pad (position 3), as transformers
    # warns ("right-padding was detected"); a wrong finding exits 1, and the JSON and the trace are still written
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    found = [f for group in data["groups"] for f in group["findings"]]
    assert [(f["code"], f["severity"], f["cell"]) for f in found] == [("continued-from-padding", "wrong", [0, 4, 3])]
    assert data["ids"] == [[1, 2, 0, 0], [8, 9, 10, 11]] and data["steps"] == ["prefill", "decode 1"]
    assert [(c["where"], c["step"], c["details"]["layer_type"]) for c in data["calls"]] == [
        (f"model.layers.{layer}.self_attn", step, "full_attention") for step in (0, 1) for layer in (0, 1)]
    shown = runner.invoke(app, ["show", "--mask", "run.pt:model.layers.1.self_attn@1", "--json"])
    assert shown.exit_code == 0, shown.output
    # decode 1: the query at position 4 sees the real keys up to itself; right padding leaves 2-3 of row 0 unseen
    valid = [[1, 1, 0, 0, 1], [1, 1, 1, 1, 1]]
    want = [[[[int(k <= 4 and valid[b][k]) for k in range(5)]]] * 2 for b in range(2)]  # 2 heads
    assert json.loads(shown.stdout)["mask"] == want


@needs_hf
def test_a_sliding_cache_keeps_the_window_and_the_full_layers_get_every_slot():
    result = model("gemma3_text", "--window", 3, "--lengths", "6,4", "--new-tokens", 1, "--cache", "sliding", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    shapes = {(c["details"]["layer_type"], c["step"]): c["shape"][2:] for c in data["calls"]}
    assert shapes[("sliding_attention", 0)] == [6, 6] and shapes[("sliding_attention", 1)] == [1, 3]
    assert shapes[("full_attention", 0)][1] == shapes[("full_attention", 1)][1] >= 7  # the static slots
    names = {(cell["layer_type"], cell["step"]): cell["cells"][0]["name"].split(" ")[0] for cell in data["table"]}
    assert names[("sliding_attention", "prefill")] == "window(3)" and names[("full_attention", "decode 1")] == "causal"


@needs_hf
def test_each_mask_is_checked_against_its_caches_keys_and_a_disagreement_exits_1(monkeypatch):
    args = ("mistral", "--window", 3, "--lengths", "7,4", "--new-tokens", 2, "--cache", "static", "--prefill-chunk", 4)
    held = model(*args, "--json")
    assert held.exit_code == 0, held.output
    data = json.loads(held.stdout)
    assert data["cache"] == {"lines": ["cache: each step's mask is as wide as the keys its cache returned, on their "
                                       "positions (8 calls)"], "holds": True, "first": None}
    # the sliding layers' keys where the static cache's shifted slots hold them: W-1 kept keys before each chunk's queries
    keys = {(c["step"], c["details"]["layer"]): (c["details"]["queries"], c["details"]["keys"]) for c in data["calls"]}
    assert [keys[(step, 0)] for step in range(4)] == [([0, 4], [0, 4]), ([4, 7], [2, 7]), ([7, 8], [5, 8]), ([8, 9], [6, 9])]
    from transformers.cache_utils import StaticSlidingWindowLayer

    original = StaticSlidingWindowLayer.get_mask_sizes
    monkeypatch.setattr(StaticSlidingWindowLayer, "get_mask_sizes",  # a runtime whose mask forgets the cache dropped keys
                        lambda self, query_length: (original(self, query_length)[0], 0))
    wrong = model(*args)
    assert wrong.exit_code == 1
    text = " ".join(wrong.stdout.split())
    assert ("cache: layer 0 (sliding_attention) at prefill 2/2: the mask's key column 0 is position 0 (kv_offset 0), the "
            "cache's slot 0 holds position 2; first cell: query 4, key column 0") in text
    first = json.loads(model(*args, "--json").stdout)["cache"]["first"]
    assert (first["layer"], first["step"], first["query"], first["key"]) == (0, "prefill 2/2", 4, 0)


@needs_hf
def test_png_draws_each_layer_type_at_each_step(tmp_path):
    import matplotlib.image

    result = model("mistral", "--window", 2, "--new-tokens", 1, "--png", tmp_path / "m.png")
    assert result.exit_code == 0 and "wrote" in result.stderr
    pixels = matplotlib.image.imread(tmp_path / "m.png")
    blue = np.all(np.abs(pixels[..., :3] - np.array([31, 119, 180]) / 255) < 0.02, axis=-1)
    assert blue.sum() > 1000  # visible cells drawn in the figure's keep colour


@needs_hf
@pytest.mark.parametrize("expect, says", [
    ("full*=windo(3)", "--expect 'full*=windo(3)': unknown mask kind 'windo' in 'windo(3)': did you mean window?"),
    ("x=window(0)", "--expect 'x=window(0)': window(0): window must be at least 1"),
])
def test_a_bad_expect_expression_is_one_line_before_the_model_is_built(monkeypatch, expect, says):
    import maskcli.hf.families as families

    def load(*args, **kwargs):
        raise AssertionError("the model was built before --expect was checked")

    monkeypatch.setattr(families, "load", load)
    result = model("llama", "--expect", expect)
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"maskcli: error: {says}")


@needs_hf
@pytest.mark.parametrize("args, says", [
    (["llama", "--attn", "flash"], "--attn 'flash': choose sdpa, eager or flex"),
    (["llama", "--cache", "paged"], "--cache 'paged': choose dynamic, static or sliding"),
    (["llama", "--window", "3"], "llama has no sliding_window in its config"),
    (["lama"], "unknown model family 'lama'"),
    (["llama", "--lengths", "3", "--ids", "1,2"], "either --lengths or --ids"),
    (["llama", "--expect", "full_attention"], "give PATTERN=EXPR"),
    (["llama", "--ids", "1,2;3"], "pad every row to the same length"),
    ([], "give a model family or a config.json"),
    (["--try"], "--try goes with --list"),
    (["prophetnet"], "prophetnet cannot be made tiny: setting num_hidden_layers fails (NotImplementedError"),
    (["gemma2"], "gemma2 has no --attn sdpa in transformers "),
    # hunt 5: 2^63 ended in "mistral cannot run --attn sdpa --cache dynamic: ValueError: Overflow when unpacking long long"
    (["mistral", "--window", str(2**63)], f"--window {2**63}: give 1 to 1,099,511,627,776 tokens"),
    (["llama4_text", "--chunk-size", str(2**41)], f"--chunk-size {2**41}: give 1 to 1,099,511,627,776 tokens"),
    (["llama", "--prefill-chunk", str(2**63)], f"--prefill-chunk {2**63}: give 1 to 1,099,511,627,776 tokens"),
    (["/dev/null"], "'/dev/null' is not a regular file: give a local config.json"),  # was "no such config file"
])
def test_bad_input_is_one_line(args, says):
    result = model(*args)
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("maskcli: error: ") and says in line
    if args == ["gemma2"]:
        assert line.endswith("(Gemma2ForCausalLM._supports_sdpa is False): try --attn eager or flex")
        assert model("gemma2", "--attn", "eager", "--new-tokens", 0).exit_code == 0


@needs_hf
@pytest.mark.parametrize("family, attn, flag, choices", [("gpt_oss", "sdpa", "GptOssForCausalLM._supports_sdpa", "eager or flex"),
                                                         ("gpt2", "flex", "GPT2LMHeadModel._supports_flex_attn", "eager or sdpa")])
def test_an_attention_the_family_lacks_is_refused_before_the_model_is_built(monkeypatch, family, attn, flag, choices):
    """transformers refuses them itself, after building: modeling_utils.py's PreTrainedModel._sdpa_can_dispatch and
    _flex_attn_can_dispatch raise ValueError where the class's _supports_sdpa / _supports_flex_attn is False
    (gpt_oss: modeling_gpt_oss.py:380, `_supports_sdpa = False`)."""
    import maskcli.hf.run as hf_run

    def build(*args, **kwargs):
        raise AssertionError("the model was built before --attn was checked")

    monkeypatch.setattr(hf_run, "build", build)
    result = model(family, "--attn", attn)
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"maskcli: error: {family} has no --attn {attn} in transformers ")
    assert line.endswith(f"({flag} is False): try --attn {choices}")


@needs_hf
def test_gpt_oss_sink_logit_is_no_key_in_the_text_as_in_the_figure():
    """GPT-OSS's eager attention softmaxes torch.cat([attn_weights, sinks], dim=-1)
    (transformers/models/gpt_oss/modeling_gpt_oss.py:244): its last column is the sink logit, never masked, on no
    key. Read as a key it made every mask 'no expression rebuilds it' and 'sees later keys'; left out, the masks are
    the window and causal masks of the other families, as wide as the cache's keys (7 cached at decode 1)."""
    result = model("gpt_oss", "--attn", "eager", "--window", 3, "--lengths", "6,3", "--new-tokens", 2)
    assert result.exit_code == 0, result.output
    assert rows(result.stdout) == [["prefill", "#0", "window(3)", "6x6", "#1", "causal", "6x6"],
                                   ["decode", "1", "#2", "causal", "1x3", "#3", "causal", "1x7"],
                                   ["decode", "2", "#2", "causal", "1x3", "#4", "causal", "1x8"]]
    assert "sees-later" not in result.stdout and "no expression" not in result.stdout
    assert "#0 window(3) (--lengths 6,3 --pad left) · softmax (2,2,6,6) (the sink logit's column 6 left out)" in result.stdout
    # a padding query sees only the sink: softmax gives it the whole weight, the keys none, so the output is 0
    assert "query rows 0-2 of batch row 1 see no key at all: 0 output there (the sink logit" in result.stdout


@pytest.mark.parametrize("args, named", [
    (["mistral", "--png", "out.pt", "--list", "--lengths", "Ò¸…", "--try"], "FAMILY 'mistral', --lengths, --png"),  # a fuzz case: 11 minutes before
    (["--list", "--json"], "--json"),
    (["--try", "--list", "--attn", "eager", "--new-tokens", "0"], "--new-tokens, --attn"),
])
def test_list_refuses_the_flags_it_would_ignore_before_building_anything(args, named, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # refused before transformers is needed, with or without it
    result = model(*args)
    assert result.exit_code == 2 and result.stdout == "" and not (tmp_path / "out.pt").exists()
    assert result.stderr == f"maskcli: error: --list uses only --try, not {named}: drop them, or drop --list to run one family\n"


@needs_hf
def test_a_config_json_and_list(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 2, "max_window_layers": 0}))
    result = model(path, "--new-tokens", 1)
    assert result.exit_code == 0, result.output
    assert rows(result.stdout)[0][:3] == ["prefill", "#0", "window(2)"]
    listed = model("--list")
    assert listed.exit_code == 0
    lines = {line.split()[0]: line for line in listed.stdout.splitlines() if line.strip()}
    assert "sliding_window 4096" in lines["mistral"] and "sliding_window 4096; layer_types" in lines["gemma3_text"]


@needs_hf
def test_list_is_a_compact_table_a_family_a_line_where_it_fits():
    listed = runner.invoke(app, ["model", "--list"], env={"COLUMNS": "120"})
    assert listed.exit_code == 0
    body = listed.stdout.splitlines()[4:]  # after the title, a blank line, the header and its rule
    families = [line for line in body if line.strip() and not line.startswith("  ")]
    assert all(len(line) <= 120 for line in body)
    assert len(body) <= 1.25 * len(families), (len(body), len(families))  # was 1.6 lines a family (328 for 196)
    lines = {line.split()[0]: line.rstrip() for line in families}
    assert lines["llama"].split(None, 1)[1] == "causal (no window, chunks or layer types)"
    assert lines["mistral"].split(None, 1)[1] == "sliding_window 4096; layer_types sliding_attention (every layer)"


@needs_hf
def test_prefill_chunk_steps_and_the_check_against_one_pass():
    result = model("gemma3_text", "--window", 3, "--lengths", "6,4", "--new-tokens", 1, "--prefill-chunk", 3)
    assert result.exit_code == 0, result.output
    assert [row[:2] for row in rows(result.stdout)] == [["prefill", "1/2"], ["prefill", "2/2"], ["decode", "1"]]
    assert rows(result.stdout)[1][2:] == ["#1", "window(3)", "3x5", "#2", "causal", "3x6"]  # 2 cached keys + 3 new
    assert "--prefill-chunk 3: in every layer the 2 chunks' masks put together equal the single-pass prefill mask" in result.stdout


@needs_hf
def test_the_readme_example_prints_what_the_readme_shows():
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"```text\n\$ (maskcli model [^\n]*)\n(.*?)```", readme, re.S)
    result = model(*shlex.split(block.group(1))[2:], columns=100)
    assert result.exit_code == 0, result.output
    assert [line.rstrip() for line in result.stdout.splitlines()] == block.group(2).rstrip("\n").splitlines()


@needs_hf
@pytest.mark.parametrize("args", [
    # docs/gallery.md, Llama 4 chunked attention: maskcli show "local(3)" --ids "0,0,5,6,7,8,9,4;1,2,3,4,5,6,7,8"
    ["llama4_text", "--chunk-size", 3, "--ids", "0,0,5,6,7,8,9,4;1,2,3,4,5,6,7,8", "--expect", "chunked_attention=local(3)"],
    # docs/gallery.md, Mistral's sliding window behind a cache: window(4), 3 queries after 5 prefilled tokens
    ["mistral", "--window", 4, "--lengths", 8, "--prefill-chunk", 5, "--expect", "sliding_attention=window(4)"],
])
def test_the_gallerys_model_family_entries_are_what_the_families_build(args):
    result = model(*args, "--new-tokens", 1)
    assert result.exit_code == 0, result.output
    assert "--expect: every call matched holds (1 expectation)" in result.stdout


@needs_hf
def test_png_draws_every_one_query_decode_panel_one_cell_tall(tmp_path):
    # llama4's chunked layers decode over 4 keys, its full layers over 7: at equal aspect the 4-key row was drawn
    # nearly twice as tall as the 7-key one (issue 28, item 16)
    import matplotlib.image

    result = model("llama4_text", "--chunk-size", 4, "--lengths", "6,4", "--png", tmp_path / "l.png")
    assert result.exit_code == 0, result.output
    pixels = np.round(matplotlib.image.imread(tmp_path / "l.png")[..., :3] * 255).astype(int)
    ours = np.zeros(pixels.shape[:2], dtype=bool)
    for colour in ((31, 119, 180), (224, 224, 224)):  # the kept and masked colours (render/heatmaps.py)
        ours |= np.abs(pixels - np.array(colour)).max(axis=-1) <= 3
    tall = []
    for x in (int(pixels.shape[1] * 0.45), int(pixels.shape[1] * 0.8)):  # through the decode 1 and decode 2 panels
        column = np.concatenate(([False], ours[: int(pixels.shape[0] * 0.95), x], [False]))
        starts, ends = np.flatnonzero(column[1:] & ~column[:-1]), np.flatnonzero(column[:-1] & ~column[1:])
        tall += [int(e - s) + 1 for s, e in zip(starts, ends) if e - s > 8]
    # 2 layer types x 2 batch rows x 2 steps, one height within the few pixels the layout rounds (before: 105 and 60)
    assert len(tall) == 8 and max(tall) - min(tall) <= 5, tall


@needs_hf
def test_png_legend_names_the_cache_not_offset_and_no_label_meets_a_title(tmp_path, monkeypatch):
    import maskcli.render.heatmaps as heatmaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figures = []
    monkeypatch.setattr(heatmaps, "save_figure", lambda figure, path: figures.append(figure))
    result = model("llama", "--png", tmp_path / "out.png")
    assert result.exit_code == 0, result.output
    figure = figures[0]
    assert [text.get_text() for text in figure.legends[0].get_texts()] == [
        "may attend (True)", "masked (False)", "cached keys | new keys (the model's KV cache)",
        "padding (a hatched band beside its keys and queries)", "diagonal: right of this edge, later keys",
    ]
    FigureCanvasAgg(figure).draw()
    renderer = figure.canvas.get_renderer()
    texts = [figure._suptitle] + [t for ax in figure.axes if ax.get_title() for t in (ax.title, ax.xaxis.label)]
    assert sum("key position (kv)" == t.get_text() for t in texts) == 6  # 2 batch rows x prefill and 2 decode steps
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    meeting = [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1:] if box.overlaps(other)]
    assert meeting == []


@needs_hf
def test_laguna_decode_is_one_query_per_head_and_its_chunked_prefill_with_a_window_holds():
    """Laguna keeps its heads per layer (48 each): made tiny in every layer, a decode step is 1 query at its position
    (not 24 'queries' of packed heads, which no expression rebuilt) and --prefill-chunk compares without an error."""
    result = model("laguna")
    assert result.exit_code == 0, result.output
    assert [row[1:] if row[0] == "prefill" else row[2:] for row in rows(result.stdout)] == [
        ["#0", "causal", "5x5"], ["#1", "causal", "1x6"], ["#2", "causal", "1x7"]]
    assert "#1 causal (--lengths 6,4 --pad left) · sdpa (2,2,1,6) · model.layers.{0-1}.self_attn" in result.stdout
    result = model("laguna", "--lengths", "7,4", "--prefill-chunk", 3, "--window", 3)
    assert result.exit_code == 0, result.output
    assert "--prefill-chunk 3: in every layer the 3 chunks' masks put together equal the single-pass prefill mask" in result.stdout


@needs_hf
@pytest.mark.parametrize("family, said", [
    ("diffllama", ["--prefill-chunk 2: in every layer the 3 chunks' masks put together equal the single-pass prefill mask"]),
    ("lfm3", ["--prefill-chunk 2: in every layer that attends the 3 chunks' masks put together equal the single-pass prefill mask",
              "--prefill-chunk 2: layers 0-1, 3 (conv) make no attention call: no mask to compare"])])
def test_prefill_chunk_holds_for_a_layer_attending_twice_and_for_layers_without_attention(family, said):
    result = model(family, "--prefill-chunk", 2, columns=200)
    assert result.exit_code == 0, result.output
    assert [line for line in result.stdout.splitlines() if line.startswith("--prefill-chunk")] == said


@needs_hf
def test_a_config_of_100000_layers_is_refused_up_front_saying_what_it_would_build(tmp_path):
    """A gemma3_text config whose one full_attention layer is its last of 100,000: the tiny model kept layers up to
    one of each type, built 100,000 of them (minutes), then refused them by their parameter count."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(num_hidden_layers=100_000, layer_types=["sliding_attention"] * 99_999 + ["full_attention"])
    config.save_pretrained(tmp_path)
    result = model(tmp_path / "config.json")
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr == (
        f"maskcli: error: {tmp_path / 'config.json'} (gemma3_text): its first full_attention layer is layer 99,999, so a "
        "tiny model with one layer of each type would have 100,000 layers, past the 256 maskcli builds (about 3,000,000 "
        "parameters): give a config.json whose layer_types has each type within its first 256 layers (num_hidden_layers "
        "to match)\n")


@needs_hf
def test_a_config_of_a_million_layers_is_read_in_seconds_and_a_huge_window_refused(tmp_path):
    """A llama config of 10^6 layers read each layer's kind afresh from the config (a runaway past 90 s); a window of
    2^63 in a config.json overflowed inside transformers."""
    import json
    import time

    (tmp_path / "many.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": 10**6, "sliding_window": 4,
                                                    "use_sliding_window": True, "max_window_layers": 999_999}))
    start = time.process_time()
    result = model(tmp_path / "many.json")
    assert time.process_time() - start < 60, "a hang guard: about 2 s here"
    assert result.exit_code == 2 and "its first sliding_attention layer is layer 999,999, so a tiny model with one " \
        "layer of each type would have 1,000,000 layers" in result.stderr  # qwen2: layers from max_window_layers on slide
    (tmp_path / "wide.json").write_text(json.dumps({"model_type": "mistral", "sliding_window": 2**63 - 1}))
    result = model(tmp_path / "wide.json")
    assert result.exit_code == 2 and result.stderr == (
        f"maskcli: error: '{tmp_path / 'wide.json'}': sliding_window {2**63 - 1} is past the 1,099,511,627,776 tokens "
        "maskcli runs: give a smaller one\n")


@needs_hf
def test_a_long_run_says_its_cost_up_front_and_how_to_narrow_it(monkeypatch):
    from maskcli.hf import budget

    # the command's own maximums (16 rows of 512 tokens, 512 decode steps): a minute or more, said before it starts
    seconds, sizes = budget.estimate(2, 16, 512, 512, None)
    assert seconds >= budget.NOTICE_S and sizes == "513 steps x 2 layers x 16 rows, up to 1,024 keys"
    assert budget.estimate(2, 2, 5, 2, None)[0] < budget.NOTICE_S  # the default run is quiet
    monkeypatch.setattr(budget, "NOTICE_S", 0)  # a small run, told as a long one is
    result = model("llama", "--lengths", "5,3", "--new-tokens", "2")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert said.startswith("maskcli: warning: model llama: about ") and said.endswith(
        " of work on a CPU (3 steps x 2 layers x 2 rows, up to 7 keys); fewer --new-tokens or shorter --lengths finish "
        "sooner (Ctrl-C stops it)"), said


@needs_hf
def test_each_decode_step_is_told_to_the_progress_bar(monkeypatch):
    import contextlib

    from maskcli.commands import progress as bar

    heard = []

    @contextlib.contextmanager
    def recording(what):
        heard.append(what)
        yield lambda done, total: heard.append((done, total))

    monkeypatch.setattr(bar, "progress", recording)
    result = model("llama", "--lengths", "4,2", "--new-tokens", "3", "--json")
    assert result.exit_code == 0, result.output
    steps = json.loads(result.stdout)["steps"]
    assert steps == ["prefill", "decode 1", "decode 2", "decode 3"]  # generate's 4 tokens: the prefill's and 3 decodes'
    assert heard == ["model llama: decode steps", (1, 4), (2, 4), (3, 4), (4, 4)]


@needs_hf
def test_a_kv_shared_layers_sliced_prefill_is_its_last_query_and_no_finding():
    result = model("gemma4_unified_assistant")
    assert result.exit_code == 0, result.output
    assert "#1 causal (--lengths 5,3 --pad left) · sdpa (2,2,1,5) · model.layers.{6-11}.self_attn\n#2" in result.stdout
    assert "window-miscounted" not in result.stdout
    assert "cache: layers 6-11 reuse earlier layers' keys (num_kv_shared_layers 6) and write no cache of their own: not " \
           "compared" in result.stdout


@needs_hf
@pytest.mark.parametrize("field, value", [("num_attention_heads", 0), ("num_key_value_heads", -2), ("num_attention_heads", 2.5)])
def test_a_config_json_with_no_heads_is_refused_naming_the_field(tmp_path, field, value):
    """hunt 10: num_attention_heads 0 ended in "model_type 'llama': ZeroDivisionError: integer division or modulo by
    zero", which names neither the field nor what to give."""
    (tmp_path / "heads.json").write_text(json.dumps({"model_type": "llama", field: value}))
    result = model(tmp_path / "heads.json", "--lengths", "3,2", "--new-tokens", "1")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (f"maskcli: error: '{tmp_path / 'heads.json'}': {field} {value} is not a number of heads: give a "
                             "whole number of 1 or more\n")


@needs_hf
@pytest.mark.parametrize("family, field", [("mistral", "sliding_window"), ("llama4_text", "attention_chunk_size")])
def test_a_config_json_with_a_window_or_chunk_of_0_is_refused_naming_it(tmp_path, family, field):
    """hunt 10: -3 was refused but 0 ran, and ended in "cannot run --attn sdpa --cache dynamic: RuntimeError:
    ZeroDivisionError" (llama4_text) or a tensor size mismatch (mistral)."""
    (tmp_path / "zero.json").write_text(json.dumps({"model_type": family, field: 0}))
    result = model(tmp_path / "zero.json", "--lengths", "3,2", "--new-tokens", "1")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (f"maskcli: error: '{tmp_path / 'zero.json'}': {field} 0 is no size in tokens: give a whole number "
                             "of 1 or more, or null for none\n")
