"""`maskcli pack` through the command line: the report at 60 and 120 columns, --json, --png read back, the
batch files each library writes, and the exit status (0 agree, 1 disagree or a finding, 2 bad input)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from maskcli.commands import app
from test_attention_inputs import write_safetensors
from test_render_heatmaps import cells, heatmap_boxes, is_colour

runner = CliRunner()


def pack(*args, columns=120):
    return runner.invoke(app, ["pack", *map(str, args)], env={"COLUMNS": str(columns)})


def as_json(*args):
    result = pack(*args, "--json")
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.stdout)
    assert result.exit_code == (0 if data["ok"] else 1)
    return data


def test_position_ids_beside_an_attention_mask_at_120_columns():
    result = pack("--position-ids", "0,1,2,0,1,0", "--attention-mask", "1,1,1,1,1,0", "--cu-seqlens", "0,3,5")
    assert result.exit_code == 1
    lines = [line.rstrip() for line in result.stdout.splitlines()]
    for expected in (
        "the batch given as options: B=1 rows × L=6 tokens",
        "documents as cu_seqlens says",
        "cu_seqlens       0     0, 3              5         reference",
        "position_ids     0     0, 3              —         yes",
        "attention_mask   0     —                 5         padding only",
        "hf-sdpa    attention_mask (2-D)   6                 0",
        "hf-flash   attention_mask (2-D)   6                 0",
        "varlen     cu_seqlens             0                 0",
        "eos        no --eos-id            does not apply",
        "  hf-sdpa: maskcli show causal --len 6 --lengths 5",
        '  varlen: maskcli show "document(sizes=[3,2,1])" --lengths 5',
        "hf-sdpa and varlen disagree: only hf-sdpa allows 6 cells, only varlen 0",
        "  row 3: hf-sdpa sees 0-3, varlen sees 3: varlen hides keys 0-2",
    ):
        assert expected in lines, expected
    assert "hf-flash and varlen disagree the same way as hf-sdpa and varlen" in lines
    assert "• hf-sdpa and hf-flash let tokens see another document in 6 cells (first: row 0, query 3 sees key 0) — documents as" in lines
    assert all(len(line) <= 120 for line in lines)


def test_the_same_report_reads_at_60_columns():
    result = pack("--position-ids", "0,1,2,0,1,0", "--attention-mask", "1,1,1,1,1,0", "--cu-seqlens", "0,3,5", columns=60)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert all(len(line) <= 60 for line in lines), [line for line in lines if len(line) > 60]
    text = " ".join(" ".join(lines).split())
    for expected in ("documents as cu_seqlens says", "hf-sdpa: maskcli show causal --len 6 --lengths 5",
                     "varlen: maskcli show \"document(sizes=[3,2,1])\" --lengths 5",
                     "hf-sdpa and varlen disagree", "hf-sdpa and hf-flash let tokens see another document in 6 cells"):
        assert expected in text, expected
    assert "cu_seqlens       0     0, 3" in result.stdout


@pytest.mark.parametrize("columns", [60, 120])
def test_a_long_suggested_command_is_printed_whole_and_findings_wrap_under_their_bullet(columns):
    sizes = [2 + d % 3 for d in range(120)]
    positions = ",".join(str(i) for size in sizes for i in range(size))
    result = pack("--position-ids", positions, "--labels", ",".join(["5"] * sum(sizes)), "--use-cache", "no", columns=columns)
    lines = result.stdout.splitlines()
    assert all(len(line) <= columns for line in lines)
    builds = result.stdout.split("the mask each path builds:")[1].split("paths:")[0]
    assert "..." not in builds and "…" not in builds
    command = 'maskcli show "document(sizes=[' + ",".join(map(str, sizes)) + '])"'  # 300 characters: was cut to 160
    start = next(i for i, line in enumerate(lines) if line.startswith("  hf-sdpa: "))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" " * len("  hf-sdpa: ")))  # under the command
    assert end - start >= 3 and "".join("".join(lines[start:end]).split()) == "hf-sdpa:" + "".join(command.split())
    bullet = next(i for i, line in enumerate(lines) if line.startswith("• labels are never -100"))
    assert lines[bullet + 1].startswith("  ") and not lines[bullet + 1].startswith("   ")


def test_agreeing_fields_exit_0():
    result = pack("--position-ids", "0,1,2,0,1", "--cu-seqlens", "0,3,5", "--use-cache", "no")
    assert result.exit_code == 0, result.output
    assert "paths: all agree (exact, from key intervals, on real tokens)" in result.stdout
    assert "findings: none" in result.stdout


def test_json_lists_fields_paths_and_findings():
    data = as_json("--position-ids", "0,1,2,3,4", "--cu-seqlens", "0,3,5", "--use-cache", "no")
    assert data["use_cache"] == {"value": False, "from": "--use-cache no"}
    assert data["reference"] == "cu_seqlens" and not data["fields_agree"] and not data["paths_agree"]
    assert data["disagreements"] == [{"field": "position_ids", "reference": "cu_seqlens", "count": 1,
                                      "first": [{"row": 0, "position": 3, "reference_starts": True}]}]
    assert [b["rows"][0]["starts"] for b in data["boundaries"]] == [[0, 3], [0]]
    paths = {p["name"]: p for p in data["paths"]}
    assert paths["varlen"]["expression"] == "document(sizes=[3,2])" and paths["varlen"]["cross_document_cells"] == 0
    assert paths["hf-sdpa"]["reads"] == "position_ids" and paths["hf-sdpa"]["cross_document_cells"] == 6
    assert paths["eos"]["applies"] is False
    assert {f["code"] for f in data["findings"]} == {"fields-disagree", "cross-document", "rope-continues"}


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".npz", ".json"])
def test_batch_files(tmp_path, suffix):
    fields = {"input_ids": [[5, 6, 2, 7, 2]], "position_ids": [[0, 1, 2, 0, 1]], "cu_seq_lens_q": [0, 3, 5], "cu_seq_lens_k": [0, 3, 5],
              "max_length_q": 3, "max_length_k": 3, "labels": [[-100, 6, 2, -100, 2]]}
    path = tmp_path / f"batch{suffix}"
    tensors = {k: torch.tensor(v) for k, v in fields.items()}
    if suffix == ".pt":
        torch.save(tensors, path)
    elif suffix == ".safetensors":
        write_safetensors(path, tensors, dtype="I64")
    elif suffix == ".npz":
        np.savez(path, **{k: np.asarray(v) for k, v in fields.items()})
    else:
        path.write_text(json.dumps(fields))
    data = as_json(path, "--eos-id", 2, "--use-cache", "no")
    assert data["ok"] and data["batch"]["fields"]["cu_seq_lens_q"] == {"key": "cu_seq_lens_q", "shape": [3]}
    assert {p["name"]: p["reads"] for p in data["paths"]} == {
        "hf-sdpa": "position_ids", "hf-flash": "cu_seq_lens_q/k, max_length_q/k", "varlen": "cu_seq_lens_q", "eos": "input_ids"}


def test_field_maps_another_key(tmp_path):
    path = tmp_path / "batch.pt"
    torch.save({"pos": torch.tensor([[0, 1, 0, 1]]), "boundaries": torch.tensor([0, 2, 4])}, path)
    data = as_json(path, "--field", "position_ids=pos", "--field", "cu_seqlens=boundaries", "--use-cache", "no")
    assert data["ok"] and data["batch"]["fields"]["position_ids"]["key"] == "pos via --field"


CROSS = (214, 39, 40)  # the colour pack's figure draws a leaking cell in (written here: the test reads it back)


def panels(path, length: int) -> list[np.ndarray]:
    """Each (length x length) panel's cells read back from the PNG: 1 the visible colour, 0 the masked one, 2 the
    leak colour, -1 none of them."""
    import matplotlib.image as mpimg

    rgb = (mpimg.imread(path)[..., :3] * 255).round().astype(int)
    leak = is_colour(rgb, CROSS)
    plain = np.where(leak[..., None], np.array([224, 224, 224]), rgb)  # the boxes are found on the two mask colours
    as_visible = np.where(leak[..., None], np.array([31, 119, 180]), 0)  # the leak colour alone, read as "visible"
    return [np.where(cells(as_visible, box, length, length) == 1, 2, cells(rgb, box, length, length)) for box in heatmap_boxes(plain)]


def test_png_draws_each_path_with_its_cells(tmp_path):
    out = tmp_path / "pack.png"
    result = pack("--attention-mask", "1,1,1,1,1,1", "--cu-seqlens", "0,3,6", "--png", out)
    assert result.exit_code == 1 and f"wrote {out}" in result.stderr
    got = panels(out, 6)
    assert len(got) == 3  # hf-sdpa, hf-flash, varlen
    docs = np.array([0, 0, 0, 1, 1, 1])
    causal = np.tril(np.ones((6, 6), dtype=int))
    documents = np.array([[int(k <= q and docs[q] == docs[k]) for k in range(6)] for q in range(6)])
    leaking = np.array([[int(k <= q and docs[q] != docs[k]) for k in range(6)] for q in range(6)])  # a double loop
    assert (got[0] == causal + leaking).all() and (got[1] == causal + leaking).all() and (got[2] == documents).all()


@pytest.mark.parametrize(("args", "says"), [
    (["--cu-seqlens", "0,3,2"], "--cu-seqlens: cumulative lengths go down at entry 2 (3 then 2)"),
    (["--position-ids", "0,1,x"], "'x' at position 2"),
    ([], "no batch: give a BATCH file"),
    (["missing.pt"], "missing.pt"),
    (["--position-ids", "0,1", "--reference", "seq_idx"], "--reference 'seq_idx': the batch has no such field"),
    (["--position-ids", "0,1", "--eos-id", "2"], "--eos-id 2: the batch has no input_ids"),
    (["--position-ids", "0,1", "--png", "out.gif"], "--png"),
    (["--position-ids", "0,1", "--use-cache", "no", "--config", "nan"], "unknown model family 'nan'"),  # was dropped
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    import importlib.util

    if says.startswith("unknown model family") and importlib.util.find_spec("transformers") is None:
        says = "maskcli model needs transformers"  # (--config read all the same: the family is looked up in transformers)
    result = runner.invoke(app, ["pack", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("maskcli: error: ") and result.stderr.count("\n") == 1
    assert says in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(("tensor", "kind"), [
    (lambda: torch.empty(3, dtype=torch.int64, device="meta"), "is a meta tensor (a shape, no values)"),
    (lambda: torch.quantize_per_tensor(torch.tensor([0.0, 3.0, 5.0]), 1.0, 0, torch.qint32), "is a quantized tensor (qint32)"),
    (lambda: torch.tensor([0, 3, 5]).to_sparse(), "is a sparse_coo tensor"),
])
def test_a_field_with_no_plain_values_is_one_line(tmp_path, tensor, kind):
    """A meta, quantized or sparse cu_seqlens: was an internal error (numpy cannot copy it out), as serve already said."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's quantized tensors are deprecated, not gone)
        torch.save({"cu_seqlens": tensor()}, tmp_path / "b.pt")
    result = runner.invoke(app, ["pack", str(tmp_path / "b.pt")])
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr == (f"maskcli: error: cu_seqlens {kind}; a batch's fields are plain integers: save a dense "
                             "tensor (.to_dense(), .dequantize())\n")


