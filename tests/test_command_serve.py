"""`maskcli serve` through the command line: the report at 60 and 120 columns, --json, --png read back pixel by
pixel, the file kinds it reads, and the exit status (0 clean, 1 a wrong finding, 2 bad input)."""

from __future__ import annotations

import json
import os

import matplotlib.image as mpimg
import numpy as np
import pytest
from typer.testing import CliRunner

from maskcli.commands import app
from maskcli.render.heatmaps import MASKED_RGB, VISIBLE_RGB
from serve_builders import Req, allocate, vllm

runner = CliRunner()
PREFIX_HIT = "tests/data/serve/vllm_prefix_hit.json"
TREE = "tests/data/serve/flashinfer_tree.json"


def serve(*args, columns=120):
    return runner.invoke(app, ["serve", *map(str, args)], env={"COLUMNS": str(columns)})


def save(tensors, path):
    path.write_text(json.dumps({k: np.asarray(v).tolist() for k, v in tensors.items()}))
    return path


def test_a_prefix_hit_at_120_columns():
    result = serve(PREFIX_HIT)
    assert result.exit_code == 0, result.output
    lines = [line.rstrip() for line in result.stdout.splitlines()]
    for expected in (
        f"{PREFIX_HIT}: vLLM CommonAttentionMetadata",
        "3 requests, 11 new tokens, pages of 16 tokens, 5 distinct; causal",
        "0     32-35     0-35   causal",
        "1     32        0-32   causal",
        "2     0-5       0-5    causal",
        "0     1, 2, 3   4/16   0, 1     none   2",
        "1     1, 2, 4   1/16   0, 1     none   2",
        "2     5         6/16   none     none   0",
        "no findings: the lengths, pages, writes and masks agree",
    ):
        assert expected in lines, expected


def test_the_report_reads_at_60_columns():
    result = serve(TREE, columns=60)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert all(len(line) <= 60 for line in lines)
    assert "1     6-10      0-10   tree(-1,0,0,1,2)" in [line.rstrip() for line in lines]


