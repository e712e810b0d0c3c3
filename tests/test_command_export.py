"""`maskcli export` through Typer's CliRunner: the printed call, --save in three file types, refusals, --compare."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from maskcli.commands import app
from maskcli.mask import build

runner = CliRunner()


def export(*args, **kwargs):
    return runner.invoke(app, ["export", *map(str, args)], **kwargs)


def ok(*args):
    result = export(*args)
    assert result.exit_code == 0, result.output
    return result


def test_flash_attn_call_with_its_arguments_written_in():
    out = ok("document(sizes=[3,5]) & window(2)", "--for", "flash-attn").stdout
    assert out.splitlines() == [
        "# flash-attn: document(sizes=[3,5]) & window(2) · shape (1, 1, 8, 8)",
        "# written for flash_attn 2.8.3",
        "import torch",
        "cu_seqlens_q = torch.tensor([0, 3, 8], dtype=torch.int32, device=\"cuda\")",
        "cu_seqlens_k = torch.tensor([0, 3, 8], dtype=torch.int32, device=\"cuda\")",
        "from flash_attn import flash_attn_varlen_func",
        "# q: (total_q, nheads, headdim), k and v: (total_k, nheads_k, headdim), the sequences packed one after another",
        "out = flash_attn_varlen_func(",
        "    q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,",
        "    max_seqlen_q=5, max_seqlen_k=5,",
        "    causal=True, window_size=(1, 0),",
        ")",
        "# window_size=(left, right) counts keys beside the diagonal: a window of W keys is (W-1, 0); here (1, 0)",
    ]


def test_the_printed_sdpa_call_runs_and_is_the_mask(tmp_path):
    path = tmp_path / "m.pt"
    result = ok("causal | blocks(-1,-1,0,0,0,-1)", "--for", "sdpa", "--save", path)
    code = result.stdout
    assert f"t = torch.load({str(path)!r}, weights_only=True, map_location=q.device)" in code  # where q is, cuda too
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    scope = {"q": q, "k": k, "v": v}
    exec(code, scope)  # the call as printed
    keep = torch.tensor([[j <= i or (2 <= i <= 4 and 2 <= j <= 4) for j in range(6)] for i in range(6)])
    scores = (q @ k.transpose(-1, -2) / 2).masked_fill(~keep, float("-inf"))
    assert torch.allclose(scope["out"], torch.softmax(scores, -1) @ v, atol=1e-6)


def test_is_causal_only_where_it_is_top_left():
    assert "is_causal=True" in ok("causal", "--len", 5, "--for", "sdpa").stdout
    behind = ok("causal", "--len", 2, "--offset", 3, "--for", "sdpa").stdout
    assert "attn_mask=causal_lower_right(2, 5)" in behind and "is_causal=True would be top-left" in behind
    fewer = ok("causal", "--len", 4, "--kv-len", 6, "--for", "sdpa").stdout  # query i faces key i: is_causal's own alignment
    assert "is_causal=True)" in fewer and "exactly this mask, with 4 queries and 6 keys too" in fewer


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".npz"])
def test_save_writes_the_tensors_in_each_file_type(tmp_path, suffix):
    path = tmp_path / f"mask{suffix}"
    result = ok("document(sizes=[3,5]) & window(2)", "--for", "flashmask", "--save", path)
    assert f"wrote {path}" in result.stderr
    if suffix == ".pt":
        data = torch.load(path, weights_only=True)
    elif suffix == ".safetensors":
        load_file = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (pip install -e .[test])").load_file
        data = load_file(path)
    else:
        data = {key: torch.from_numpy(value) for key, value in np.load(path).items()}
    rows = data["startend_row_indices"]
    assert rows.dtype == torch.int32 and rows.shape == (1, 1, 8, 1)
    # a causal document with a window of 2: column j is hidden from row min(j + 2, end of its document) on
    assert rows[0, 0, :, 0].tolist() == [min(j + 2, 3 if j < 3 else 8) for j in range(8)]
    assert bool(data["causal"])


def test_a_format_that_cannot_hold_the_mask_says_why_and_what_would(tmp_path):
    path = tmp_path / "x.pt"
    result = export("causal | blocks(-1,-1,0,0,0,-1)", "--for", "flash-attn", "--save", path)
    assert result.exit_code == 2
    assert result.stderr == (
        "maskcli: error: flash-attn varlen cannot express causal | blocks(-1,-1,0,0,0,-1): the rows' right edges are not one "
        "window around the diagonal: use --for flex or magi, or a dense --for sdpa mask\n"
    )
    assert not path.exists() and result.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["causal"], "give --for LIBRARY (sdpa, mha, hf, flex, flash-attn, flashinfer, flashmask, magi, xformers), or --compare"),
    (["causal", "--for", "cudnn"], "--for 'cudnn' is not a format: choose one of sdpa, mha, hf, flex, flash-attn, flashinfer, flashmask, magi, xformers"),
    (["causal", "--for", "sdpa", "--save", "x.txt"], "--save 'x.txt': unknown extension '.txt'; use one of .pt, .safetensors, .npz"),
    (["window(3)", "--len", 6, "--offset", 2, "--for", "flashmask"], "flashmask holds square self-attention masks"),
    # refused, nothing is printed: the message must not point at a call "above"
    (["causal", "--for", "xformers", "--save", "x.pt"], "--save: xformers needs no tensors for causal; drop --save: the call it prints is all of it"),
])
def test_bad_input_is_one_line(args, message):
    result = export(*args)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"maskcli: error: {message}") and result.stderr.count("\n") == 1


def test_a_mask_file_exports_too(tmp_path):
    path = tmp_path / "keep.pt"
    torch.save(torch.tril(torch.ones(6, 6, dtype=torch.bool)), path)
    out = ok("--mask", path, "--for", "flash-attn").stdout
    assert "causal=True, window_size=(-1, 0)" in out


def test_compare_lists_every_format_with_its_bytes():
    result = ok("document(sizes=[300,500,224]) & window(128)", "--compare")
    lines = [" ".join(line.replace("│", " ").split()) for line in result.stdout.splitlines()]
    assert "dense bool (sdpa, mha) 1.0 MiB yes" in lines
    assert "additive float32 (hf) 4.0 MiB yes" in lines
    assert "additive bfloat16 2.0 MiB yes" in lines
    assert any(line.startswith("cu_seqlens (flash-attn, 32 bytes yes") for line in lines)
    assert any(line.startswith("FlashMask startend_row_indices 4.0 KiB yes") for line in lines)
    blocks = 4 * 8 * (2 + 2 * 8)  # 8 x 8 blocks of 128: two counts and two index rows per query block, int32
    assert any(line.startswith(f"BlockMask at 128 {blocks} bytes with its mask_mod") for line in lines)


def test_compare_at_a_million_tokens_is_arithmetic_for_the_dense_formats():
    result = ok("document(sizes=[300000,700000]) & window(4096)", "--len", 1_000_000, "--compare")
    lines = [" ".join(line.replace("│", " ").split()) for line in result.stdout.splitlines()]
    assert "dense bool (sdpa, mha) 931.3 GiB yes" in lines
    assert any(line.startswith("FlashMask startend_row_indices 3.8 MiB yes") for line in lines)


def test_a_million_token_export_writes_o_of_l_tensors(tmp_path):
    path = tmp_path / "fm.pt"
    ok("document(sizes=[300000,700000]) & window(4096)", "--len", 1_000_000, "--for", "flashmask", "--save", path)
    rows = torch.load(path, weights_only=True)["startend_row_indices"]
    assert rows.shape == (1, 1, 1_000_000, 1)
    j = torch.arange(1_000_000)
    assert torch.equal(rows[0, 0, :, 0].long(), torch.minimum(j + 4096, torch.where(j < 300000, 300000, 1_000_000)))


# --- --from FORMAT: the kernel's tensors back into a mask every command takes -------------------------


def diff(*args):
    return runner.invoke(app, ["diff", *map(str, args)])


ROUND_TRIPS = [
    ("flash-attn", "document(sizes=[3,5,4]) & window(2)", []), ("flash-attn", "segment(sizes=[2,6])", []),
    ("flash-attn", "window(3)", ["--len", 4, "--offset", 5]), ("flashmask", "causal | blocks(-1,-1,0,0,0,-1,1,1)", []),
    ("flashmask", "prefix(3)", ["--len", 8]), ("flashmask", "causal", ["--len", 6, "--lengths", "6,3"]),
    ("magi", "causal & (window(2) | sink(1))", ["--len", 9]), ("magi", "causal | blocks(0,0,-1,1,1,1)", []),
    ("magi", "window(3)", ["--len", 4, "--offset", 5]), ("flex", "segment(sizes=[128,256])", []),
    ("flex", "document(sizes=[128,256]) | ~causal", []),
    ("flash-attn", "window(3)", ["--len", 2, "--offset", 4, "--ids", "0,0,5,6,7,8;1,2,3,4,5,6"]),
]


@pytest.mark.parametrize("fmt, expr, flags", ROUND_TRIPS)
def test_export_then_from_is_the_same_mask(tmp_path, fmt, expr, flags):
    path = tmp_path / "m.pt"
    ok(expr, *flags, "--for", fmt, "--save", path)
    result = diff(expr, path, "--from", fmt, *flags)
    assert result.exit_code == 0, result.output


def test_a_hand_made_cu_seqlens_file_with_causal_and_a_window(tmp_path):
    path = tmp_path / "seqlens.pt"
    torch.save({"cu_seqlens": torch.tensor([0, 3, 8], dtype=torch.int32)}, path)
    import json

    result = runner.invoke(app, ["show", "--mask", str(path), "--from", "cu_seqlens", "--causal", "--window", 2, "--json"])
    assert result.exit_code == 0, result.output
    cells = json.loads(result.stdout)["mask"]
    docs = [0, 0, 0, 1, 1, 1, 1, 1]
    # a causal window of 2 keys inside each sequence: the flash rule with window_size=(1, 0)
    assert cells == [[[[int(docs[q] == docs[k] and q - 1 <= k <= q) for k in range(8)] for q in range(8)]]]


@pytest.mark.parametrize("args, message", [
    (["--from", "cudnn"], "unknown --from 'cudnn': choose keep or block (a tensor's convention), or a format: flex, flash-attn, flashmask, magi"),
    (["--causal"], "--causal is for --from flash-attn or flashmask: give --from too, or drop --causal"),
    (["--from", "magi", "--causal"], "--causal is for --from flash-attn or flashmask; magi files say their own mask types"),
    (["--from", "flashmask"], "--from flashmask: the file has no tensor 'startend_row_indices' (it has cu_seqlens): save it with maskcli export --save"),
])
def test_from_a_format_refuses_what_does_not_fit(tmp_path, args, message):
    path = tmp_path / "seqlens.pt"
    torch.save({"cu_seqlens": torch.tensor([0, 3, 8], dtype=torch.int32)}, path)
    result = runner.invoke(app, ["show", "--mask", str(path), *map(str, args)])
    assert result.exit_code == 2
    file = f"--mask {str(path)!r}: " if "the file has no tensor" in message else ""  # a reader's error names the file
    assert result.stderr == f"maskcli: error: {file}{message}\n"


def test_a_block_mask_with_partial_blocks_is_not_read_as_exact(tmp_path):
    path = tmp_path / "b.pt"
    ok("causal", "--len", 256, "--for", "flex", "--save", path)
    result = runner.invoke(app, ["show", "--mask", str(path), "--from", "flex", "--summary"])
    assert result.exit_code == 2
    assert "the BlockMask has 2 partial blocks, whose cells only its mask_mod knows" in result.stderr


def test_a_million_token_round_trip_through_flashmask(tmp_path):
    path = tmp_path / "fm.pt"
    expr = "document(sizes=[300000,700000]) & window(4096)"
    ok(expr, "--len", 1_000_000, "--for", "flashmask", "--save", path)
    result = diff(expr, path, "--from", "flashmask", "--len", 1_000_000)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("args", [["--mask-mod", "tests/data/gym_masks.py:causal_mask", "--len", 6], ["--mask", "KEEP"]])
def test_flex_for_your_own_mask_reads_its_cells_and_runs(tmp_path, monkeypatch, args):
    from pathlib import Path

    args = [str(tmp_path / "keep.pt") if a == "KEEP" else a for a in args]
    torch.save(torch.tril(torch.ones(6, 6, dtype=torch.bool)), tmp_path / "keep.pt")
    args = [str(Path(__file__).parent.parent / a) if str(a).startswith("tests/") else a for a in args]
    path = tmp_path / "flex.pt"
    code = ok(*args, "--for", "flex", "--save", path).stdout
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 6, 8, generator=g) for _ in range(3))
    scope = {"q": q, "k": k, "v": v}
    exec(code, scope)  # as printed: the BlockMask, its mask_mod reading the saved cells, flex_attention
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(scope["out"], want, atol=1e-5)


def test_a_blocks_save_file_reads_back_with_from_flex(tmp_path):
    path = tmp_path / "blocks.pt"
    made = runner.invoke(app, ["blocks", "segment(sizes=[128,256])", "--save", str(path)])
    assert made.exit_code == 0, made.output
    result = diff("segment(sizes=[128,256])", path, "--from", "flex")
    assert result.exit_code == 0, result.output
    assert diff("causal", path, "--from", "flex").exit_code == 1


@pytest.mark.parametrize("tensors, fmt", [
    ({"cu_seqlens": torch.tensor([0, 10**13])}, "flash-attn"),
    ({"q_ranges": torch.tensor([[0, 10**13]]), "k_ranges": torch.tensor([[0, 5]]), "attn_type_map": torch.tensor([1])}, "magi"),
])
def test_a_file_that_describes_too_many_rows_is_refused_before_memory_runs_out(tmp_path, tensors, fmt):
    path = tmp_path / "huge.pt"
    torch.save(tensors, path)
    result = runner.invoke(app, ["show", "--mask", str(path), "--from", fmt, "--summary"])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"maskcli: error: --mask {str(path)!r}: --from {fmt}: a mask of 10000000000000 would need 436.6 TiB")


def test_heads_apply_to_a_mask_read_from_a_format(tmp_path):
    import json

    path = tmp_path / "m.pt"
    ok("segment(sizes=[2,3])", "--for", "magi", "--save", path)
    shown = runner.invoke(app, ["show", "--mask", str(path), "--from", "magi", "--heads", 2, "--json"])
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.stdout)
    assert data["shape"] == [1, 2, 5, 5]
    block = [[int((q < 2) == (k < 2)) for k in range(5)] for q in range(5)]
    assert data["mask"] == [[block, block]]


def test_safetensors_are_written_without_the_safetensors_package(tmp_path, monkeypatch):
    import sys

    import numpy as np

    from maskcli.files import write_safetensors
    from maskcli.tensorfile import load_tensors

    monkeypatch.setitem(sys.modules, "safetensors", None)  # not installed: maskcli writes the format itself
    arrays = {"m": np.tril(np.ones((3, 4), dtype=bool)), "i": np.arange(5, dtype=np.int32), "f": np.array([[0.0, -np.inf]], dtype=np.float32)}
    write_safetensors(arrays, str(tmp_path / "a.safetensors"))
    back = load_tensors(str(tmp_path / "a.safetensors"), "FILE")
    assert all(np.array_equal(back[name].numpy(), value) for name, value in arrays.items())
    result = CliRunner().invoke(app, ["export", "document(sizes=[3,5]) & window(2)", "--for", "hf", "--save", str(tmp_path / "e.safetensors")])
    assert result.exit_code == 0 and "Warning" not in result.output, result.output


def test_a_saved_kernel_format_read_without_from_says_which_from(tmp_path):
    path = tmp_path / "fa.pt"
    assert CliRunner().invoke(app, ["export", "document(sizes=[3,5]) & window(2)", "--for", "flash-attn", "--save", str(path)]).exit_code == 0
    result = CliRunner().invoke(app, ["show", "--mask", str(path)])
    assert result.exit_code == 2 and result.stderr.endswith("as maskcli export --save writes them: read it with --from flash-attn\n")


def test_a_dense_format_too_long_to_fit_points_to_the_compact_ones():
    result = CliRunner().invoke(app, ["export", "document(sizes=[300000,748576]) & window(4096)", "--for", "sdpa"])
    assert result.exit_code == 2 and result.stderr.rstrip().endswith("export it to a compact format (--for flash-attn, flashmask, magi or flex)")


def left_padded_reference(kind: str, length: int, lengths: list[int]) -> torch.Tensor:
    """(B, 1, L, L) keep cells by a double loop over absolute positions: left padding, then causal or local(3).

    local(C) with left padding counts chunks from each row's first real token, as transformers'
    masking_utils.chunked_overlay does (transformers 5.24, masking_utils.py:102-111:
    (kv_idx - left_padding[b]) // chunk_size == (q_idx - left_padding[b]) // chunk_size)."""
    keep = torch.zeros(len(lengths), 1, length, length, dtype=torch.bool)
    for b, real in enumerate(lengths):
        pad = length - real
        for q in range(length):
            for kv in range(length):
                seen = kv <= q and kv >= pad
                if kind == "local(3)":
                    seen = seen and (q - pad) // 3 == (kv - pad) // 3
                keep[b, 0, q, kv] = seen
    return keep


@pytest.mark.parametrize("kind, length, lengths", [("causal", 4, [4, 2]), ("local(3)", 6, [6, 4])])
def test_flex_keeps_left_padding_in_the_printed_build(tmp_path, kind, length, lengths):
    """issue 28.1: the printed build(...) carries pad='left', so its mask_mod is the mask (it padded on the right)."""
    from torch.nn.attention.flex_attention import create_mask

    path = tmp_path / "flex.pt"
    code = ok(kind, "--len", length, "--lengths", ",".join(map(str, lengths)), "--pad", "left", "--for", "flex", "--save", path).stdout
    assert "pad='left'" in code
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(lengths), 1, length, 8, generator=g) for _ in range(3))
    scope = {"q": q, "k": k, "v": v}
    exec(code, scope)  # as printed: build(...).mask_mod, the BlockMask, flex_attention
    printed = create_mask(scope["mask_mod"], len(lengths), 1, length, length, device="cpu")
    want = left_padded_reference(kind, length, lengths)
    own = torch.from_numpy(build(kind, length=length, lengths=",".join(map(str, lengths)), pad="left").dense())
    assert torch.equal(printed, want) and torch.equal(own, want)
    seen = want.any(-1)[..., None].expand_as(q)
    scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~want, float("-inf"))
    assert torch.allclose(scope["out"][seen], (torch.softmax(scores, -1) @ v)[seen], atol=1e-5)