@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_a_batch_of_zero_rows_is_refused_naming_the_field_in_pack_and_shard(tmp_path, suffix):
    """input_ids of shape (0, 6): was an internal ValueError (a max over no rows) in pack and shard alike."""
    path = tmp_path / f"rows0{suffix}"
    fields = {"input_ids": np.zeros((0, 6), np.int64), "position_ids": np.zeros((0, 6), np.int64)}
    torch.save({k: torch.from_numpy(v) for k, v in fields.items()}, path) if suffix == ".pt" else np.savez(path, **fields)
    for command in ("pack", "shard"):
        result = runner.invoke(app, [command, str(path)])
        assert result.exit_code == 2 and result.stdout == "", (command, result.output)
        assert result.stderr == ("maskcli: error: the batch has no rows: input_ids [0, 6]; give at least one row of "
                                 "tokens (B >= 1)\n"), (command, result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_field_without_a_batch_file_and_bad_maps(tmp_path):
    assert "give the file too" in runner.invoke(app, ["pack", "--position-ids", "0,1", "--field", "labels=y"]).stderr
    path = tmp_path / "b.pt"
    torch.save({"pos": torch.tensor([0, 1])}, path)
    result = runner.invoke(app, ["pack", str(path), "--field", "nonsense=pos"])
    assert result.exit_code == 2 and "'nonsense' is not a field maskcli reads" in result.stderr
    result = runner.invoke(app, ["pack", str(path)])
    assert result.exit_code == 2 and "none of them a field maskcli reads" in result.stderr


def test_batches_from_transformers_own_collator(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    features = [{"input_ids": [5, 6, 7, 2], "labels": [5, 6, 7, 2]}, {"input_ids": [8, 2], "labels": [8, 2]},
                {"input_ids": [3, 4, 9, 2], "labels": [3, 4, 9, 2]}]
    for options in ({}, {"return_flash_attn_kwargs": True}, {"return_flash_attn_kwargs": True, "return_seq_idx": True}):
        batch = dict(transformers.DataCollatorWithFlattening(return_tensors="pt", **options)(features))
        path = tmp_path / "batch.pt"
        torch.save(batch, path)  # max_length_q/k are Python ints in it: read as numbers
        data = as_json(path, "--eos-id", 2, "--use-cache", "no")  # as transformers' Trainer runs the model
        assert data["ok"], data["findings"]
        (cu, _), _ = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
        paths = {p["name"]: p for p in data["paths"]}
        assert paths["hf-flash"]["expression"] == f"document(sizes=[{','.join(map(str, cu.diff().tolist()))}])"
    # each known disagreement, introduced into the collator's batch, exits 1 and is named
    broken = {
        "padding and its attention_mask": {**batch, "input_ids": torch.cat([batch["input_ids"], torch.zeros(1, 2, dtype=torch.int64)], 1),
                                           "position_ids": torch.cat([batch["position_ids"], torch.zeros(1, 2, dtype=torch.int64)], 1),
                                           "labels": torch.cat([batch["labels"], torch.full((1, 2), -100)], 1),
                                           "seq_idx": torch.cat([batch["seq_idx"], torch.full((1, 2), -1, dtype=batch["seq_idx"].dtype)], 1),
                                           "attention_mask": torch.tensor([[1] * 10 + [0, 0]])},
        "position_ids that count on": {**batch, "position_ids": torch.arange(10)[None]},
        "a label across a boundary": {**batch, "labels": torch.tensor([[-100, 6, 7, 2, 8, 2, -100, 4, 9, 2]])},
        "max_length too small": {**batch, "max_length_q": 2, "max_length_k": 2},
    }
    codes = {"padding and its attention_mask": "cross-document", "position_ids that count on": "rope-continues",
             "a label across a boundary": "labels-across", "max_length too small": "max-length"}
    for name, fields in broken.items():
        torch.save(fields, path)
        data = as_json(path, "--use-cache", "no")
        assert not data["ok"] and codes[name] in {f["code"] for f in data["findings"]}, (name, data["findings"])


# Three samples of 4, 3 and 5 tokens, as DataCollatorWithFlattening flattens them; their documents, token by token.
SAMPLES = [[5, 6, 7, 2], [8, 9, 2], [3, 4, 9, 1, 2]]
DOCS = np.array([d for d, sample in enumerate(SAMPLES) for _ in sample])


def leaked(keep: np.ndarray) -> int:
    """Cells of a (L, L) keep mask where a query sees a key of another document: written here, not maskcli's count."""
    return int((keep & (DOCS[:, None] != DOCS[None, :])).sum())


def applied_masks(model, batch, monkeypatch) -> list[np.ndarray]:
    """Each attention call's (L, L) mask as the kernel got it: sdpa's attn_mask / is_causal, eager's weights > 0."""
    import transformers.integrations.sdpa_attention as sdpa_module

    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        length = query.shape[-2]
        if attn_mask is None:
            keep = torch.ones(length, length, dtype=torch.bool)
            seen.append((keep.tril() if is_causal else keep).numpy())
        else:
            mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask > torch.finfo(attn_mask.dtype).min
            seen.append(mask.expand(1, 1, length, length)[0, 0].numpy())
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    # transformers/integrations/sdpa_attention.py:182 calls torch.nn.functional.scaled_dot_product_attention by name
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    assert sdpa_module.torch.nn.functional.scaled_dot_product_attention is recording
    out = model(**batch, output_attentions=model.config._attn_implementation == "eager")
    if model.config._attn_implementation == "eager":
        seen = [(weights[0] > 0).all(0).numpy() for weights in out.attentions]  # every head: softmax is 0 only where masked
    return seen


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_use_cache_as_the_config_says_decides_whether_sdpa_and_eager_read_packed_position_ids(tmp_path, monkeypatch, attn):
    """transformers 5.24: LlamaConfig.use_cache defaults to True (models/llama/configuration_llama.py:73); the model's
    forward, given no use_cache, takes the config's (utils/generic.py:1130, merge_with_config_defaults) and makes a
    DynamicCache (models/llama/modeling_llama.py:374-375); masking_utils.py:865 reads position_ids for the packed
    mask only when `cache is None`. So a model in train mode, called as most training loops call it, gets plain
    causal from DataCollatorWithFlattening's own batch, and maskcli must count that leak; Trainer sets
    use_cache=False (trainer.py:646, TrainingArguments.use_cache False at training_args.py:971), and then none."""
    transformers = pytest.importorskip("transformers")
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s, "labels": s} for s in SAMPLES])
    torch.save(dict(batch), tmp_path / "batch.pt")
    counts = {}
    for use_cache in (True, False):
        config = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                          num_key_value_heads=2, head_dim=8, use_cache=use_cache, attn_implementation=attn)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).train()  # random weights, never a download
        masks = applied_masks(model, batch, monkeypatch)
        assert len(masks) == 1
        config.save_pretrained(tmp_path / str(use_cache))  # use_cache=True is the default, left out of the file
        data = as_json(tmp_path / "batch.pt", "--config", tmp_path / str(use_cache) / "config.json")
        sdpa = next(p for p in data["paths"] if p["name"] == "hf-sdpa")
        assert data["use_cache"]["value"] is use_cache
        assert sdpa["cross_document_cells"] == leaked(masks[0]), (use_cache, sdpa)
        # the config's use_cache is its default, not the run's (Trainer turns it off): the leak is suspicious, named so,
        # and wrong only where the user states the cache (--use-cache yes)
        said = [f for f in data["findings"] if f["code"] == "cross-document"]
        assert data["ok"] and [f["severity"] for f in said] == (["suspicious"] if use_cache else []), said
        assert not use_cache or said[0]["message"].endswith(f"if the model runs with use_cache=True ("
                                                          f"{tmp_path / str(use_cache) / 'config.json'} sets it; "
                                                          "--use-cache yes or no says which)")
        counts[use_cache] = sdpa["cross_document_cells"]
    assert counts == {True: 3 * 4 + 5 * 7, False: 0}
    assert as_json(tmp_path / "batch.pt")["use_cache"] == {"value": True, "from": "the default of LlamaConfig and most configs"}
    assert as_json(tmp_path / "batch.pt", "--config", "llama", "--use-cache", "no")["ok"]  # --use-cache over the config
    stated = as_json(tmp_path / "batch.pt", "--use-cache", "yes")
    assert not stated["ok"] and [f["severity"] for f in stated["findings"] if f["code"] == "cross-document"] == ["wrong"]


