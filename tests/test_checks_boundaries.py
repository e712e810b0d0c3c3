"""checks/boundaries.py: a chunked layer's chunks and EOS-delimited documents, judged per batch row on its real tokens,
on programs written as other projects write them (tests/data/rows), against a double loop over positions."""

from __future__ import annotations

from pathlib import Path

from checkbugs import caught, first, traced

QUIET = Path(__file__).parent / "data" / "quiet"


def _chunk_cell(real, seen, size, q_len, k_len, own):
    """The rule's first cell by a double loop: a leak (another chunk) first, else a miss (its own chunk)."""
    starts = [row.index(1) for row in real]

    def judged(b, q, k):
        return real[b][own[q]] and real[b][k] and k <= own[q]

    def same(b, q, k):
        return (own[q] - starts[b]) // size == (k - starts[b]) // size

    shape = (len(real), q_len, k_len)
    leak = first(shape, lambda b, q, k: judged(b, q, k) and seen(b, q, k) and not same(b, q, k))
    return leak or first(shape, lambda b, q, k: judged(b, q, k) and not seen(b, q, k) and same(b, q, k))


def test_a_llama4_style_chunked_layer_that_counts_chunks_from_column_0_of_a_left_padded_row_is_found(tmp_path):
    # (config.py's chunks-misaligned says it too where the config states the chunks: then it is the one shown)
    hit = caught(tmp_path, "chunks_from_column_zero", ("chunks-misplaced", "chunks-misaligned"))
    real = [[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8]
    cell = _chunk_cell(real, lambda b, q, k: q // 3 == k // 3 and k <= q and real[b][k], 3, 8, 8, list(range(8)))
    if hit["code"] == "chunks-misaligned":  # (it names the row, no cell)
        assert f"batch row {cell[0]} is" in hit["message"]
    else:
        assert tuple(hit["cell"]) == cell


def test_a_decode_step_that_counts_its_chunk_from_the_caches_column_is_found(tmp_path):
    hit = caught(tmp_path, "chunks_decode_from_cache_column", ("chunks-misplaced",))
    real = [[0, 0, 0, 1, 1, 1, 1], [1] * 7]  # decode step 1: 7 keys, the query at column 6
    position = [[k - 3 for k in range(7)], list(range(7))]  # each key's position in its row
    cell = _chunk_cell(real, lambda b, q, k: real[b][k] and position[b][k] // 4 == 6 // 4, 4, 1, 7, [6])
    assert tuple(hit["cell"]) == (cell[0], 6, cell[2])


def _eos_cell(ids, eos, seen):
    """The first real query that sees a key with an EOS strictly between them, by a double loop."""
    t = len(ids[0])
    return first((len(ids), t, t), lambda b, q, k: k < q and seen(b, q, k) and eos in ids[b][k + 1:q])


def test_a_document_mask_made_from_the_first_rows_eos_is_found_leaking_in_the_second_row(tmp_path):
    hit = caught(tmp_path, "eos_documents_first_row_only", ("eos-documents-leak",))
    ids = [[5, 6, 1, 7, 8, 9, 1, 3], [4, 4, 4, 4, 1, 6, 7, 8]]
    ends = [i for i, t in enumerate(ids[0]) if t == 1]

    def seen(b, q, k):  # the program's mask: row 0's documents (an EOS ends its own) in every row
        return k <= q and sum(e < q for e in ends) == sum(e < k for e in ends)

    assert tuple(hit["cell"]) == _eos_cell(ids, 1, seen)


def test_a_document_mask_cut_at_each_rows_first_eos_only_is_found(tmp_path):
    hit = caught(tmp_path, "eos_documents_first_eos_only", ("eos-documents-leak",))
    ids = [[5, 2, 6, 7, 2, 8, 9, 10], [3, 4, 5, 2, 6, 2, 7, 8]]

    def seen(b, q, k):
        cut = ids[b].index(2)
        return k <= q and (q <= cut) == (k <= cut)

    assert tuple(hit["cell"]) == _eos_cell(ids, 2, seen)


def test_chunks_counted_from_each_packed_documents_positions_are_quiet(tmp_path):
    """A chunked layer over packed documents that restarts its chunks with their position_ids is correct too (so is
    transformers' count from the row's first token, tested above by the fixes)."""
    import json

    from checkbugs import runner
    from maskcli.commands import app

    script = tmp_path / "packed.py"
    script.write_text(
        "from types import SimpleNamespace\n"
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.config = SimpleNamespace(attention_chunk_size=3, layer_types=['chunked_attention'])\n"
        "    def forward(self, x, position_ids):\n"
        "        p, doc = position_ids, torch.cumsum(position_ids == 0, -1)\n"
        "        mask = (p[:, None, :] // 3 == p[:, :, None] // 3) & (doc[:, None, :] == doc[:, :, None])\n"
        "        mask &= torch.ones(8, 8, dtype=torch.bool).tril()\n"
        "        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask[:, None])\n"
        "M()(torch.randn(1, 1, 8, 4), torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]))\n")
    out = tmp_path / "t.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
    found = [f for g in json.loads(out.read_text())["groups"] for f in g["findings"]]
    assert result.exit_code == 0 and [f for f in found if f["severity"] != "note"] == [], result.output


def test_a_chunked_layer_over_eos_packed_rows_that_attends_across_eos_on_purpose_is_quiet(tmp_path):
    """Its chunks cut beside an EOS by chance, and elsewhere too: that is no document mask by the EOS."""
    import json

    from checkbugs import runner
    from maskcli.commands import app

    script = tmp_path / "chunks.py"
    script.write_text(
        "from types import SimpleNamespace\n"
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.config = SimpleNamespace(attention_chunk_size=3, layer_types=['chunked_attention'], eos_token_id=1)\n"
        "    def forward(self, input_ids):\n"
        "        i = torch.arange(9)\n"
        "        x = torch.randn(1, 1, 9, 4)\n"
        "        mask = (i[None, :] // 3 == i[:, None] // 3) & (i[None, :] <= i[:, None])\n"
        "        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)\n"
        "M()(torch.tensor([[5, 6, 1, 7, 8, 9, 4, 1, 3]]))\n")
    out = tmp_path / "t.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
    found = [f for g in json.loads(out.read_text())["groups"] for f in g["findings"]]
    assert result.exit_code == 0 and [f for f in found if f["severity"] != "note"] == [], result.output


def test_a_left_padded_chunked_decode_is_judged_with_the_padding_its_prefill_shows(tmp_path):
    """A decode step's one query row cannot show the padding: a chunk cut in another row reads as padding there. The
    padding its site's prefill showed holds behind the cache, so a correct chunked decode (here a config dict at the
    top of the program, masks built per row from an offset, no attention_mask argument) is quiet."""
    import json

    from checkbugs import runner
    from maskcli.commands import app

    script = tmp_path / "chunked_decode.py"
    script.write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "hf_config = {'attention_chunk_size': 3, 'layer_types': ['chunked_attention']}\n"
        "PAD = torch.tensor([2, 0])  # row 0 left-padded by 2\n"
        "def chunked(q_cols, k_len):\n"
        "    kp = torch.arange(k_len)[None, None, :] - PAD[:, None, None]\n"
        "    qp = q_cols[None, :, None] - PAD[:, None, None]\n"
        "    ok = (kp >= 0) & (kp <= qp) & (kp // 3 == qp // 3)\n"
        "    return ok | ((qp < 0) & (kp == qp))  # (a padding query sees itself: no NaN)\n"
        "class Layer(nn.Module):\n"
        "    def forward(self, x, past):\n"
        "        k = x if past is None else torch.cat([past, x], 2)\n"
        "        cols = torch.arange(k.shape[2] - x.shape[2], k.shape[2])\n"
        "        return F.scaled_dot_product_attention(x, k, k, attn_mask=chunked(cols, k.shape[2])[:, None]), k\n"
        "layer = Layer()\n"
        "_, past = layer(torch.randn(2, 1, 7, 4), None)\n"
        "for _ in range(3):\n"
        "    _, past = layer(torch.randn(2, 1, 1, 4), past)\n")
    out = tmp_path / "t.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
    found = [f for g in json.loads(out.read_text())["groups"] for f in g["findings"]]
    assert result.exit_code == 0 and [f for f in found if f["severity"] != "note"] == [], result.output


def _documents_seen(ids, eos):
    """A block-causal mask by `eos` (an EOS ends its own document), as a predicate over (b, q, k)."""
    def seen(b, q, k):
        return k <= q and sum(t == eos for t in ids[b][:q]) == sum(t == eos for t in ids[b][:k])
    return seen


def test_a_block_causal_module_splitting_on_an_eos_the_data_never_holds_is_found(tmp_path):
    # the model's eos (0, a config dict's default) is absent: its mask is plain causal; the tokenizer's EOS is 257
    hit = caught(tmp_path, "eos_documents_model_eos_never_synced", ("eos-documents-leak",))
    text = [list(b"abc") + [257] + list(b"de") + [257] + list(b"f") + [257],
            list(b"ghij") + [257] + list(b"klm") + [257]]
    assert tuple(hit["cell"]) == _eos_cell(text, 257, _documents_seen(text, 0))
    assert "DocumentAttention.mask_type=block_causal" in hit["message"] and "ByteTokenizer" in hit["message"]


def test_torchtitan_eos_id_never_synced_from_the_tokenizer(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    # pytorch/torchtitan#1144: flex block_causal built on eos_id 0, the tokenizer's EOS 2 (flex: its own process)
    root = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root.parent), os.environ.get("PYTHONPATH")]))}
    found = {}
    for fixed in (False, True):
        out = tmp_path / f"t{fixed}.json"
        done = subprocess.run([sys.executable, "-m", "maskcli", "trace", "--json", str(out),
                               str(root / "data" / "bugs" / "torchtitan_flex_block_causal_default_eos_id.py"),
                               *(["--fixed"] if fixed else [])], capture_output=True, text=True, timeout=600, env=env)
        found[fixed] = (done.returncode, [f for g in json.loads(out.read_text())["groups"] for f in g["findings"]])
    status, flagged = found[False]
    hits = [f for f in flagged if f["code"] == "eos-documents-leak" and f["severity"] == "wrong"]
    assert status == 1 and hits
    ids = [[1, 17, 23, 9, 2, 1, 40, 33, 12, 51, 2, 1, 8, 19, 27, 44]]
    assert tuple(hits[0]["cell"]) == _eos_cell(ids, 2, _documents_seen(ids, 0))
    assert "FlexAttention.attn_mask_type=block_causal" in hits[0]["message"]
    status, quiet = found[True]
    assert status == 0 and not [f for f in quiet if f["severity"] == "wrong"]