def test_json_lists_every_request_and_finding(tmp_path):
    reqs = allocate([Req(8, 3), Req(0, 4)], 4)
    bad = dict(vllm(reqs, 4), query_start_loc=[0, 11, 15])  # cu_seqlens_q built from full lengths
    result = serve(save(bad, tmp_path / "bad.json"), "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["engine"] == "vllm" and data["ok"] is False
    assert [r["queries"] for r in data["requests"]] == [[0, 11], [0, 4]]
    assert [f["code"] for f in data["findings"]] == ["seq-len"]  # one bug, one finding (it says the count too)
    assert data["findings"][0]["request"] == 0 and data["findings"][0]["cell"] == [8, 1]
    assert data["findings"][0]["message"].endswith("(1 request like this); query_start_loc counts 15 query tokens but "
                                                   "slot_mapping has 7")


def test_a_finding_is_printed_and_exits_1(tmp_path):
    reqs = allocate([Req(8, 3), Req(0, 4)], 4)
    reqs[1].pages[0] = reqs[0].pages[0]
    result = serve(save(vllm(reqs, 4), tmp_path / "reuse.json"))
    assert result.exit_code == 1
    # request 1 writes its positions 0..3 to slots 4..7 of page 1, which request 0 (queries 8..10) reads as keys 0..3
    assert ("• wrong shared-page-written (request 0, query 8 key 0): request 1 writes its position 0 to slot 4 on page 1, "
            "which request 0 reads as keys 0..3: request 0's key 0 is overwritten (page 1 is read by requests 0, 1)") in " ".join(result.stdout.split("\n"))


@pytest.mark.parametrize("suffix", [".pt", ".npz", ".safetensors"])
def test_every_file_kind_reads_the_same(tmp_path, suffix):
    import torch

    reqs = allocate([Req(5, 2), Req(0, 3)], 4)
    tensors = {k: torch.as_tensor(np.asarray(v)) for k, v in vllm(reqs, 4).items()}
    path = tmp_path / f"batch{suffix}"
    if suffix == ".pt":
        torch.save(tensors, path)
    elif suffix == ".npz":
        np.savez(path, **{k: v.numpy() for k, v in tensors.items()})
    else:
        from safetensors.torch import save_file

        save_file({k: v.reshape(-1) if v.dim() == 0 else v for k, v in tensors.items()}, str(path))
    data = json.loads(serve(path, "--json").stdout)
    assert [r["expression"] for r in data["requests"]] == ["causal", "causal"]
    assert [r["queries"] for r in data["requests"]] == [[5, 7], [0, 3]]


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    mixed = dict(vllm(allocate([Req(0, 2)], 4), 4), extend_prefix_lens=[0])
    result = serve(save(mixed, tmp_path / "mixed.json"))
    assert result.exit_code == 2
    assert result.stderr.startswith("maskcli: error: ")
    assert "mixes the names of 2 engines: vllm (query_start_loc, num_computed_tokens_cpu); sglang (extend_prefix_lens)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = serve(save({"query_start_loc": [0, 2], "seq_lens": [2], "block_table_tensor": [[1]]}, tmp_path / "nosize.json"))
    assert result.exit_code == 2 and "no page size: add block_size" in result.stderr


@pytest.mark.parametrize("fields, says", [
    ({"cu_seqlens_q": [0, 2], "seqused_k": [5], "causal": 2}, "causal holds 2; it is a flag, True or False (1 or 0)"),
    ({"cu_seqlens_q": [0, 2], "seqused_k": [5], "causal": -1}, "causal holds -1; it is a flag"),  # both were read as True
    ({"qo_indptr": [0], "kv_indptr": [0], "causal": 1}, "qo_indptr holds no request (a batch of 0 requests)"),  # was exit 0
    ({"cu_seqlens_q": [0, 2], "seqused_k": [5], "window_size": [2, -7]}, "window_size (2, -7) reaches keys after the query"),
])
def test_flags_and_empty_batches_no_engine_writes_are_one_line(tmp_path, fields, says):
    result = serve(save(fields, tmp_path / "odd.json"))
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("maskcli: error: ") and says in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("fields, note", [
    ({"cu_seqlens_q": [0, 2], "seqused_k": [5], "causal": 1, "window_size": [-5, 0]},
     "window_size (-5, 0): flash-attn reads any negative side as no limit (as -1)"),
    ({"qo_indptr": [0, 2], "kv_indptr": [0, 5], "causal": 1, "window_left": -3},
     "window_left -3: the kernel reads any negative window side as no limit (as -1)"),
])
def test_a_window_side_below_minus_1_is_read_as_the_kernel_reads_it_and_said(tmp_path, fields, note):
    """flash_api.cpp and FlashInfer turn on a window only for a side of 0 or more: -5 is no limit, as -1 is; it was read
    so with no word. The mask is then the kernel's own causal one: query i of a request of 2 new tokens after 3 cached
    keys sees keys 0..3+i."""
    result = serve(save(fields, tmp_path / "window.json"), "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert found["notes"] == [note] and found["window"] is None and found["causal"] is True
    (request,) = found["requests"]
    assert (request["queries"], request["keys"], request["expression"]) == ([3, 5], [0, 5], "causal")


def test_png_shows_each_request_mask_and_its_pages(tmp_path):
    """Each request's panel, read back at its cells' centres, is the causal mask behind its cache; the page strip
    colours its blocks (shared orange, written green)."""
    from maskcli.render import serve as render
    from maskcli.serve.engines import read
    from maskcli.checks.pagemap import page_map

    path = tmp_path / "serve.png"
    result = serve(PREFIX_HIT, "--png", path)
    assert result.exit_code == 0 and f"wrote {path}" in result.stderr
    rgb = (mpimg.imread(path)[..., :3] * 255).round().astype(int)
    batch = read(PREFIX_HIT)
    figure = render.serve_figure(batch, page_map(batch), PREFIX_HIT, "t")
    figure.set_dpi(100)
    figure.canvas.draw()  # the same layout the command saved: positions of cells on the image
    height = rgb.shape[0]
    assert rgb.shape[:2] == (int(figure.get_figheight() * 100), int(figure.get_figwidth() * 100))

    def colour(ax, x, y):
        px, py = ax.transData.transform((x, y))
        return rgb[int(height - py), int(px)]

    for r in range(batch.requests):
        ax, strip = figure.axes[2 * r], figure.axes[2 * r + 1]
        q0, q_len, seq = batch.frame(r)
        for q in range(q0, q0 + q_len):
            for k in range(seq):
                want = VISIBLE_RGB if k <= q else MASKED_RGB
                assert np.abs(colour(ax, k, q) - want).max() <= 3, (r, q, k)
        kinds = ["shared", "shared", "written"] if r < 2 else ["written"]
        for block, kind in enumerate(kinds):
            want = np.array(render.PAGE_COLOURS[kind]) * 255
            assert np.abs(colour(strip, block, 0) - want).max() <= 3, (r, block, kind)


def test_three_step_files_are_one_pass(tmp_path):
    paths = []
    for k, (computed, new) in enumerate(((0, 4), (4, 4), (8, 2))):
        req = Req(computed, new, [3, 7, 5][: -(-(computed + new) // 4)])
        paths.append(save(vllm([req], 4), tmp_path / f"step{k}.json"))
    result = serve(*paths)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "the 3 steps together" in lines and lines[-1] == "no findings: the lengths, pages, writes and masks agree"
    data = json.loads(serve(*paths, "--json").stdout)
    assert [s["requests"][0]["queries"] for s in data["steps"]] == [[0, 4], [4, 8], [8, 10]] and data["ok"]
    paths[1] = save(vllm([Req(5, 3, [3, 7])], 4), tmp_path / "gap.json")
    result = serve(*paths, "--json")
    assert result.exit_code == 1 and [f["code"] for f in json.loads(result.stdout)["findings"]] == ["steps-positions"]
    result = serve(*paths, "--png", tmp_path / "x.png")
    assert result.exit_code == 2 and "--png draws one step, and 3 FILEs were given" in result.stderr


@pytest.mark.parametrize("given, said", [
    ('{"query_start_loc":[0,2],"seq_lens":[-3]}', "seq_lens is -3 for request 0; lengths are 0 or more"),
    ('{"query_start_loc":[0,2],"seq_lens":[5],"sliding_window":0}', "sliding_window 0 leaves no key"),
    ('{"query_start_loc":[0,2.5],"seq_lens":[5]}', "query_start_loc holds 2.5, not a whole number"),
    ('{"query_start_loc":[1,2],"seq_lens":[5]}', "query_start_loc [1, 2] must start at 0"),
    ('{"cu_seqlens_q":[0,2],"seqused_k":[4],"window_size":3}', "window_size [3] is a pair (left, right)"),
    ('{"qo_indptr":[0,2],"kv_indptr":[0,1],"kv_indices":[3],"kv_last_page_len":[2],"page_size":4,"custom_mask":[1,1]}',
     "custom_mask holds 2 cells; the requests' (qo_len x kv_len) masks need 4"),
    # hard15: values the engine's storage type cannot hold were cast and wrapped into other bits (999 -> 231), exit 0
    ('{"qo_indptr":[0,1],"paged_kv_indptr":[0,1],"paged_kv_indices":[1],"paged_kv_last_page_len":[3],"page_size":4,'
     '"packed_custom_mask":[999]}', "packed_custom_mask holds 999, outside 0 to 255: its values are bytes (uint8)"),
    ('{"qo_indptr":[0,1],"paged_kv_indptr":[0,1],"paged_kv_indices":[1],"paged_kv_last_page_len":[3],"page_size":4,'
     '"packed_custom_mask":[-1]}', "packed_custom_mask holds -1, outside 0 to 255"),
    # hard15: a flag where a count of tokens goes was read as 1 (block_size true: a page of 1 token, false table-short findings)
    ('{"query_start_loc":[0,2],"seq_lens":[2],"block_table_tensor":[[1]],"block_size":true}',
     "block_size holds True, a flag; it is a number of tokens"),
    ('{"qo_indptr":[0,2],"kv_indptr":[0,5],"causal":1,"window_left":true}', "window_left holds True, a flag; it is a number of tokens"),
    ('{"seq_lens":[2],"num_cached_tokens_per_seq":[3],"num_contexts":0,"spec_decoding_packed_mask":[[[1],[8589934595]]]}',
     "spec_decoding_packed_mask holds 8589934595, outside -2,147,483,648 to 4,294,967,295: its values are 32-bit words"),
    ('{"seq_lens":[2],"num_cached_tokens_per_seq":[3],"spec_decoding_packed_mask":[[[3],[3]]]}', "no num_contexts"),
    ('{"input_ids":[1,2]}', "none of them an engine's batch metadata names"),
    ('{"cu_seqlens_q":[0,2],"seqused_k":[4],"cache_leftpad":[7]}', "cache_leftpad 7 is past seqused_k 4 for request 0"),
    ('{"cu_seqlens_q":[0,2,3],"cache_seqlens":[4,2],"cache_leftpad":[1,3]}', "cache_leftpad 3 is past cache_seqlens 2 for request 1"),
    ('{"seq_lens":[3],"extend_seq_lens":[2],"draft_token_num":2147483648,"custom_mask":[1,1]}',
     "draft_token_num 2147483648 asks for 4,611,686,024,869,838,848 custom_mask cells"),
    ('{"seq_lens":[2],"extend_seq_lens":[2],"req_to_token":[[1,2],[3,4]]}', "req_to_token has 2 rows for 1 requests: save the pool with req_pool_indices"),
])
def test_bad_metadata_is_one_line_that_says_what_to_fix(given, said):
    result = serve(given)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("maskcli: error: ") and said in result.stderr and len(result.stderr.splitlines()) == 1


WINDOW_BATCH = '{"cu_seqlens_q":[0,2],"seqused_k":[9],"window_size":[3,0]}'  # flash-attn window_size=(3,0): 4 keys


def test_expect_holds_or_names_the_request_and_first_wrong_cell():
    result = serve(WINDOW_BATCH, "--expect", "*=window(4)")
    assert result.exit_code == 0, result.output
    assert "• note expect: --expect: every request matched holds (1 expectation)" in result.stdout
    result = serve(WINDOW_BATCH, "--expect", "*=causal")
    assert result.exit_code == 1, result.output
    assert ("• wrong expect (request 0, query 7 key 0): --expect *=causal: request 0 (window(4)) differs: row 7: "
            "request 0 sees 4-7, causal sees 0-7: request 0 hides keys 0-3") in " ".join(result.stdout.split("\n"))
    data = json.loads(serve(WINDOW_BATCH, "--expect", "*=causal", "--json").stdout)
    assert {"code": "expect", "severity": "wrong", "request": 0, "cell": [7, 0]}.items() <= data["findings"][-1].items()


def test_a_bad_expect_is_one_line_and_status_2():
    result = serve(WINDOW_BATCH, "--expect", "*=window")
    assert result.exit_code == 2 and "--expect '*=window'" in result.stderr and "Traceback" not in result.output
    result = serve(WINDOW_BATCH, "--expect", "causal")
    assert result.exit_code == 2 and "give PATTERN=EXPR" in result.stderr


def test_model_from_a_config_file(tmp_path):
    pytest.importorskip("transformers", reason="serve --model reads configs with transformers (the hf extra)")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "mistral", "sliding_window": 4, "num_hidden_layers": 2}))
    result = serve(WINDOW_BATCH, "--model", config, columns=300)
    assert result.exit_code == 0, result.output
    assert f"• note model: --model {config}: a sliding_attention layer's batch (sliding_window 4)" in " ".join(result.stdout.split("\n"))
    batch = '{"cu_seqlens_q":[0,2],"seqused_k":[9],"window_size":[4,0]}'  # HF's W passed where flash-attn takes W - 1
    result = serve(batch, "--model", config, columns=300)
    assert result.exit_code == 1, result.output
    assert ("• wrong model (request 0, query 7 key 3): --model " + str(config) + ": the batch's window_size gives window(5); "
            f"{config}'s sliding_attention layers have sliding_window 4: off by one (one key more; HF's sliding_window 4 is "
            "window_size=(3, 0) here).") in " ".join(result.stdout.split("\n"))


@pytest.mark.parametrize("layers", [-4, 0, 2.5, 10**11])
def test_a_config_whose_layer_count_is_no_count_is_one_line(tmp_path, layers):
    """hard15: -4 layers was read as a model of no layers (a "wrong model" finding, exit 1); 10^11 was read layer by
    layer past any timeout."""
    pytest.importorskip("transformers", reason="serve --model reads configs with transformers (the hf extra)")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "mistral", "sliding_window": 4, "num_hidden_layers": layers}))
    before = set(tmp_path.iterdir())
    result = serve(WINDOW_BATCH, "--model", config)
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr == (f"maskcli: error: {str(config)!r}: num_hidden_layers {layers} is not a number of layers: give a "
                             "whole number from 1 to 1,048,576 (models have a few hundred at most)\n")
    assert set(tmp_path.iterdir()) == before