def test_use_cache_is_read_from_a_config_file_without_transformers_where_it_sets_it(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "use_cache": false}')
    data = as_json("--position-ids", "0,1,2,0,1", "--config", tmp_path / "config.json")
    assert data["use_cache"] == {"value": False, "from": f"{tmp_path / 'config.json'} sets it"} and data["ok"]
    result = pack("--position-ids", "0,1,2,0,1", "--use-cache", "maybe")
    assert result.exit_code == 2 and result.stderr.startswith("maskcli: error: --use-cache 'maybe': say yes or no")
    result = pack("--position-ids", "0,1,2,0,1")  # hf-flash reads the documents right: hf-sdpa's leak is a condition
    assert result.exit_code == 0 and "if the model runs with use_cache=True" in " ".join(result.stdout.split())
    assert "hf-sdpa nothing (use_cache=True) 6 0" in [" ".join(line.split()) for line in result.stdout.splitlines()]
    assert "transformers: use_cache=True (the default of LlamaConfig and most configs)" in result.stdout


def test_the_report_says_which_fields_outvoted_the_one_off_by_one():
    result = pack("--position-ids", "0,1,2,3,0,1,2,0,1,2,3,4", "--cu-seq-lens-q", "0,3,7,12", "--cu-seq-lens-k", "0,4,7,12",
                  "--max-length-q", "5", "--max-length-k", "5", "--use-cache", "no")
    assert result.exit_code == 1
    lines = [" ".join(line.split()) for line in result.stdout.splitlines()]
    assert "documents as cu_seq_lens_k and position_ids say (the majority; cu_seq_lens_q disagrees)" in lines
    assert "cu_seq_lens_q 0 0, 3, 7 none no: 2 tokens" in lines and "cu_seq_lens_k 0 0, 4, 7 none reference" in lines
    assert "hf-sdpa position_ids 0 0" in lines and "varlen cu_seq_lens_q 3 0" in lines


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_a_full_stdout_is_one_line_and_exit_2_as_for_every_command(tmp_path, extra):
    import os
    import subprocess
    import sys

    # Python's own flush at exit would fail with status 120 and a traceback-like message: the write fails inside the command
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "maskcli", "pack", "--position-ids", "0,1,2,0,1", *extra], stdout=full,
                                stderr=subprocess.PIPE, text=True, cwd=tmp_path, env={**os.environ, "COLUMNS": "80"}, timeout=120)
        shown = subprocess.run([sys.executable, "-m", "maskcli", "show", "causal", "--len", "4"], stdout=full, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path, timeout=120)
    assert (result.returncode, result.stderr) == (2, "maskcli: error: No space left on device while writing the output: send it (stdout) to a disk with room, "
                                                  "or to /dev/null\n")
    assert (shown.returncode, shown.stderr) == (result.returncode, result.stderr)  # what show says, pack says


