"""`maskcli shard` through Typer's CliRunner: the table at 60 and 120 columns, JSON against double loops and
PyTorch's ring schedule, the figure's pixels, exit status 1 on a wrong split, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from maskcli.commands import app

runner = CliRunner()


def invoke(args, columns: int = 120):
    return runner.invoke(app, ["shard", *map(str, args)], env={"COLUMNS": str(columns)})


def ok(args, columns: int = 120):
    result = invoke(args, columns)
    assert result.exit_code == 0, result.output
    return result.stdout


def causal_cells(lo: int, hi: int) -> int:
    return sum(q + 1 for q in range(lo, hi))


@pytest.mark.parametrize("columns", [60, 120])
def test_causal_over_contiguous_ranks_at_60_and_120_columns(columns):
    out = ok(["causal", "--len", 32, "--ranks", 4, "--layout", "contiguous", "--head-dim", 8], columns)
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert max(len(line) for line in out.splitlines()) <= columns
    assert lines[0] == "shard causal"
    assert "00000000111111112222222233333333" in lines  # one character a position: 32 fit both widths
    rows = [line for line in lines if line[:1].isdigit() and line.endswith("/4")]
    mean = causal_cells(0, 32) / 4
    expected = []
    for r in range(4):
        cells = causal_cells(8 * r, 8 * (r + 1))
        flops = 4 * 8 * cells  # 4 x head_dim x cells: QK^T and PV, two FLOPs a multiply-add
        expected.append(f"{r} 8 {cells} {flops / 1000:.3g}k {cells / mean:.3f} {3 - r}/4")
    assert rows == expected
    worst = causal_cells(24, 32) / mean
    assert f"imbalance (max / mean work) {worst:.3f}: rank 3 does the most, rank 0 the least" in " ".join(lines)
    assert f"suspicious: shard-imbalance: rank 3 does {worst:.3f}x the mean work" in " ".join(lines)
    assert lines[-1] == "the ranks' parts add up to the global mask exactly"


def test_ring_steps_in_json_follow_pytorchs_schedule_without_load_balancing():
    # without load balancing PyTorch's ring skips step i of rank r when the source rank (r - i) mod N is later,
    # runs it causal at i = 0 and whole otherwise (_is_causal_behavior, _context_parallel/_attention.py:83-100)
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    data = json.loads(ok(["causal", "--len", 64, "--ranks", 4, "--layout", "contiguous", "--json"]))
    steps = data["masks"][0]["steps"]
    named = {cp._CausalBehavior.SKIP: "empty", cp._CausalBehavior.IS_CAUSAL: "partial", cp._CausalBehavior.NOT_IS_CAUSAL: "full"}
    old = cp._cp_options.enable_load_balance
    cp._cp_options.enable_load_balance = False
    try:
        expected = [[named[cp._is_causal_behavior(r, 4, i, True)] for i in range(4)] for r in range(4)]
    finally:
        cp._cp_options.enable_load_balance = old
    assert steps == expected


def test_json_cells_and_grid_equal_a_double_loop_over_positions():
    data = json.loads(ok(["document(sizes=[7,9,8]) & window(3)", "--ranks", 2, "--layout", "per-document", "--json"]))
    labels = [0] * 7 + [1] * 9 + [2] * 8
    owner = {}
    # documents padded to 8, 12, 8 (multiples of 2 x 2) in chunks of 2, 3, 2: rank 0 takes the first and last
    # chunk of each (the last of documents 0 and 1 partly or wholly padding)
    rank0 = [0, 1, 6, 7, 8, 9, 16, 17, 22, 23]
    for r, held in enumerate([rank0, [p for p in range(24) if p not in rank0]]):
        for p in held:
            owner[p] = r
    grid = np.zeros((2, 2), dtype=int)
    for q in range(24):
        for k in range(24):
            if labels[q] == labels[k] and q - 3 < k <= q:
                grid[owner[q], owner[k]] += 1
    mask = data["masks"][0]
    assert mask["grid"] == grid.tolist()
    assert mask["cells"] == grid.sum(1).tolist()
    assert mask["imbalance"] == pytest.approx(grid.sum(1).max() / grid.sum(1).mean())
    assert data["layout"]["tokens"] == [10, 14] and data["layout"]["slots"] == [14, 14]
    # TransformerEngine: cu_seqlens_padded = [0, 8, 20, 28], divided by cp_size 2
    assert data["cu_seqlens"]["te"]["cu_seqlens_padded_local"] == [0, 4, 10, 14]
    assert data["findings"][0]["code"] == "shard-padding"


def test_png_draws_the_strip_work_and_ring_steps(tmp_path):
    from PIL import Image

    from maskcli.render.heatmaps import FIGURE_COLOURS

    path = tmp_path / "shard.png"
    result = invoke(["causal", "--len", 64, "--ranks", 4, "--layout", "contiguous", "--png", path])
    assert result.exit_code == 0, result.output
    pixels = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3)
    colours = {tuple(p) for p in pixels}
    for name in ("visible", "partial", "masked"):  # full, partial and empty ring steps all drawn
        assert tuple(FIGURE_COLOURS[name]) in colours, name
    from matplotlib import colormaps

    ranks = colormaps["viridis"].resampled(4)
    for r in range(4):  # every rank's colour in the strip
        rgb = tuple(int(round(255 * c)) for c in ranks(r)[:3])
        assert min(np.abs(pixels - rgb).sum(1)) <= 3, r


def test_rank_masks_on_local_indices_exit_1_naming_the_rank(tmp_path):
    paths = []
    for r, rows in enumerate([[0, 1, 6, 7], [2, 3, 4, 5]]):  # headtail over 8 tokens, 2 ranks
        part = torch.tensor([[k <= q for k in range(8)] for q in range(len(rows))])  # causal on local row indices
        paths += ["--rank-mask", str(tmp_path / f"rank{r}.pt")]
        torch.save(part, tmp_path / f"rank{r}.pt")
    result = invoke(["causal", "--len", 8, "--ranks", 2, "--layout", "headtail", *paths])
    assert result.exit_code == 1, result.output
    out = " ".join(result.stdout.split())
    assert "wrong: shard-local-indices: rank 0's mask uses local indices: its row 2 is position 6" in out
    assert "the ranks' parts add up" not in out


def test_a_truncating_index_file_exits_1(tmp_path):
    path = tmp_path / "order.json"
    path.write_text(json.dumps([[0, 1, 2], [3, 4, 5]]))
    result = invoke(["causal", "--len", 8, "--ranks", 2, "--layout", path])
    assert result.exit_code == 1
    assert "wrong: shard-dropped-token: 2 real tokens on no rank, the first at position 6" in " ".join(result.stdout.split())
    lines = result.stdout.splitlines()
    at = lines.index("token -> rank, positions 0-7; ? = on no rank:")  # the ? had no caption
    assert lines[at + 1] == "000111??"


def test_layer_types_from_a_model_config():
    pytest.importorskip("transformers")
    out = ok(["--model", "gemma3_text", "--len", 16384, "--ranks", 4, "--layout", "headtail"])
    lines = out.splitlines()
    assert lines[0] == "shard causal & window(4096) · causal"  # gemma3_text's defaults: sliding_window 4096
    # each layer type's section names its mask (the sections said only "sliding_attention:")
    assert "sliding_attention (causal & window(4096)):" in lines and "full_attention (causal):" in lines
    assert "imbalance (max / mean work) 1.000: every rank does the same work" in lines  # head-tail balances full layers


@pytest.mark.parametrize("args, message", [
    (["causal", "--layout", "zigzag"], "--layout 'zigzag': no such file"),
    (["causal", "--ranks", 0], "--ranks 0: give at least 1 rank"),
    (["causal", "--layout", "headtial"], "not a layout (contiguous, headtail, per-document, striped, ulysses, ptrr, striped:W, ptrr:BLOCK); did you mean headtail?"),
    (["causal", "--layout", "stripped:128"], "did you mean striped?"),
    (["causal", "--layout", "per-document"], "--layout per-document needs the documents"),
    (["causal", "--layout", "striped:x"], "the stripe width is a whole number"),
    (["causal", "--layout", f"striped:{2**63}"], f"--layout 'striped:{2**63}': the stripe width is past 1,099,511,627,776 tokens"),  # hunt 9a:
    (["causal", "--layout", f"ptrr:{2**63}"], f"--layout 'ptrr:{2**63}': the block size is past 1,099,511,627,776 tokens"),  # OverflowError
    (["causal", "--offset", 2], "drop --offset"),
    (["causal", "--layout", "ulysses", "--ranks", 4], "--heads 1 is fewer than --ranks 4"),
    ([], "give a mask"),
    (["causal", "--len", 4096, "--ranks", 1000000000], "--ranks 1000000000 is more than the mask's 4,096 tokens"),  # was killed for memory
    (["causal", "--len", 4096, "--ranks", 2048], "--ranks 2048: shard works out an N x N ring-step grid, so it takes at most 1,024"),
    (["causal", "--rank-mask", "r0.pt"], "--rank-mask given once but --ranks is 2"),
    (["causal", "--head-dim", 0], "--head-dim 0: give the size of one attention head"),  # was 0 FLOPs, exit 0
    (["causal", "--layout", "per-document", "--docs", "99999999999999999999,5"], "a size is past 2^63 - 1 tokens"),  # was
])  # "unexpected OverflowError"
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = invoke(args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_mask_files_one_per_layer_type_with_docs(tmp_path):
    # two layer types' masks as files (a full layer and a sliding one), split per document by --docs
    q = np.arange(12)[:, None]
    k = np.arange(12)[None, :]
    full, sliding = k <= q, (k <= q) & (k > q - 3)
    for name, cells in (("full", full), ("sliding", sliding)):
        torch.save(torch.from_numpy(cells), tmp_path / f"{name}.pt")
    data = json.loads(ok(["--mask", tmp_path / "full.pt", "--mask", tmp_path / "sliding.pt", "--ranks", 2,
                          "--layout", "per-document", "--docs", "4,8", "--json"]))
    # documents 0..3 and 4..11 in chunks of 1 and 2: rank 0 holds 0, 3, 4, 5, 10, 11
    rank0 = [0, 3, 4, 5, 10, 11]
    for mask, cells in zip(data["masks"], (full, sliding)):
        expected = [int(cells[rank0].sum()), int(cells.sum() - cells[rank0].sum())]
        assert mask["cells"] == expected, mask["label"]
    assert [m["label"] for m in data["masks"]] == [str(tmp_path / "full.pt"), str(tmp_path / "sliding.pt")]
    assert data["cu_seqlens"]["te"]["cu_seqlens_on_rank"] == [[0, 2, 6], [0, 2, 6]]


def test_model_without_transformers_is_one_line(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    result = invoke(["--model", "llama", "--len", 64])
    assert result.exit_code == 2
    assert result.stderr.strip() == ('maskcli: error: --model reads a family\'s config with transformers, which is not installed: '
                                     'pip install "maskcli[hf]"')


def test_heads_multiply_the_work_and_ulysses_splits_them():
    out = ok(["causal", "--len", 16, "--ranks", 4, "--heads", 6, "--layout", "ulysses"], 60)
    lines = [" ".join(line.split()) for line in out.splitlines()]
    total = 16 * 17 // 2
    # 6 heads over 4 ranks: 2, 1, 1, 2 (np.linspace rounded); every rank all the cells for its heads
    rows = [line for line in lines if line[:1].isdigit() and line.split()[0] in "0123"]
    assert [row.split()[2] for row in rows] == [str(total * h) for h in (2, 1, 1, 2)]
    assert "rank tokens cells x heads FLOPs x mean" in lines
    assert "ulysses: no ring steps; every rank attends over all tokens" in " ".join(lines)


def test_the_strip_caption_says_what_a_character_and_a_star_stand_for():
    # it said "(* stripes)" over every strip, with or without a star, and not how many positions a character is
    lines = ok(["causal", "--len", 32, "--ranks", 4, "--layout", "contiguous"]).splitlines()
    assert lines[2] == "token -> rank, positions 0-31:"
    lines = ok(["causal", "--len", 4096, "--ranks", 8, "--layout", "striped"], 120).splitlines()
    width = 118  # the strip takes the console's width less 2
    assert lines[2] == f"token -> rank, positions 0-4,095, a character ~{4096 / width:.0f} positions; * = several ranks in one character:"
    assert lines[3] == "*" * width
    lines = ok(["causal", "--len", 1024, "--ranks", 2, "--layout", "contiguous"], 66).splitlines()
    assert lines[2] == "token -> rank, positions 0-1,023, a character = 16 positions:"
    assert lines[3] == "0" * 32 + "1" * 32


@pytest.mark.parametrize("exprs, layout", [(["causal"], "contiguous"), (["causal", "causal & window(16)"], "headtail")])
def test_figure_legend_covers_no_bar_and_a_colour_bar_names_the_ranks(exprs, layout):
    # the legend sat at the lower right, over the bars of the last ranks; the strip's colours had no key
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.patches import Rectangle

    from maskcli import build
    from maskcli.render import shard as render
    from maskcli.shard.plan import analyse

    report = analyse([(e, build(e, length=64)) for e in exprs], layout, 4)
    fig = render.figure(report)
    FigureCanvasAgg(fig).draw()
    work = next(ax for ax in fig.axes if ax.get_ylabel() == "work / mean")
    legend = work.get_legend().get_window_extent()
    bars = [p.get_window_extent() for p in work.patches if isinstance(p, Rectangle) and p.get_height() > 0]
    assert len(bars) == 4 * len(exprs)
    assert not any(legend.overlaps(bar) for bar in bars)
    key = next(ax for ax in fig.axes if ax.get_ylabel() == "rank")  # the colour bar beside the strip
    assert [int(t) for t in key.get_yticks() if 0 <= t <= 3] == [0, 1, 2, 3]


@pytest.mark.parametrize("columns", [60, 120])
def test_te_cu_seqlens_are_never_cut_to_the_width(columns):
    # at 60 columns the cu_seqlens (TE) column was cut to "0,750,20…"; TE's split of documents 3000, 5000, 190 over
    # 4 ranks: each padded to a multiple of 8, chunks 375, 625, 24; rank r holds chunks r and 7-r of each
    out = ok(["document(sizes=[3000,5000,190])", "--ranks", 4, "--layout", "per-document"], columns)
    assert max(len(line) for line in out.splitlines()) <= columns
    expected = {r: [0, 750, 2000, 2000 + min(24, 190 - 24 * r) + min(24, max(0, 190 - 24 * (7 - r)))] for r in range(4)}
    assert expected[0][-1] == 2046  # 190 = 7 x 24 + 22: rank 0's tail chunk holds 22 real tokens
    for r, cu in expected.items():
        shown = ",".join(map(str, cu))
        assert any(line.split() and line.split()[0] == str(r) and line.split()[-1] == shown for line in out.splitlines()), (r, out)
    assert "…" not in out


def test_the_imbalance_finding_gives_the_tables_ratio():
    # contiguous causal over 8 ranks: rank 7's rows see 7 x 512 x 512 + 512 x 513 / 2 cells against a mean of
    # 4096 x 4097 / 2 / 8, 1.8748: the table said 1.875 and the finding 1.87x before
    out = " ".join(ok(["causal", "--len", 4096, "--ranks", 8, "--layout", "contiguous"]).split())
    ratio = (7 * 512 * 512 + 512 * 513 / 2) / (4096 * 4097 / 2 / 8)
    assert f"7 512 1,966,336 1.01G {ratio:.3f} 0/8" in out
    assert f"rank 7 does {ratio:.3f}x the mean work" in out


@pytest.mark.parametrize("columns", [60, 120])
def test_local_cu_seqlens_cut_each_ranks_tokens_where_the_document_changes(columns):
    # contiguous over 4 ranks: rank r holds positions 2048r..2048r+2047; a varlen kernel on that rank needs a new
    # sequence wherever the document changes (counted here token by token)
    sizes = [3000, 5000, 192]
    doc = [d for d, size in enumerate(sizes) for _ in range(size)]
    out = ok([f"document(sizes=[{','.join(map(str, sizes))}])", "--ranks", 4, "--layout", "contiguous"], columns)
    assert max(len(line) for line in out.splitlines()) <= columns and "cu_seqlens (local)" in out and "(TE)" not in out
    for r in range(4):
        mine = doc[2048 * r: 2048 * (r + 1)]
        cu = [0] + [i for i in range(1, len(mine)) if mine[i] != mine[i - 1]] + [len(mine)]
        assert any(line.split() and line.split()[0] == str(r) and line.split()[-1] == ",".join(map(str, cu))
                   for line in out.splitlines()), (r, cu, out)


def test_one_document_lists_no_local_cu_seqlens():
    assert "cu_seqlens (local)" not in ok(["causal", "--len", 64, "--ranks", 4, "--layout", "contiguous"])


def test_a_packed_batch_gives_the_documents(tmp_path):
    # a batch as a collator writes it (position_ids restarting at each document, and its cu_seqlens), read as pack
    # reads it: documents 3, 4 and 9, and-ed into each EXPR; contiguous over 2 ranks, the cells by a double loop
    path = tmp_path / "batch.pt"
    sizes = [3, 4, 9]
    torch.save({"position_ids": torch.tensor([[p for s in sizes for p in range(s)]]), "cu_seqlens": torch.tensor([0, 3, 7, 16])}, path)
    doc = [d for d, s in enumerate(sizes) for _ in range(s)]
    data = json.loads(ok([path, "causal & window(2)", "--ranks", 2, "--layout", "contiguous", "--json"]))
    assert [m["label"] for m in data["masks"]] == ["causal & window(2)"]
    cells = [sum(doc[q] == doc[k] and 0 <= q - k < 2 for q in range(8 * r, 8 * r + 8) for k in range(16)) for r in range(2)]
    assert data["masks"][0]["cells"] == cells
    alone = json.loads(ok([path, "--ranks", 2, "--layout", "per-document", "--json"]))
    assert alone["masks"][0]["expression"] == "document(sizes=[3,4,9])"


def test_a_batch_with_padding_or_two_batches_is_one_line(tmp_path):
    padded = tmp_path / "padded.json"
    padded.write_text(json.dumps({"position_ids": [[0, 1, 2, 0, 1, 0]], "attention_mask": [[1, 1, 1, 1, 1, 0]]}))
    result = invoke([padded, "--ranks", 2])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert f"BATCH {str(padded)!r} holds 1 padding token:" in result.output
    result = invoke([padded, padded.with_name("padded.json"), "--ranks", 2])
    assert result.exit_code == 2 and "give one BATCH file, not 2" in result.output


def test_a_bad_expr_beside_a_batch_is_quoted_as_typed(tmp_path):
    # the batch's documents are a term joined to the EXPR, not text written around it: the error quotes what was typed
    path = tmp_path / "batch.json"
    path.write_text(json.dumps({"position_ids": [[0, 1, 2, 0, 1, 2, 3]]}))
    result = invoke([path, "causal &", "--ranks", 2])
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        "maskcli: error: mask expression 'causal &': expected a kind name, '(' or '~', found the end at character 9; "
        "see maskcli kinds for every kind and its parameters"]
    result = invoke([path, "nosuch(3)", "--ranks", 2])
    assert result.exit_code == 2 and "unknown mask kind 'nosuch' in 'nosuch(3)':" in result.output


def test_the_ring_steps_are_coloured_as_blocks_colours_its_map():
    # contiguous causal over 2 ranks: rank 0 sees part of its own keys (step 0) and none of rank 1's (step 1), rank 1
    # part of its own and all of rank 0's
    from maskcli import build
    from maskcli.render import shard as render
    from maskcli.shard.plan import analyse

    views = render.views(analyse([("causal", build("causal", length=8))], "contiguous", 2), 120)
    grid = next(view for view in views if str(view).startswith("0 "))
    assert str(grid).splitlines()[:2] == ["0 ▒·", "1 ▒█"]
    styles = {str(grid)[span.start:span.end]: str(span.style) for span in grid.spans if "\n" not in str(grid)[span.start:span.end]}
    assert {symbol: styles[symbol] for symbol in "▒·█"} == {"▒": "yellow", "·": "red dim", "█": "green"}


# --- --trace: a hand-written context-parallel program traced under torchrun (tests/data/ranks/context_parallel.py) ---


def traced_run(tmp_path, ranks: int, *program_args: str) -> str:
    from launch import PROGRAMS, torchrun

    done = torchrun(ranks, ["trace", "--save", "run.pt", str(PROGRAMS / "context_parallel.py"), *program_args], tmp_path)
    assert "Traceback" not in done.stderr.split("maskcli trace")[0], done.stderr[-3000:]
    return str(tmp_path / "run.pt")


@pytest.mark.parametrize("ranks, way", [(2, "all_gather"), (2, "ring"), (4, "ring")])
def test_shard_trace_of_a_right_run_is_shard_on_the_layout_it_used(tmp_path, ranks, way):
    run = traced_run(tmp_path, ranks, *(["--ring"] if way == "ring" else []), "--len", "16")
    traced = invoke(["causal", "--trace", run, "--json"])
    assert traced.exit_code == 0, traced.output
    computed = ok(["causal", "--len", 16, "--ranks", ranks, "--layout", "headtail", "--json"])
    assert json.loads(traced.stdout) == json.loads(computed)
    data = json.loads(computed)["masks"][0]
    chunks = [(r * 16 // (2 * ranks), (r + 1) * 16 // (2 * ranks)) for r in range(2 * ranks)]  # head-tail by hand
    assert data["cells"] == [causal_cells(*chunks[r]) + causal_cells(*chunks[2 * ranks - 1 - r]) for r in range(ranks)]
    assert "left out context_parallel.py:" in traced.stderr  # the program's own check over the whole sequence


def test_shard_trace_names_the_rank_whose_part_is_on_local_indices(tmp_path):
    run = traced_run(tmp_path, 2, "--bug", "local")
    result = invoke(["causal", "--trace", run])
    assert result.exit_code == 1
    said = " ".join(result.stdout.split())
    assert ("wrong: shard-local-indices: rank 0's mask uses local indices: its row 4 is position 12, but it masks as if "
            "it were position 4 (first at query 12, key 4)") in said
    assert "wrong: shard-local-indices: rank 1's mask uses local indices" in said


def test_shard_trace_names_the_rank_of_a_ring_that_drops_a_key(tmp_path):
    run = traced_run(tmp_path, 4, "--ring", "--bug", "drop")
    result = invoke(["causal", "--trace", run])
    assert result.exit_code == 1
    said = " ".join(result.stdout.split())
    assert "wrong: shard-dropped-key: rank 1's part hides key 0 from query 2, which causal lets it see" in said
    assert "rank 0's part" not in said and "rank 2's part" not in said


def test_shard_trace_of_one_process_or_the_wrong_ranks_is_one_line(tmp_path):
    from maskcli.tracefile import save

    single = str(tmp_path / "one.pt")
    save(single, [], {})
    result = invoke(["causal", "--trace", single])
    assert result.exit_code == 2 and f"--trace {single!r} is the trace of one process" in " ".join(result.output.split())
    ranked = str(tmp_path / "two.pt")
    save(ranked, [], {}, [{"rank": 0}, {"rank": 1}])
    result = invoke(["causal", "--len", 8, "--trace", ranked, "--ranks", 4])
    assert result.exit_code == 2 and "holds 2 ranks but --ranks is 4: give --ranks 2" in " ".join(result.output.split())
