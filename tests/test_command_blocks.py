"""`maskcli blocks` through Typer's CliRunner: the map, JSON equal to create_block_mask, --save, errors."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from typer.testing import CliRunner

from maskcli.commands import app
from maskcli.mask import build

runner = CliRunner()


def invoke(args, **kwargs):
    return runner.invoke(app, ["blocks", *map(str, args)], **kwargs)


def ok(args, **kwargs):
    result = invoke(args, **kwargs)
    assert result.exit_code == 0, result.output
    return result


def test_the_map_of_a_causal_mask():
    out = ok(["causal", "--len", 1024], env={"COLUMNS": "100"}).stdout
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert lines[:4] == [
        "blocks of causal · shape (B=1, H=1, Lq=1024, Lk=1024)",
        "block 128 x 128 (queries x keys): 8 x 8 blocks",
        "sparsity 43.75% (BlockMask.sparsity(): the share of cells in blocks FlexAttention skips)",
        "full 28 (43.75%) · partial 8 (12.50%) · empty 28 (43.75%)",
    ]
    rows = [line.split() for line in lines if re.fullmatch(r"\d+ [█▒·▓]+", line)]
    assert rows == [[str(128 * i), "█" * i + "▒" + "·" * (7 - i)] for i in range(8)]
    assert "one character = one block of 128 queries x 128 keys" in " ".join(lines)


@pytest.mark.parametrize("args, block", [
    (["document(sizes=[90,60,50]) & window(24)"], (16, 16)),
    (["causal | blocks(-1,-1,0,0,0,0,0,-1,1,1,1,-1,-1)"], (2, 3)),
    (["local(8)", "--ids", "0,0,0,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4;4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4"], (4, 4)),
    (["window(5)", "--offset", 30, "--len", 17, "--kv-start", 20], (8, 4)),
    (["causal", "--len", 50, "--heads", 2, "--lengths", "50,31"], (16, 16)),
])
def test_json_is_what_create_block_mask_makes(args, block):
    data = json.loads(ok([*args, "--block", f"{block[0]},{block[1]}", "--json"]).stdout)
    flags = dict(zip(args[1::2], args[2::2]))
    built = build(args[0], length=flags.get("--len"), offset=flags.get("--offset"), kv_start=flags.get("--kv-start"),
                  ids=flags.get("--ids"), lengths=flags.get("--lengths"), heads=flags.get("--heads", 1))
    f = built.frame
    flex = create_block_mask(built.mask_mod, built.batch, built.heads, f.q_len, f.k_len, device="cpu", BLOCK_SIZE=block)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert data[name] == getattr(flex, name).tolist(), name
    assert data["sparsity"] == pytest.approx(flex.sparsity())
    assert data["block_size"] == list(block) and data["seq_lengths"] == [f.q_len, f.k_len]
    assert data["expression"] == built.text


@pytest.mark.parametrize("args, batch, heads", [
    (["document(sizes=[300,212]) & window(64)"], None, None),
    (["causal", "--len", "512", "--lengths", "512,300", "--heads", "2"], 2, 2),
])
def test_save_rebuilds_the_block_mask_with_both_sides_as_create_block_mask_makes_them(tmp_path, args, batch, heads):
    path = tmp_path / "blocks.pt"
    result = ok([*args, "--block", 32, "--save", path])
    assert f"wrote {path} (BlockMask(**torch.load({str(path)!r}, weights_only=True), mask_mod=MASK_MOD)" in result.stderr
    data = torch.load(path, weights_only=True)
    built = build(args[0], **({"length": 512, "lengths": "512,300", "heads": 2} if batch else {}))
    rebuilt = BlockMask(**data, mask_mod=built.mask_mod)  # as printed; torch 2.11's BlockMask requires a mask_mod
    flex = create_block_mask(built.mask_mod, batch, heads, 512, 512, device="cpu", BLOCK_SIZE=32)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(rebuilt, name), getattr(flex, name).expand_as(getattr(rebuilt, name))), name
    assert torch.equal(rebuilt.to_dense(), flex.to_dense().expand_as(rebuilt.to_dense())) and rebuilt.seq_lengths == (512, 512)
    from_kv = BlockMask.from_kv_blocks(*(data[k] for k in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")),
                                       BLOCK_SIZE=data["BLOCK_SIZE"], seq_lengths=data["seq_lengths"])
    assert torch.equal(from_kv.q_indices, rebuilt.q_indices)  # the q side is what from_kv_blocks would compute
    assert [p.name for p in tmp_path.iterdir()] == ["blocks.pt"]


def test_png_has_a_panel_per_batch_row(tmp_path):
    path = tmp_path / "b.png"
    result = ok(["causal", "--len", 256, "--lengths", "256,100", "--block", 32, "--png", path])
    assert f"wrote {path}" in result.stderr and path.stat().st_size > 0


def test_a_long_map_fits_60_columns_and_shows_the_sink_column():
    out = ok(["window(3) | sink(1)", "--len", 100000, "--block", 16], env={"COLUMNS": "60"}).stdout
    rows = [line.split()[1] for line in out.splitlines() if re.fullmatch(r"\s*\d+ [█▒·▓]+", line)]
    assert rows and all(row[0] == "▒" for row in rows)  # every query block sees key 0 and not all of its block
    assert all(len(line) <= 60 for line in out.splitlines())


@pytest.mark.parametrize("args, says", [
    (["causal", "--block", "0"], "--block '0'"),
    (["causal", "--block", "a"], "not a block size"),
    (["causal", "--block", "1,2,3"], "give one size"),
    (["causal", "--len", 1 << 20, "--json"], "--json would list 67,108,864 block indices"),
    (["causal", "--save", "b.npy"], "'.npy'"),
    (["windw(3)"], "did you mean window?"),
])
def test_bad_input_is_one_line(args, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(args)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("maskcli: error: ") and says in line
    assert list(tmp_path.iterdir()) == []


def test_blocks_import_no_torch():
    import subprocess
    import sys

    code = "import sys\nfrom maskcli.commands import main\nsys.argv = ['maskcli', 'blocks', 'window(64)', '--len', '4096']\n" \
           "try:\n    main()\nexcept SystemExit:\n    pass\nprint('TORCH', 'torch' in sys.modules, file=sys.stderr)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "TORCH False" in result.stderr, result.stderr[-500:]


def test_blocks_of_a_mask_file_and_a_mask_mod_equal_create_block_mask(tmp_path):
    import os

    keep = torch.rand(1, 1, 40, 40, generator=torch.Generator().manual_seed(0)) > 0.7
    torch.save(keep, tmp_path / "m.pt")
    data = json.loads(ok(["--mask", tmp_path / "m.pt", "--from", "keep", "--block", 8, "--json"]).stdout)
    flex = create_block_mask(lambda b, h, q, kv: keep[0, 0, q, kv], 1, 1, 40, 40, device="cpu", BLOCK_SIZE=8)
    assert data["kv_indices"] == flex.kv_indices.tolist() and data["full_kv_num_blocks"] == flex.full_kv_num_blocks.tolist()
    gym = os.path.join(os.path.dirname(__file__), "data", "gym_masks.py")
    data = json.loads(ok(["--mask-mod", f"{gym}:packed_causal", "--len", 8, "--block", 2, "--json"]).stdout)
    assert data["kv_num_blocks"] == create_block_mask(build("document(sizes=[3,5])").mask_mod, 1, 1, 8, 8, device="cpu", BLOCK_SIZE=2).kv_num_blocks.tolist()


def test_a_mask_mod_that_reads_the_head_gets_each_heads_blocks(tmp_path):
    (tmp_path / "heads.py").write_text("def by_head(b, h, q, kv):\n    return (kv <= q) & (q - kv <= 4 * h)\n")
    data = json.loads(ok(["--mask-mod", f"{tmp_path / 'heads.py'}:by_head", "--len", 16, "--heads", 3, "--block", 4, "--json"]).stdout)
    flex = create_block_mask(lambda b, h, q, kv: (kv <= q) & (q - kv <= 4 * h), 1, 3, 16, 16, device="cpu", BLOCK_SIZE=4)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert data[name] == getattr(flex, name).tolist(), name
    assert [entry["head"] for entry in data["counts"]] == [0, 1, 2] and data["counts_cover"] == "one batch row and head each"


def test_the_blocks_of_a_region_are_those_of_its_cells():
    data = json.loads(ok(["document(sizes=[40,24]) & window(12)", "--rows", "32:48", "--keys", "16:48", "--block", 8, "--json"]).stdout)
    keep = build("document(sizes=[40,24]) & window(12)").dense()[0, 0, 32:48, 16:48]
    flex = create_block_mask(lambda b, h, q, kv: torch.as_tensor(keep)[q, kv], 1, 1, 16, 32, device="cpu", BLOCK_SIZE=8)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert data[name] == getattr(flex, name).tolist(), name


def test_summary_counts_the_blocks_and_their_rows_without_the_indices():
    args = ["document(sizes=[300,212]) & window(64)", "--block", 32]
    data = json.loads(ok([*args, "--summary", "--json"]).stdout)
    flex = create_block_mask(build("document(sizes=[300,212]) & window(64)").mask_mod, None, None, 512, 512, device="cpu", BLOCK_SIZE=32)
    full, partial = flex.full_kv_num_blocks[0, 0].numpy(), flex.kv_num_blocks[0, 0].numpy()
    plane = data["planes"][0]
    assert (plane["full"], plane["partial"], plane["empty"]) == (int(full.sum()), int(partial.sum()), 16 * 16 - int(full.sum() + partial.sum()))
    assert plane["per_query_block_row"]["full"] == {"min": int(full.min()), "median": float(np.median(full)), "max": int(full.max())}
    assert plane["per_query_block_row"]["computed"]["max"] == int((full + partial).max())
    assert "kv_indices" not in data and data["sparsity"] == pytest.approx(flex.sparsity())
    text = ok([*args, "--summary"]).stdout
    assert f"full {int(full.sum())} " in text and "blocks per query-block row: full" in text
    long = json.loads(ok(["causal", "--len", 1 << 20, "--summary", "--json"]).stdout)  # --json alone is refused here
    assert long["planes"][0]["full"] == 8191 * 8192 // 2 and long["planes"][0]["partial"] == 8192


def test_html_writes_the_page_with_the_block_sizes(tmp_path):
    result = ok(["document(sizes=[300,500,224]) & window(128)", "--block", "64,32", "--html", tmp_path, "--summary"])
    path = tmp_path / "blocks_document_sizes_300_500_224_and_window_128.html"
    assert f"wrote {path}" in result.stderr
    assert '"blocks":{"q":64,"kv":32,"map":["' in path.read_text()  # and each block's category (test_render_html.py)


def test_bad_html_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(["causal", "--html", "nodir/b.html"])
    assert result.exit_code == 2 and result.stderr == "maskcli: error: --html 'nodir/b.html': directory 'nodir' does not exist; create it first\n"
    assert list(tmp_path.iterdir()) == []


def test_the_summary_wraps_between_words_on_a_narrow_terminal():
    """--summary was echoed as long lines that a 60-column terminal cut wherever column 60 fell."""
    text = ok(["causal", "--len", "4096", "--summary"], env={"COLUMNS": "60"}).stdout
    assert text.splitlines() == [
        "blocks of causal · shape (B=1, H=1, Lq=4096, Lk=4096)",
        "block 128 x 128 (queries x keys): 32 x 32 blocks",
        "sparsity 48.44% (BlockMask.sparsity(): the share of cells in",
        "  blocks FlexAttention skips)",  # two cells in, never at column 0
        "full 496 (48.44%) · partial 32 (3.12%) · empty 496 (48.44%)",
        "blocks per query-block row: full 0-31 (median 15.5) ·",
        "  partial 1-1 (median 1) · computed 1-32 (median 16.5); rows",
        "  with no block: 0",
    ]
    piped = ok(["causal", "--len", "4096", "--summary"]).stdout
    assert "sparsity 48.44% (BlockMask.sparsity(): the share of cells in blocks FlexAttention skips)\n" in piped


@pytest.mark.parametrize("block", ["1_28", "\u0661\u0662\u0668", "\uff11\uff12\uff18", "64,1_28"])
def test_a_block_size_is_digits_0_to_9_as_len_takes_it(block):
    """hunt 10: int() read --block 1_28 (and Arabic-Indic or fullwidth digits) as 128, where --len '1_0' is refused."""
    result = invoke(["causal", "--len", "300", "--block", block, "--summary"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == f"maskcli: error: --block {block!r} is not a block size: give one whole number like 128, or Q,KV like 128,64\n"