def test_a_chunk_size_beside_a_context_that_reaches_past_it_is_no_chunked_layer():
    """attention_chunk_size with context fields (Gemma 4 audio's attention_context_left / _right, a streaming encoder's
    num_left_chunks) is the block a local window is computed in: no layer kind is expected of it; alone, Llama 4's."""
    from maskcli.checks.intent import Intent, Stated, fields_of

    def kind(**config):
        return Intent([Stated("cfg", None, fields_of(config))]).kind(0)

    assert kind(attention_chunk_size=4) == ("chunked_attention", "attention_chunk_size=4", True)
    assert kind(attention_chunk_size=4, attention_context_left=4, attention_context_right=0) is None
    assert kind(attention_chunk_size=4, num_left_chunks=1) is None
    assert kind(sliding_window=8, attention_context_left=4)[0] == "sliding_attention"  # (a window is still read)


def test_chunks_with_a_stated_left_context_are_quiet(tmp_path):
    """Written after Gemma 4's audio tower (transformers#48818's fix, tests/data/blind): chunks of 4 that each see the
    chunk before (num_left_chunks=1), over absolute frames of a right-padded batch, one SDPA call. chunks-misplaced
    read attention_chunk_size alone and said a frame saw another chunk."""
    status, found, report = traced(tmp_path, "streaming_chunks_with_left_chunks", False, QUIET)
    assert not [f for f in found if f["code"].startswith("chunks-")], report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert status == 0, report