def test_model_without_transformers_is_one_line(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    result = serve(WINDOW_BATCH, "--model", "llama")
    assert result.exit_code == 2
    assert result.stderr.strip() == 'maskcli: error: serve --model needs transformers: pip install "maskcli[hf]" (in a clone of maskcli: pip install -e ".[hf]")'


def test_png_without_a_page_table_draws_the_mask_across_and_explains_its_colours(tmp_path):
    """flash-attn's contiguous keys have no pages: the mask takes the whole row (it drew a black empty strip beside it),
    and the legend names the mask's colours, not page kinds that are not there."""
    from maskcli.render import serve as render
    from maskcli.serve.engines import from_tensors
    from maskcli.checks.pagemap import page_map

    tensors = {"cu_seqlens_q": [0, 2], "seqused_k": [6], "causal": 1}
    path = tmp_path / "flat.png"
    result = serve(json.dumps(tensors), "--png", path)
    assert result.exit_code == 0, result.output
    rgb = (mpimg.imread(path)[..., :3] * 255).round().astype(int)
    batch = from_tensors(tensors, "t")
    figure = render.serve_figure(batch, page_map(batch), "t", "t")
    figure.set_dpi(100)
    figure.canvas.draw()
    (ax,) = figure.axes
    box = ax.get_position()
    assert box.x1 - box.x0 > 0.8
    height = rgb.shape[0]
    for q in (4, 5):
        for k in range(6):
            px, py = ax.transData.transform((k, q))
            want = VISIBLE_RGB if k <= q else MASKED_RGB  # bottom-right causal: query 4 of 6 keys sees 0..4
            assert np.abs(rgb[int(height - py), int(px)] - want).max() <= 3, (q, k)
    assert [t.get_text() for t in figure.legends[0].get_texts()] == ["query sees key", "masked"]


def test_a_bad_expect_is_explained_in_requests_not_module_paths():
    result = serve(PREFIX_HIT, "--expect", "causal")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip() == ('maskcli: error: --expect \'causal\': give PATTERN=EXPR, like "*=window(8)" (PATTERN '
                                     "matches a request's index or request_id as a shell does)")


def test_one_query_and_pages_of_one_token_read_in_the_singular():
    """SGLang's default page_size is 1; a decode request has 1 query (the report said "1 queries", "pages of 1 tokens")."""
    batch = {"seq_lens": [3, 0], "req_to_token": [[5, 6, 7], [0, 0, 0]], "out_cache_loc": [7, 1]}  # request 1: no keys
    result = serve(json.dumps(batch))
    assert result.exit_code == 1
    text = " ".join(result.stdout.split())
    assert "2 requests, 2 new tokens, pages of 1 token, 3 distinct; causal" in text
    assert "• wrong no-keys (request 1): request 1 has 1 query and 0 keys (seq_lens is 0)" in text


@pytest.mark.parametrize("tensors, name", [
    ({"query_start_loc": [0, 1], "seq_lens": [3], "block_table_tensor": [1, 2], "block_size": 4}, "block_table_tensor"),
    ({"cu_seqlens_q": [0, 1], "seqused_k": [3], "block_table": [1, 2], "page_block_size": 4}, "block_table"),
    ({"seq_lens": [3], "req_to_token": [1, 2, 3], "out_cache_loc": [3]}, "req_to_token"),
    ({"seq_lens": [1], "num_cached_tokens_per_seq": [2], "kv_cache_block_offsets": [0, 2], "tokens_per_block": 4},
     "kv_cache_block_offsets"),
])
def test_a_flat_page_table_names_the_file_and_the_field(tmp_path, tensors, name):
    path = save(tensors, tmp_path / "flat.json")
    result = serve(path)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip().startswith(f"maskcli: error: '{path}': {name} has shape [")
    assert result.stderr.strip().endswith("a block table is (requests, blocks)")


def test_a_flashinfer_decode_plan_without_qo_indptr_is_one_query_per_request():
    """BatchDecodeWithPagedKVCacheWrapper.plan(indptr, indices, last_page_len, ...) takes no qo_indptr (flashinfer/decode.py):
    each request's one query is its last key, (pages - 1) * page_size + last_page_len - 1. The narrow table kept its
    title on one line (it wrapped at the table's width)."""
    batch = {"paged_kv_indptr": [0, 1, 3], "paged_kv_indices": [1, 2, 3], "paged_kv_last_page_len": [2, 4], "page_size": 4}
    keys = [(1 - 1) * 4 + 2, (2 - 1) * 4 + 4]
    result = serve(json.dumps(batch))
    assert result.exit_code == 0, result.output
    lines = [line.rstrip() for line in result.stdout.splitlines()]
    assert "requests (absolute positions)" in lines
    for r, n in enumerate(keys):
        assert f"{r}      {n - 1}          0-{n - 1}    full" in lines
    assert "note: no qo_indptr: read as a decode plan, one query per request" in lines


def test_a_missing_field_names_the_engine_readably():
    result = serve('{"query_start_loc":[0,1]}')
    assert result.exit_code == 2 and result.stderr.strip() == (
        "maskcli: error: 'inline JSON' holds vLLM CommonAttentionMetadata but no seq_lens or seq_lens_cpu; add it to the file")


def page_json(path) -> dict:
    """The JSON a page embeds (render/html.py page(): <script type="application/json" id="mask-data">)."""
    text = path.read_text(encoding="utf-8")
    start = text.index('id="mask-data">') + len('id="mask-data">')
    return json.loads(text[start:text.index("</script>", start)])


def page_cells(data: dict) -> np.ndarray:
    """A page's mask as dense cells, decoded from its row runs (pagedata.row_runs: rows a..a'-1 of a run have
    interval j at [s + ds * d, e + de * d), d rows into the run; arrays base64 little-endian int32 or float64)."""
    import base64

    def array(packed):
        return np.frombuffer(base64.b64decode(packed["b"]), dtype="<i4" if packed["t"] == "i4" else "<f8").astype(np.int64)

    frame, run = data["frame"], data["rows"][0]
    assert run["stride"] == 1
    a, k = array(run["a"]), run["k"]
    s, e, ds, de = (array(run[name]).reshape(-1, k) for name in ("s", "e", "ds", "de"))
    cells = np.zeros((frame["lq"], frame["lk"]), bool)
    for q in range(frame["lq"]):
        i = np.searchsorted(a, q, side="right") - 1
        for j in range(k):
            lo, hi = s[i, j] + ds[i, j] * (q - a[i]), e[i, j] + de[i, j] * (q - a[i])
            cells[q, max(lo, frame["vk0"]) - frame["vk0"]:max(hi, frame["vk0"]) - frame["vk0"]] = True
    return cells


def test_html_page_embeds_each_requests_positions_mask_pages_and_findings(tmp_path):
    """vLLM under a window of 4: request 0 at position 12 (keys 9..12 on blocks 2 and 3), request 1 new on page 1,
    which request 0 still lists inside its window (block 2), and a third request with no keys. The page's JSON is
    checked against what the requests were built from, its masks cell by cell against a double loop."""
    old, new = Req(12, 1, [5, 6, 1, 4]), Req(0, 4, [1])
    tensors = vllm([old, new, Req(0, 2, [7])], 4, sliding_window=4)
    tensors["seq_lens"][2] = 0  # a request with queries and no keys
    path = tmp_path / "batch.html"
    result = serve(save(tensors, tmp_path / "batch.json"), "--html", path)
    assert result.exit_code == 1 and f"wrote {path}" in result.stderr
    data = page_json(path)
    assert data["page"] == "serve"
    serve_data = data["serve"]
    requests = serve_data["requests"]
    assert [(r["queries"], r["keys"], r["pages"]) for r in requests] == [([12, 13], [0, 13], [5, 6, 1, 4]), ([0, 4], [0, 4], [1]),
                                                                         ([0, 0], [0, 0], [])]  # no keys: no positions
    assert [r["expression"] for r in requests] == ["window(4)", "window(4)", None]
    # blocks: request 0 reads 2 (keys 8..11, page 1, which request 1 writes) and 3, writes 3 (position 12); blocks 0, 1
    # are before its window
    assert (requests[0]["unread"], requests[0]["shared"], requests[0]["written"]) == ([0, 1], [2], [2, 3])
    assert (requests[1]["shared"], requests[1]["written"], requests[1]["last_fill"]) == ([0], [0], 4)
    assert serve_data["drawn"] == [0, 1] and serve_data["page_size"] == 4 and serve_data["null_page"] == 0
    for r, (q0, q_len, seq) in enumerate(((12, 1, 13), (0, 4, 4))):
        want = np.array([[q0 + i - 4 < k <= q0 + i for k in range(seq)] for i in range(q_len)])
        assert (data["masks"][r]["frame"]["vq0"], data["masks"][r]["frame"]["lk"]) == (q0, seq)
        assert np.array_equal(page_cells(data["masks"][r]), want), r
    found = [(f["code"], f["severity"], f["request"], f["cell"]) for f in serve_data["findings"]]
    assert found == [("no-keys", "wrong", 2, None), ("shared-page-written", "wrong", 0, [12, 9])]


def test_html_refuses_a_bad_path_or_several_steps_in_one_line_and_leaves_no_file(tmp_path):
    for given, said in ((tmp_path / "no" / "x.html", "directory"), (tmp_path / "x.png", "unknown extension '.png'; use one of .html")):
        result = serve(PREFIX_HIT, "--html", given)
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1 and said in result.stderr, result.stderr
        assert not given.exists()
    result = serve(PREFIX_HIT, PREFIX_HIT, "--html", tmp_path / "two.html")
    assert result.exit_code == 2 and "--html draws one step, and 2 FILEs were given" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_million_one_token_requests_take_seconds_not_hours(tmp_path):
    """Each request's lengths were diffed from the whole indptr on every access: 10^5 requests took 58 s, 10^6 did
    not finish. Now O(requests + pages): 2 x 10^5 here, the first rows checked against vLLM's layout by hand
    (request r: 2 cached + 1 new token at position 2, on page r + 1)."""
    import time

    import torch

    r = 200_000
    torch.save({"query_start_loc": torch.arange(r + 1), "seq_lens": torch.full((r,), 3), "num_computed_tokens_cpu": torch.full((r,), 2),
                "block_table_tensor": torch.arange(1, r + 1)[:, None], "slot_mapping": torch.arange(1, r + 1) * 4 + 2,
                "block_size": torch.tensor(4)}, tmp_path / "many.pt")
    start = time.process_time()
    result = serve(tmp_path / "many.pt")
    took = time.process_time() - start
    assert result.exit_code == 0, result.output
    assert "200000 requests, 200,000 new tokens, pages of 4 tokens, 200,000 distinct; causal" in result.stdout
    assert [line.split() for line in result.stdout.splitlines() if line.startswith("15 ")][0][:4] == ["15", "2", "0-2", "causal"]
    assert "requests 16-199999 not listed" in result.stdout
    assert took < 60, took  # the quadratic reading took minutes at this size


def test_a_draft_tree_a_billion_tokens_behind_its_cache_is_not_made_into_cells(tmp_path):
    """TensorRT-LLM's packed mask holds the drafts only: the cached keys before them are a count, not a
    (nodes, cached) array (that was 5.8 GB); the tree still reads (root, two children) and its positions are checked.
    Run under a 1.5 GiB address-space limit, as the (3, 10^9) array was 3 GB."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (int(1.5 * 2**30), int(1.5 * 2**30)))

    def run(path):
        return subprocess.run([sys.executable, "-m", "maskcli", "serve", str(path)], capture_output=True, text=True,
                              preexec_fn=limit, timeout=300, env={**os.environ, "COLUMNS": "120"})

    fields = {"seq_lens": [2, 3], "num_cached_tokens_per_seq": [3, 10**9], "num_contexts": 1,
              "spec_decoding_packed_mask": [[[1], [3], [5]]], "spec_decoding_position_offsets": [[0, 1, 1]]}
    result = run(save(fields, tmp_path / "far.json"))
    assert result.returncode == 0, result.stderr
    assert "1     1000000000-1000000002   0-1000000002   tree(-1,0,0)" in result.stdout
    result = run(save({**fields, "spec_decoding_position_offsets": [[0, 1, 2]]}, tmp_path / "off.json"))
    assert result.returncode == 1, result.stderr
    assert "has position 1000000002; its mask puts it at 1000000001 (prefix + depth)" in " ".join(result.stdout.split())


def test_json_metadata_keeps_whole_float_lengths_past_float32_exactly():
    """hunt 11: JSON metadata's floats were read as float32, so seqused_k 16777217.0 became 16777216 (the query shown
    at 16777215, exit 0), and 1e300 was refused as 'holds inf', a value the JSON does not hold."""
    exact = serve('{"cu_seqlens_q":[0,1],"seqused_k":[16777217.0],"causal":1}', "--json")
    assert exact.exit_code == 0, exact.output
    assert exact.stdout == serve('{"cu_seqlens_q":[0,1],"seqused_k":[16777217],"causal":1}', "--json").stdout
    huge = serve('{"cu_seqlens_q":[0,1],"seqused_k":[1e300],"causal":1}')
    assert huge.exit_code == 2
    assert huge.stderr == ("maskcli: error: 'inline JSON': seqused_k holds 1e+300, not a whole number within +-1,099,511,627,776; "
                           "batch metadata is integers\n")