def test_png_draws_the_leak_colour_exactly_on_the_leaking_cells_with_its_legend_entry(tmp_path):
    # DataCollatorWithFlattening's batch of 4, 3 and 5 tokens, run with a cache: sdpa's causal mask leaks, flash's does not
    docs = np.array([0] * 4 + [1] * 3 + [2] * 5)
    positions = ",".join(str(i) for size in (4, 3, 5) for i in range(size))
    args = ("--position-ids", positions, "--cu-seq-lens-q", "0,4,7,12", "--cu-seq-lens-k", "0,4,7,12", "--max-length-q", "5", "--max-length-k", "5")
    result = pack(*args, "--use-cache", "yes", "--png", tmp_path / "leak.png")
    assert result.exit_code == 1
    sdpa, flash, varlen = panels(tmp_path / "leak.png", 12)
    leaking = np.array([[int(k <= q and docs[q] != docs[k]) for k in range(12)] for q in range(12)])
    documents = np.array([[int(k <= q and docs[q] == docs[k]) for k in range(12)] for q in range(12)])
    assert (sdpa == documents + 2 * leaking).all() and (flash == documents).all() and (varlen == documents).all()
    import matplotlib.image as mpimg

    rgb = (mpimg.imread(tmp_path / "leak.png")[..., :3] * 255).round().astype(int)
    below = rgb[int(rgb.shape[0] * 0.9):]  # the legend, under the panels
    assert is_colour(below, CROSS).sum() > 50  # its swatch
    assert pack(*args, "--use-cache", "no", "--png", tmp_path / "none.png").exit_code == 0
    clean = (mpimg.imread(tmp_path / "none.png")[..., :3] * 255).round().astype(int)
    assert not is_colour(clean, CROSS).any()  # nothing leaks: no cell and no legend entry in that colour