def test_a_pad_run_of_eos_ids_is_one_block_not_a_run_of_empty_documents(tmp_path):
    """Packed rows whose pad id is the EOS id: the tail of pads (EOS, EOS, ...) counts on from position 0 as one block,
    which the position_ids' document mask keeps whole: quiet (quiet-r66b's prime-rl GRPO rows were a false alarm so).
    The same collator that forgets to restart the second sample's positions leaks across the one EOS between the
    samples, and is found there."""
    name = "packed_rows_pad_eq_eos_tail_documents_from_positions"
    status, found, report = traced(tmp_path, name, False, QUIET)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
    source = (QUIET / f"{name}.py").read_text()
    merged = source.replace("positions.append(torch.arange(len(sample)))",
                            "positions.append(torch.arange(len(sample)) + sum(len(p) for p in positions))")
    merged = merged.replace("assert torch.allclose(", "_ = torch.allclose(")
    assert merged.count("_ = torch.allclose(") == 1 and "+ sum(len(p)" in merged
    (tmp_path / "positions_merged.py").write_text(merged)
    status, found, report = traced(tmp_path, "positions_merged", False, tmp_path)
    hit = next(f for f in found if f["code"] == "eos-documents-leak")
    ids = [[5, 6, 7, 2, 8, 9, 10, 11, 2, 2, 2, 2, 2, 2]]
    doc = [0] * 9 + [1] * 5  # the merged samples, then the pad run (the mask's blocks)
    assert status == 1 and tuple(hit["cell"]) == _eos_cell(ids, 2, lambda b, q, k: k <= q and doc[q] == doc[k]), report