@pytest.mark.parametrize("args, note", [
    (["window(3)", "--len", 2, "--offset", 5], "# 1 partial block: flex_attention calls mask_mod on its cells, so the BlockMask needs it"),
    (["causal", "--len", 256], "# 2 partial blocks: flex_attention calls mask_mod on their cells, so the BlockMask needs it"),
])
def test_flex_counts_its_partial_blocks_in_words(args, note):
    """One 128-block holds all of a short mask (it printed "1 partial blocks"); causal over 256 tokens has two diagonal
    blocks, partial, as create_block_mask's own count says."""
    from torch.nn.attention.flex_attention import create_block_mask

    length = args[args.index("--len") + 1]
    if args[0] == "causal":
        block = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, length, length, device="cpu")
        assert int(block.kv_num_blocks.sum()) == 2  # partial blocks, by FlexAttention's own build
    assert note in ok(*args, "--for", "flex").stdout.splitlines()


@pytest.mark.parametrize("form", ["flash-attn", "magi", "flashmask", "xformers", "flashinfer"])
def test_a_file_whose_heads_are_the_same_is_one_mask_for_every_head(tmp_path, form):
    """A (1, 3, 6, 6) file of one causal mask copied to three heads exports to the formats that hold one mask for
    every head (show calls its heads identical); a file whose heads differ in one cell is still refused."""
    causal = torch.ones(6, 6, dtype=torch.bool).tril()  # the reference: torch.tril
    same, odd = tmp_path / "same.pt", tmp_path / "odd.pt"
    torch.save(causal.expand(1, 3, 6, 6).clone(), same)
    different = causal.expand(1, 3, 6, 6).clone()
    different[0, 1, 5, 0] = False
    torch.save(different, odd)
    out = tmp_path / "out.pt"
    saved = () if form == "xformers" else ("--save", out)  # (xformers' causal is a bias class: no tensors to save)
    result = export("--mask", same, "--for", form, *saved)
    assert result.exit_code == 0, result.output
    if form in ("flash-attn", "magi", "flashmask"):  # (the formats --from reads back)
        back = runner.invoke(app, ["diff", "causal", str(out), "--from", form, "--len", "6"])
        assert back.exit_code == 0, back.output
    refused = export("--mask", odd, "--for", form)
    assert refused.exit_code == 2 and "differ: use --for sdpa" in refused.output