def test_document_labels_never_collide_and_narrow_documents_lose_theirs():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from maskcli.pack.fields import read
    from maskcli.pack.findings import check
    from maskcli.render.pack import pack_figure

    sizes = [1, 2, 1, 12, 3, 1, 1, 12, 2, 1, 12, 12]
    positions = ",".join(str(i) for size in sizes for i in range(size))
    figure = pack_figure(check(read(None, {"position_ids": positions}, [])), "batch")
    renderer = FigureCanvasAgg(figure).get_renderer()
    labelled = 0
    for ax in figure.axes:
        for edge in ax.child_axes:  # the top and right edges' document labels
            texts = [t for t in edge.xaxis.get_ticklabels() + edge.yaxis.get_ticklabels() if t.get_text()]
            boxes = sorted((t.get_window_extent(renderer) for t in texts), key=lambda b: (b.x0, -b.y0))
            assert all(not a.overlaps(b) for a, b in zip(boxes, boxes[1:])), [t.get_text() for t in texts]
            assert all(t.get_fontsize() >= 9 for t in texts)
            assert 4 <= len(texts) < len(sizes)  # the wide documents keep their labels, some narrow ones lost theirs
            assert {"3", "7", "10", "11"} <= {t.get_text() for t in texts}  # the 12-token documents
            labelled += 1
    assert labelled == 4  # top and right edges of both panels


def test_a_long_batch_marks_each_block_that_holds_a_leaking_cell():
    from maskcli.pack.fields import read
    from maskcli.pack.findings import check
    from maskcli.render.masks import FIGURE_MAX_CELLS
    from maskcli.render.pack import cross_cells

    sizes = [300, 7, 500, 293, 100]  # 1,200 tokens: drawn in blocks of 3 x 3
    docs = np.repeat(np.arange(len(sizes)), sizes)
    report = check(read(None, {"position_ids": ",".join(str(i) for size in sizes for i in range(size))}, []))
    sdpa = next(c for c in report.checks if c.path.name == "hf-sdpa")
    per = -(-docs.size // FIGURE_MAX_CELLS)
    got = cross_cells(report, sdpa, 0, per)
    q, k = np.arange(docs.size)[:, None], np.arange(docs.size)[None, :]
    leaking = (k <= q) & (docs[:, None] != docs[None, :])  # causal, across documents: numpy, not maskcli
    blocks = -(-docs.size // per)
    padded = np.zeros((blocks * per, blocks * per), dtype=bool)
    padded[: docs.size, : docs.size] = leaking
    assert per == 3 and np.array_equal(got, padded.reshape(blocks, per, blocks, per).any(axis=(1, 3)))
    assert int(leaking.sum()) == sdpa.cross_cells


def test_json_names_the_majority_that_outvoted_a_field():
    data = as_json("--position-ids", "0,1,2,3,0,1,2,0,1,2,3,4", "--cu-seq-lens-q", "0,3,7,12", "--cu-seq-lens-k", "0,4,7,12", "--use-cache", "no")
    assert data["reference"] == "cu_seq_lens_k" and data["majority"] == ["cu_seq_lens_k", "position_ids"]
    assert {p["name"]: p["cross_document_cells"] for p in data["paths"] if p["applies"]} == {"hf-sdpa": 0, "hf-flash": 0, "varlen": 3}
    assert as_json("--position-ids", "0,1,2,0,1", "--cu-seqlens", "0,3,5", "--use-cache", "no")["majority"] == []  # all agree: no vote


def test_flash_from_position_ids_that_do_not_start_at_their_minimum_leaves_the_first_tokens_out():
    """position_ids 3,4,5,0,1 (the batch opens mid-document): transformers' flash_attention_2 builds cu_seq_lens from
    the tokens whose position_ids equal their minimum (transformers 5.24, modeling_flash_attention_utils.py:507-513,
    prepare_fa_kwargs_from_position_ids), so tokens 0-2 are in no sequence. pack drew them as one document and exited 0."""
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    (cu, _), _ = prepare_fa_kwargs_from_position_ids(torch.tensor([[3, 4, 5, 0, 1]]))
    assert cu.tolist() == [3, 5]  # the library's own answer: the sequences cover tokens 3-4 only
    result = pack("--position-ids", "3,4,5,0,1", "--use-cache", "no")
    assert result.exit_code == 1
    assert ("• hf-flash leaves out tokens 0-2: flash_attention_2 starts a sequence only where position_ids equal their minimum (0),\n"
            "  and the first one is at token 3, so their attention output is never computed") in result.stdout
    assert pack("--position-ids", "0,1,2,0,1", "--use-cache", "no").exit_code == 0  # starting at the minimum: nothing left out


def leaking_cells(sizes: list[int]) -> int:
    """Cells where a causal mask over the whole row lets a token see an earlier document, by a double loop."""
    docs = [d for d, size in enumerate(sizes) for _ in range(size)]
    return sum(k <= q and docs[k] != docs[q] for q in range(len(docs)) for k in range(len(docs)))


def test_a_training_batch_read_right_by_its_own_path_exits_0_and_says_the_cache_as_a_condition():
    """DataCollatorWithFlattening's fields (position_ids with cu_seq_lens_*, or position_ids alone) run with
    use_cache=False by Trainer: the flash path reads the documents, and sdpa leaks only if a cache is made, which pack
    cannot see. Suspicious, naming the condition, exit 0; wrong once the user says --use-cache yes; quiet with no."""
    sizes, flash = [4, 3, 5], ("--cu-seq-lens-q", "0,4,7,12", "--cu-seq-lens-k", "0,4,7,12", "--max-length-q", "5", "--max-length-k", "5")
    positions = ",".join(str(i) for size in sizes for i in range(size))
    for extra in (flash, ()):
        result = pack("--position-ids", positions, *extra)
        said = " ".join(result.stdout.split())
        assert result.exit_code == 0, result.output
        assert (f"hf-sdpa lets tokens see another document in {leaking_cells(sizes)} cells (first: row 0, query 4 sees key 0) "
                "— documents as " + ("cu_seq_lens_q" if extra else "position_ids") + " says if the model runs with use_cache=True "
                "(the default of LlamaConfig and most configs; --use-cache yes or no says which)") in said
        data = as_json("--position-ids", positions, *extra)
        assert [(f["code"], f["severity"]) for f in data["findings"]] == [("cross-document", "suspicious")]
        assert pack("--position-ids", positions, *extra, "--use-cache", "yes").exit_code == 1
        assert as_json("--position-ids", positions, *extra, "--use-cache", "no")["findings"] == []
    # the flash fields alone: sdpa/eager read none of them, so whether it leaks depends on which kernel runs
    data = as_json(*flash)
    assert data["ok"] and [(f["code"], f["severity"]) for f in data["findings"]] == [("cross-document", "suspicious")]
    assert data["findings"][0]["message"].endswith("if the model runs sdpa, eager or flex_attention, which read no cu_seq_lens_q")


def test_a_batch_no_path_reads_right_exits_1_and_one_every_path_agrees_on_exits_0():
    """Two rows of packed position_ids: flash_attention_2 reads packed position_ids for one row only and sdpa makes a
    cache by default, so no path the fields serve keeps the documents apart: wrong, whatever the cache."""
    data = as_json("--position-ids", "0,1,2,0;0,1,0,1")
    assert not data["ok"] and {f["severity"] for f in data["findings"]} == {"wrong"}
    assert data["findings"][0]["message"].startswith(f"hf-sdpa and hf-flash let tokens see another document in "
                                                     f"{leaking_cells([3, 1]) + leaking_cells([2, 2])} cells")
    result = pack("--position-ids", "0,1,2,3,4,5")  # one document: every path agrees
    assert result.exit_code == 0 and "findings: none" in result.stdout


def test_a_million_characters_of_documents_pack_wrote_itself_are_checked_not_refused(tmp_path):
    """10^6 one-token documents: pack's own document(sizes=[1,1,...]) is 2M characters, past the limit on an
    expression a user types, which refused it (then took a minute to tokenize). A causal path across them lets each
    token see every earlier one: L(L-1)/2 cells across documents. The command left out says why in the user's terms."""
    import time

    length = 1_000_000
    (tmp_path / "cu.json").write_text(json.dumps({"cu_seqlens": list(range(length + 1))}))
    start = time.process_time()
    result = runner.invoke(app, ["pack", str(tmp_path / "cu.json")])
    assert result.exit_code in (0, 1) and "characters long" not in result.output, result.output
    assert time.process_time() - start < 30  # a hang guard: about 3 CPU s here (the tokenizer alone took 40)
    said = " ".join(result.stdout.split())
    assert f"{length * (length - 1) // 2:,} cells" in said, result.stdout
    assert ("varlen: its document(sizes=[...]) would list each of the 1,000,000 documents cu_seqlens gives: a command "
            "of 2,000,032 characters, left out here and in --json") in said


def test_a_json_batch_keeps_whole_float_positions_past_float32_exactly(tmp_path):
    """hunt 11: a JSON batch's floats were read as float32, so position_ids 16777217.0, 16777218.0, 16777219.0
    (one document) became 16777216, 16777218, 16777220, and pack reported three documents and a leak, exit 1."""
    path = tmp_path / "b.json"
    path.write_text('{"position_ids": [16777217.0, 16777218.0, 16777219.0]}')
    result = pack(path, "--use-cache", "no", "--json")
    assert result.exit_code == 0, result.output
    paths = {p["name"]: p for p in json.loads(result.stdout)["paths"]}
    assert paths["hf-sdpa"]["expression"] == "causal" and json.loads(result.stdout)["findings"] == []


def test_a_json_batch_float_past_float32_is_quoted_as_written_not_as_inf(tmp_path):
    """hunt 11: position_ids 1e300 in a JSON batch was refused as 'holds inf', a value the file does not hold."""
    path = tmp_path / "b.json"
    path.write_text('{"position_ids": [1e300, 0]}')
    result = pack(path)
    assert result.exit_code == 2
    assert result.stderr == "maskcli: error: position_ids holds 1e+300, not a whole number; give integers\n"


def test_a_missing_batch_file_is_refused_with_an_inline_batch_to_try(tmp_path):
    result = pack(tmp_path / "nosuch.json")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (f"maskcli: error: BATCH '{tmp_path / 'nosuch.json'}': no such file (give a .pt, .pth, .npy, "
                             ".npz, .safetensors, .json file, or inline JSON like '{\"position_ids\": [[0, 1, 0, 1]]}')\n")


def test_at_60_columns_the_header_wraps_under_its_label():
    """'fields: input_ids (from --input-ids), position_ids (from' went on at column 0 ('--position-ids)'); under the
    text after its label now."""
    result = pack("--input-ids", "5,6,2,7,2", "--position-ids", "0,1,2,0,1", "--eos-id", "2", "--use-cache", "no", columns=60)
    assert result.exit_code == 0
    assert result.stdout.splitlines()[1:3] == [
        "fields: input_ids (from --input-ids), position_ids (from",
        "        --position-ids)",
    ]