@pytest.mark.parametrize("change, message", [
    ({"full_kv_indices": [[[[7]]]]}, "full_kv_indices holds 7; block counts and indices must lie in 0..1 and 0..0"),
    ({"full_kv_num_blocks": [[[5]]]}, "full_kv_num_blocks holds 5; block counts and indices must lie in 0..1 and 0..0"),
    ({"full_kv_indices": [[[[0, 0]]]], "full_kv_num_blocks": [[[2]]], "block_size": [8, 4]},
     "full_kv_indices lists key block 0 twice in query block 0: save the BlockMask's own full_kv_indices (each block at most once a row)"),
])
def test_a_crafted_block_mask_names_its_bad_count_or_index(tmp_path, change, message):
    """hunt 11: an index out of range was refused without the value, and a full block listed twice (which
    flex_attention would add in twice) was read as once, exit 0."""
    tensors = {"kv_num_blocks": [[[0]]], "kv_indices": [[[[0]]]], "full_kv_num_blocks": [[[1]]], "full_kv_indices": [[[[0]]]],
               "block_size": [128, 128], "seq_lengths": [8, 8]} | change
    path = tmp_path / "b.pt"
    torch.save({name: torch.tensor(value, dtype=torch.int64 if name in ("block_size", "seq_lengths") else torch.int32)
                for name, value in tensors.items()}, path)
    result = runner.invoke(app, ["show", "--mask", str(path), "--from", "flex"])
    assert result.exit_code == 2
    assert result.stderr == f"maskcli: error: --mask {str(path)!r}: --from flex: {message}\n"
