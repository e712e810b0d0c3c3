"""Hostile input, every command: one line on stderr that quotes the bad value, exit 2, no traceback, no file left.

The table runs each case in a fresh folder holding the files `plant` makes, and checks that the folder
holds exactly those files afterwards (no partial output, no stray temporary file).
"""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from hostile_files import LONG, TRACE_DAMAGE, plant, plant_crafted
from typer.testing import CliRunner

from maskcli.commands import app

runner = CliRunner()
BIG = str(10**30)


CASES = [
    # integers past what numpy and torch hold
    (["chunk", f"{BIG},0,1"], BIG),
    (["chunk", f"-{BIG},0,1"], BIG),
    (["show", f"chunk(0,{BIG})"], BIG),
    (["show", "tril", "--diagonal", BIG], BIG),
    (["show", "tril", "--diagonal", str(-(2**63) - 1)], str(-(2**63) - 1)),
    (["show", "tril", "--diagonal", str(2**63)], str(2**63)),
    (["show", f"triu({2**63})", "--len", "4"], str(2**63)),
    (["show", "causal", "--heads", str(2**63)], str(2**63)),
    (["show", "causal", "--len", BIG], BIG),
    (["show", "causal", "--offset", str(2**63)], str(2**63)),
    (["show", "causal", "--kv-start", str(-(2**63))], str(-(2**63))),
    (["show", f"window({BIG})", "--len", "4"], BIG),
    (["show", f"sink({2**64})", "--len", "4"], str(2**64)),
    (["show", f"local({-(2**63)})", "--len", "4"], str(-(2**63))),
    (["show", f"document(sizes=[{BIG}])"], BIG),
    (["show", f"tree(-1,{BIG})"], BIG),
    (["show", f"blocks(-1,{BIG})"], BIG),
    (["show", "padding", "--lengths", BIG], BIG),
    (["show", "padding", "--ids", f"1,{BIG}"], BIG),
    (["blocks", "causal", "--block", BIG], BIG),
    (["blocks", "causal", "--block", "0"], "'0'"),
    (["blocks", "causal", "--block", "16,x"], "16,x"),
    (["diff", "causal", f"window({BIG})", "--len", "4"], BIG),
    (["attend", "causal", "--seed", str(2**64)], str(2**64)),
    (["attend", "causal", "--batch-index", BIG], BIG),
    (["attend", "causal", "--precision", BIG], BIG),
    (["verify", "causal", "--repeat", BIG], BIG),
    (["verify", "causal", "--atol", "nan"], "nan"),
    (["pack", "--cu-seqlens", f"0,{BIG}"], BIG),
    (["pack", "--position-ids", f"0,{BIG}"], BIG),
    (["pack", "--input-ids", "1,2", "--eos-id", BIG], BIG),
    (["pack", "--position-ids", "0,1", "--max-length-q", "1,2"], "'1,2'"),
    (["pack", "evil.pt"], "weights_only=True"),
    (["pack", "good.pt"], "one unnamed tensor"),
    (["pack", "deep.json"], "deep.json"),
    (["pack", "fifo.pt"], "fifo.pt"),
    (["pack", "--attention-mask", "[[[[0.5,0],[0,0]]]]"], "additive bias"),
    # sizes that cannot be allocated: refused up front, naming the bytes
    (["attend", "causal", "--len", str(2**40)], "would need"),
    (["attend", "causal", "--heads", str(10**12)], "would need"),
    (["attend", "causal", "--batch", str(10**12)], "would need"),
    (["attend", "causal", "--head-dim", str(10**12)], "past the 65,536"),
    (["attend", "prefill", "--offset", str(2**40), "--len", "1"], "would need"),
    (["attend", "causal", "--x", "[[1,2],[3,4]]", "--d-out", str(10**12)], "would need"),
    (["verify", "causal", "--len", str(2**40)], "would need"),
    (["verify", "causal", "--head-dim", str(10**12)], "past the 65,536"),
    (["show", "padding", "--lengths", str(10**12), "--json"], "would need"),
    (["show", "causal", "--len", str(2**40), "--json"], "past the 4,194,304 it prints"),
    (["show", "causal", "--len", str(2**40), "--save", "big.pt"], "would need"),
    (["show", "causal", "--len", "20000", "--json"], "--json would list 400,000,000 mask cells"),  # was minutes of printing
    (["chunk", "0,0,1", "--len", str(2**40), "--save", "big.npy"], "chunk(0,0,1)"),
    # files: missing, not files, damaged, hostile
    (["inspect", LONG + ".pt"], "aaaa"),
    (["show", "--mask", LONG + ".pt"], "aaaa"),
    (["attend", "causal", "--q", LONG + ".pt", "--k", "q.pt", "--v", "q.pt"], "aaaa"),
    (["show", "causal", "--png", LONG + ".png"], "aaaa"),
    (["show", "causal", "--save", LONG + ".npy"], "aaaa"),
    (["convert", "good.pt", "--out", LONG + ".pt", "--to", "block"], "aaaa"),
    (["attend", "causal", "--x", "meta.pt"], "meta.pt"),
    (["attend", "causal", "--q", "meta3.pt", "--k", "meta3.pt", "--v", "meta3.pt"], "meta3.pt"),
    (["inspect", "meta.pt"], "meta.pt"),
    (["inspect", "scalar.npy"], "'scalar.npy' is a single number"),
    (["chunk", "empty_labels.npy"], "chunk labels 'empty_labels.npy': the file is empty"),
    (["show", 'document("empty_labels.npy")'], "the file is empty"),
    (["chunk", "system.pt"], "chunk labels 'system.pt': refused to load with weights_only=True"),
    (["inspect", "dir.pt"], "FILE 'dir.pt' is a directory"),
    (["attend", "causal", "--len", "3", "--head-dim", str(10**8)], "--head-dim 100,000,000 is past the 65,536"),
    (["chunk", "labels.txt"], "chunk labels 'labels.txt': 'x' is not an integer"),
    (["show", "padding", "--ids", "5,6,7,0", "--pad-id", BIG], f"--pad-id '{BIG}': an integer of 31 digits is far too large"),
    (["show", "causal", "--len", "4", "--pad-id", str(2**63)], f"--pad-id {2**63} is too large (at most ±{2**62:,}"),  # unused, still refused
    (["show", "causal", "--len", "4", "--pad-id", str(-2**63 - 1)], f"--pad-id {-2**63 - 1} is too large"),
    (["model", "llama", "--pad-id", str(2**63)], f"--pad-id {2**63}: the tiny model's vocabulary is 0..127: give a pad id in it"),
    (["show", "causal", "--len", "3", "--len", "abc"], "--len 'abc'"),
    (["show", "causal", "--save", "/proc/x.npy"], "is not a place files can be written"),
    (["convert", "labels.txt", "--to", "keep", "--out", "o.npy"], "unknown file type '.txt'"),
    (["show", "--mask", "scalar.npy"], "'scalar.npy' is a single number"),
    (["show", "--mask", "meta.pt"], "meta.pt"),
    (["inspect", "negative.safetensors"], "negative.safetensors"),
    (["inspect", "beyond.safetensors"], "beyond.safetensors"),
    (["inspect", "short.safetensors"], "short.safetensors"),
    (["show", "--mask", "negshape.safetensors"], "negshape.safetensors"),
    (["show", "--mask", "strshape.safetensors"], "strshape.safetensors"),
    (["inspect", "header.safetensors"], "'header.safetensors': not a readable .safetensors file (damaged: its header says it is 4,611,686,018,427,387,904 bytes long"),
    (["inspect", "/dev/zero"], "/dev/zero"),
    (["inspect", "fifo.pt"], "fifo.pt"),
    (["show", "--mask", "fifo.pt"], "fifo.pt"),
    (["attend", "causal", "--x", "fifo.pt"], "fifo.pt"),
    (["inspect", "loop.pt"], "loop.pt"),
    (["diff", "causal", "loop.pt"], "loop.pt"),
    (["inspect", "dir.pt"], "dir.pt"),
    (["inspect", "evil.pt"], "evil.pt"),
    (["show", "--mask", "pickle.pt"], "pickle.pt"),
    (["inspect", "empty.npy"], "empty.npy"),
    (["show", "--mask", "deep.json"], "deep.json"),
    (["attend", "causal", "--x", "bad.json"], "bad.json"),
    (["show", 'document("labels.txt")'], "labels.txt"),
    (["show", 'document("fifo.pt")'], "fifo.pt"),
    (["show", 'document("missing.npy")'], "missing.npy"),
    (["show", "--mask-mod", "mod.py:raises", "--len", "4"], "mod.py"),
    (["show", "--mask-mod", "mod.py:floats", "--len", "4"], "floats"),
    (["show", "--mask-mod", "mod.py:shape", "--len", "4"], "shape"),
    (["show", "--mask-mod", "mod.py:nothing", "--len", "4"], "nothing"),
    (["show", "--mask-mod", "syntax.py:broken", "--len", "4"], "syntax.py"),
    (["show", "--mask-mod", "mod.py:factory", "--mask-mod-args", "__import__('os')", "--len", "4"], "__import__"),
    (["show", "--mask-mod", "fifo.py:f", "--len", "4"], "fifo.py"),
    (["blocks", "--mask-mod", "mod.py:raises", "--len", "64"], "mod.py"),
    (["diff", "exits", "causal", "--mask-mod", "mod.py:exits", "--len", "4"], "SystemExit"),  # never exit 0, "equal"
    (["chunk", "u64.npy"], "too large"),
    (["show", "blocks", "--block-ids", "u64.npy"], "too large"),
    (["chunk", "big.txt"], "too large"),
    (["show", "--mask", "good.npy", "--from", "sideways"], "'sideways'"),
    (["diff", "causal", "good.npy", "--from", "KEEP"], "'KEEP'"),
    # writing: unknown suffixes, directories, unwritable places, empty names
    (["show", "causal", "--save", "out.txt"], "'.txt'"),
    (["show", "causal", "--png", "out.gif"], "'.gif'"),
    (["show", "causal", "--save", "missing/out.npy"], "missing"),
    (["show", "causal", "--save", ""], "--save"),
    (["attend", "causal", "--png", ""], "--png"),
    (["show", "causal", "--save", "good.npy/out.npy"], "good.npy"),
    (["show", "causal", "--save", "fifo.pt"], "fifo.pt"),
    # messages: malformed values say what was given
    (["attend", "causal", "--ids", ";1,2"], "--ids"),
    (["show", "causal", "--ids", "1,2;;3"], "1,2;;3"),
    (["attend", "causal", "--scale", "abc"], "'abc'"),
    (["attend", "causal", "--dropout", "1.5"], "1.5"),
    (["attend", "causal", "--x", "[[1,2],[3"], "[[1,2],[3"),
    (["attend", "causal", "--x", "[" * 5000 + "]" * 5000], "--x"),
    (["show", "causal", "--dtype", "bogus", "--as", "additive"], "'bogus'"),
    (["show", "causal", "--as", "sideways"], "'sideways'"),
    (["show", "causal &"], "causal &"),
    (["show", "window(3"], "window(3"),
    (["show", "causl"], "causl"),
    (["show", "window(x)"], "window(x)"),
    (["show", "causal", "--align", "middle", "--kv-len", "4"], "'middle'"),
    (["show", "causal", "--grid", "0,0", "--summary"], "0,0"),
    (["show", "causal", "--tokens", "a b", "--len", "4"], "a b"),
    (["attend", "causal", "--stages", ",,"], ",,"),
    (["attend", "causal", "--device", "tpu"], "'tpu'"),
    (["verify", "causal", "--device", "cuda:99"], "cuda:99"),
    (["inspect", "good.pt", "--heads", "x"], "'x'"),
    (["convert", "good.pt", "--out", "out.pt", "--to", "upside"], "'upside'"),
    (["convert", "good.pt", "--out", "out.gif", "--to", "block"], "'.gif'"),
    (["convert", "pickle.pt", "--out", "out.pt", "--to", "block"], "pickle.pt"),
    (["diff", "causal"], "B"),
    (["kinds", "--json", "extra"], "extra"),
    (["nosuchcommand"], "nosuchcommand"),
    # text far past what Python converts to int (4,300 digits), deep nesting, and huge names: short lines
    (["show", f"window({'9' * 4301})"], "at most 19 digits"),
    (["show", f"document({'9' * 4301},1)"], "at most 19 digits"),
    (["show", "padding", "--lengths", "9" * 4301], "is too large"),
    (["show", "causal", "--ids", "1,2," + "9" * 4301], "is too large"),
    (["show", "~" * 3000 + "causal"], "nests about 3,000 levels deep"),
    (["show", "(" * 3000 + "causal" + ")" * 3000], "nests about 3,000 levels deep"),
    (["show", "a" * 100_000], "unknown mask kind 'aaaa"),
    (["show", "causal", "--len", "4", "--png", "o\udcff.png"], "o\\udcff.png"),
    # any exception out of a user's code, of any class, is one line naming their file and line
    (["show", "--mask-mod", "mod.py:halts", "--len", "3"], "your mask_mod halts raised Halt: stop here (mod.py line 22)"),
    (["diff", "halts", "causal", "--mask-mod", "mod.py:halts", "--len", "3"], "raised Halt: stop here (mod.py line 22)"),
    (["attend", "causal", "--fill", ""], "unknown --fill ''"),
    (["show", "--mask-mod", "mod.py:factory", "--mask-mod-args", "[" * 3000 + "]" * 3000], "nests too deeply to read: give flat literals"),
    (["show", "--mask-mod", "mod.py:factory", "--mask-mod-args", "9" * 5001], "is an integer of more than 4,300 digits"),
    (["show", "causal", "--as", "min", "--dtype", ""], "unknown --dtype ''"),
    # a module reference loads code only behind --mask-mod (evilmod.py leaves a file if imported)
    (["diff", "causal", "evilmod:f"], "give --mask-mod evilmod:f and write B as f"),
    (["diff", "evilmod.py:f", "causal", "--len", "4"], "give --mask-mod evilmod.py:f and write A as f"),
    (["diff", "causal", "this:f"], "'this:f'"),
    # issue 18, item 9: the kinds that follow Hugging Face refuse what they cannot mean
    (["show", "document(0,0,1,1) & segment(0,1,1,1) & local(2)"], "different document labels"),
    (["show", "local(2, documents=[0,0,1])", "--len", "4"], "local(2, documents=[0,0,1])"),
    (["show", f"lookback({BIG})", "--len", "4"], BIG),
    (["show", "lookback(0)", "--len", "4"], "lookback(0)"),
    # issue 37: trace refuses its options before the program runs, and before -m imports the module's package
    (["shard", "causal", "--len", "4", "--trace", "fifo.pt"], "trace file 'fifo.pt' is not a regular file"),  # blocked forever
    (["shard", "causal", "--len", "4", "--trace", "/proc/self/status"], "'/proc/self/status' is not a trace file maskcli can read"),
    (["trace", "--save", "/proc/t.pt", "prog.py"], "--save '/proc/t.pt': directory '/proc' is not a place files can be written"),
    (["trace", "--json", "/proc/t.json", "-m", "evilpkg.mod"], "--json '/proc/t.json': directory '/proc' is not a place"),
    (["trace", "--expect", "x=bogus(", "-m", "evilpkg.mod"], "--expect 'x=bogus('"),
    (["trace", "--api", "bogus", "-m", "evilpkg.mod"], "--api 'bogus'"),
    (["trace", "--rank-timeout", "nan", "prog.py"], "--rank-timeout nan: give 0 or more seconds"),
    (["trace", "--rank-timeout", "1e400", "prog.py"], "--rank-timeout inf: give 0 or more seconds, a finite number"),
    (["verify", "causal", "--atol", "1e400"], "--atol must be 0 or more and finite, got inf"),  # passed every kernel, "ok"
    (["show", "causal", "--save", "/proc/self/x.npy"], "directory '/proc/self' is not writable"),
    # integer options: digits 0-9 only, and a 5,000-digit one quoted in part (it was quoted whole)
    (["show", "causal", "--len", "9" * 5000], "--len '9999999999999999999999999999999999999999999 ... 999999999999': an integer of 5,000 digits"),
    (["show", "causal", "--len", "1_0"], "--len '1_0': '1_0' is not a whole number (write it in digits 0-9, like 16)"),
    (["trace", "--max-bytes", "\uff11\uff12", "prog.py"], "'\uff11\uff12' is not a whole number"),
    (["shard", "causal", "--ranks", "0x10"], "--ranks '0x10'"),
    # hunt 5: trace's own options and programs that are no file; verify's inputs that make every kernel NaN
    (["trace", "--html", "x.html", "prog.py"], "no such option: --html (maskcli trace --help lists trace's own"),  # was "no such script '--html'"
    (["trace", "dir.pt"], "'dir.pt' is a directory: give the path of a Python file"),
    (["verify", "causal", "--q", "[[NaN,1],[1,2]]", "--k", "[[1,2],[3,4]]", "--v", "[[1,2],[3,4]]"],
     "--q holds nan (1 of 4 values): verify compares kernels with a reference"),  # was "DISAGREES nan" on every kernel, exit 0
    (["verify", "causal", "--x", "[[1e400,1],[1,2]]"], "--x, projected, holds"),
    # a NUL byte in a file name was "unexpected ValueError: embedded null byte"
    (["show", "causal", "--png", "x\x00y.png"], "'x\\x00y.png' holds a NUL byte"),
    (["show", "--mask", "a\x00b.pt"], "holds a NUL byte"),
    (["serve", "v\x00.pt"], "holds a NUL byte"),
]


@pytest.mark.parametrize("args", [args for args, _ in CASES], ids=[" ".join(a)[:80] for a, _ in CASES])
def test_hostile_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, monkeypatch, args):
    quoted = dict((tuple(a), q) for a, q in CASES)[tuple(args)]
    plant(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = set(tmp_path.rglob("*"))
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maskcli: error: "), result.stderr
    assert len(lines[0]) <= 1000, lines[0][:200]  # a 100,000-character input is quoted in part
    assert quoted in lines[0], (quoted, lines[0])
    assert "Traceback" not in result.output and result.stdout == ""
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    assert set(tmp_path.rglob("*")) == before  # no partial file, no temporary file, nothing the exploit made


# issue 37: crafted files for every reader; each was an internal error, a traceback, a 13 GB unpacking or a wrong
# answer with exit 0 (the value each line must quote beside it)
LIMIT = "1,099,511,627,776"
CRAFTED = [
    # hunt 24: errors that pasted a library's internals, a count that was a file's negative number, a head count past
    # every other option's limit
    (["inspect", "badheader.npy"], "'badheader.npy': not a readable numpy file (its header is not the dictionary a .npy "
                                   "file starts with (descr, fortran_order, shape)): save it again with numpy.save"),
    (["inspect", "cut.pt"], "not a readable .pt file (RuntimeError: PytorchStreamReader failed reading zip archive: failed "
                            "finding central directory): save it again with torch.save(tensor, path)"),
    (["show", "--mask", "flexneg.pt", "--from", "flex"], "kv_num_blocks holds -4, a negative count of partial blocks"),
    (["inspect", "good3.pt", "--heads", "99999999999999999999"], "--heads 99999999999999999999 is too large: at most"),
    (["serve", "ps0.pt"], "page_size 0 must be 1 to 1,048,576"),
    (["serve", "psneg.pt"], "page_size -4 must be 1 to 1,048,576"),
    (["serve", "wsg.pt"], f"sliding_window_size holds {2**63 - 1}, past the {LIMIT}"),
    (["serve", "wfa.pt"], f"window_size holds {2**63 - 1}"),
    (["serve", "wfa2.pt"], f"window_size holds {2**63 - 1}"),  # was "no key visible", exit 0
    (["serve", "wfi.pt"], f"window_left holds {2**63 - 1}"),
    (["serve", "draft.pt"], "draft_token_num -1 must be at least 1"),
    (["serve", "trt_neg.pt"], "seq_lens is -3 for request 0"),
    (["serve", "trt_ctx.pt"], "num_contexts -1 is not 0 to 2 (the requests in seq_lens)"),  # was exit 0
    (["serve", "trt_empty.pt"], "spec_decoding_packed_mask has shape [1, 3, 0]"),
    (["serve", "pages62.pt"], f"block_table_tensor holds {2**62}"),
    (["serve", "cascade.pt"], "common_prefix_len -16 is negative"),  # was read as prefix(-16), "ok"
    (["serve", "slotwrap.pt"], f"slot_mapping holds {2**62 + 1}"),  # was a slot on another request's page passing
    (["serve", "nan.pt"], "seq_lens holds nan, not a whole number"),
    (["serve", "sparse.pt"], "seq_lens is a sparse_coo tensor"),
    (["serve", "digits.json"], "9999999999"),
    (["serve", "dump"], "its last line is a JSON list, not the record of a call"),
    (["serve", "dump2"], "its last line is a JSON str, not the record of a call"),
    (["inspect", "nested.pt"], "'nested.pt' is a nested tensor"),
    (["show", "--mask", "nested.pt"], "'nested.pt' is a nested tensor"),
    (["inspect", "sparse_huge.pt"], "the dense mask 1000000 x 1000000 would need 4.5 TiB (5,000,000,000,000 bytes) "
                                    "to make 'sparse_huge.pt' (torch.sparse_coo) dense"),
    (["show", "--mask", "sparse_huge.pt"], "to make 'sparse_huge.pt' (torch.sparse_coo) dense"),
    (["show", "--mask", "fa_float.pt", "--from", "flash-attn"], "cu_seqlens_q holds 2.5"),  # was read as 2, exit 0
    (["export", "--for", "sdpa", "--mask", "fa_nan.pt", "--from", "flash-attn"], "cu_seqlens_q holds nan"),
    (["export", "--for", "sdpa", "--mask", "fm_float.pt", "--from", "flashmask"], "startend_row_indices holds 1.5"),
    (["export", "--for", "sdpa", "--mask", "fa_whole.pt", "--from", "flash-attn"],
     "cu_seqlens_k is a float tensor (float32) holding whole numbers; the library takes integers (int32)"),  # was exit 0
    (["show", "--mask", "fm_whole.pt", "--from", "flashmask"], "startend_row_indices is a float tensor"),
    (["show", "--mask", "fm_empty.pt", "--from", "flashmask"], "startend_row_indices has shape [1, 1, 0, 1]: it holds no rows"),
    (["show", "--mask", "magi_empty.pt", "--from", "magi"], "the file holds 0 slices over 0 queries and 0 keys"),
    (["show", "--mask", "digits_mask.json"], "9999999999"),
    (["pack", "--cu-seqlens", "0,0"], "--cu-seqlens '0,0' ends at 0: the batch has no tokens"),
    (["pack", "--attention-mask", '[["inf"]]'], "--attention-mask holds inf, not a whole number"),
    (["pack", "--attention-mask", "[[" + "9" * 30 + "]]"], "999999999999999999999999999999 does not fit int64"),
    (["inspect", "liar.npz"], "member 'mask.npy' is damaged: its header declares 16,777,216 bytes"),
    (["inspect", "nonpy.npz"], "member 'a.txt' is not a .npy array"),  # was "unexpected AttributeError"
    # digits of other scripts: str.isdigit and the regex \\d take them, int() refuses '²' and reads '３' as 3
    (["inspect", "t_good.pt:\u00b2"], "t_good.pt:'\u00b2': name a call by its index"),  # was "unexpected ValueError"
    (["show", "--mask", "t_good.pt:\uff11"], "t_good.pt:'\uff11': name a call by its index"),  # was call 1
    (["show", "window(\uff13)", "--len", "4"], "unexpected character '\uff13' at character 8"),  # was window(3)
    (["show", "causal", "--why", "\uff11,0", "--len", "4"], "--why"),
    (["serve", "nonpy.npz"], "holds a.txt, none of them an engine's batch metadata names"),  # (its one member named, never unpacked)
    (["inspect", "many.npz"], "holds several tensors ('m0', 'm1', 'm2', 'm3', 'm4', 'm5', 'm6', 'm7', ... (3,000 in all))"),
    (["pack", "many.npz"], "holds 'm0', 'm1', 'm2', 'm3', 'm4', 'm5', 'm6', 'm7', ... (3,000 in all), none of them a field"),
    (["shard", "causal", "--len", "8", "--trace", "protocol4.npy"], "'protocol4.npy' is not a trace file maskcli can read"),
    # hunt 5: a call over a batch of 0 rows (IndexError in every view), and a whole trace file read as a tensor file
    (["show", "--mask", "t_batch0.pt:2"], "t_batch0.pt:2: that call's mask has shape [0, 2, 4, 4], no cells"),
    (["diff", "t_batch0.pt:2", "causal"], "that call's mask has shape [0, 2, 4, 4], no cells"),
    (["inspect", "t_good.pt"], "FILE 't_good.pt' is a maskcli trace file (2 calls), not a tensor file: where a mask is read, "
                               "name one call of it, FILE:0"),  # was "entry 'format' of the dict is str"
    (["show", "--mask", "t_good.pt"], "is a maskcli trace file (2 calls), not a tensor file"),
    # hunt 7: a call's rank that is text or a list, a rank list that is a number (unexpected TypeError in show / shard)
    (["show", "--mask", "t_rankstr.pt:rank1:0"], "call 1's rank is '1'; it is a whole number from 0"),
    (["shard", "causal", "--trace", "t_ranklist.pt"], "call 1's rank is [1]; it is a whole number from 0"),
    (["shard", "causal", "--trace", "t_ranksint.pt"], "'ranks' is 5 with 2 of its 2 calls ranked"),
] + [([command, *spec], name) for name in TRACE_DAMAGE
     for command, spec in (("inspect", [f"{name}:0"]), ("show", ["--mask", f"{name}:1"]), ("diff", [f"{name}:0", "causal"]))]


@pytest.mark.parametrize("args, says", CRAFTED, ids=[" ".join(a)[:80] for a, _ in CRAFTED])
def test_crafted_files_are_one_line_exit_2_and_leave_nothing(tmp_path, monkeypatch, args, says):
    plant_crafted(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = set(tmp_path.rglob("*"))
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maskcli: error: "), result.stderr
    assert says in lines[0] and "maskcli bug" not in lines[0] and len(lines[0]) <= 1000, lines[0][:300]
    assert "Traceback" not in result.output and result.stdout == ""
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    assert set(tmp_path.rglob("*")) == before


NAMING_A_MODULE = [
    [command, *where]
    for command in ("show", "blocks", "attend", "verify")
    for where in (["evilmod:f"], ["evilmod.py:f"], ["--mask", "evilmod:f"], ["causal", "--tokens", "evilmod:f"])
] + [["chunk", "evilmod:f"], ["inspect", "evilmod:f"], ["inspect", "evilmod.py:f"], ["convert", "evilmod:f", "--to", "block", "--out", "o.pt"],
     ["diff", "evilmod:f", "evilmod.py:f"], ["show", "causal", "--ids", "evilmod:f"], ["show", "causal", "--lengths", "evilmod.py"],
     ["show", "causal", "--mask-mod-args", "evilmod:f"], ["kinds", "evilmod:f"]]


@pytest.mark.parametrize("args", NAMING_A_MODULE, ids=" ".join)
def test_no_command_imports_a_module_without_mask_mod(tmp_path, monkeypatch, args):
    plant(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, args)  # refused, or read as words (--tokens)
    assert result.exit_code in (0, 2) and "Traceback" not in result.output, (result.exit_code, result.output)
    assert not (tmp_path / "imported").exists() and "evilmod" not in sys.modules
# issue 18, item 9: command lines where maskcli differed from Hugging Face (or failed); each now runs and says
FIDELITY = [
    (["attend", "causal", "--len", "4", "--like", "hf-eager", "--dtype", "float64"], "weights = softmax(masked) in float32, cast to float64"),
    (["attend", "causal", "--ids", "0,0,5,6", "--like", "hf-eager", "--dtype", "float64", "--stages", "weights"],
     "query rows 0-1 see no key: the weights and outputs there are NaN, because finfo(float64).min is -inf in the float32 softmax"),
    (["attend", "causal", "--ids", "0,0,5,6", "--like", "hf-eager", "--dtype", "float32", "--stages", "weights"],
     "query rows 0-1 see no key: the fill min makes the weights there uniform"),
    (["show", "bidirectional", "--len", "3"], "full · shape (B=1, H=1, Lq=3, Lk=3)"),
    (["kinds"], "full keeps always (also: bidirectional)"),
]


@pytest.mark.parametrize("args, says", FIDELITY, ids=[" ".join(a)[:80] for a, _ in FIDELITY])
def test_the_fidelity_command_lines_run_and_say_what_happens(args, says):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert says in " ".join(result.stdout.split())


def hf_gemma3_sliding(ids, window):
    """and_masks(or_masks(causal, blockwise_overlay(ids)), sliding_window_overlay(window)), as a double loop."""
    return lambda q, kv: (kv <= q or ids[q] == ids[kv] >= 0) and kv > q - window


def hf_llama4_packed(position_ids, chunk_size):
    """create_chunked_causal_mask on packed position_ids: the chunked causal mask at the positions, same sequence only."""
    sequence = [sum(1 for j in range(1, i + 1) if position_ids[j] != position_ids[j - 1] + 1) for i in range(len(position_ids))]
    return lambda q, kv: (position_ids[kv] <= position_ids[q] and position_ids[kv] // chunk_size == position_ids[q] // chunk_size
                          and sequence[q] == sequence[kv])


FIDELITY_MASKS = [
    ("(causal | blocks(-1,0,0,0,-1,1,1)) & lookback(2)", 7, hf_gemma3_sliding([-1, 0, 0, 0, -1, 1, 1], 2)),
    ("document(0,0,0,1,1,1,1,1) & local(2)", 8, hf_llama4_packed([0, 1, 2, 0, 1, 2, 3, 4], 2)),
    ("document(sizes=[3,6]) & local(4)", 9, hf_llama4_packed([0, 1, 2, 0, 1, 2, 3, 4, 5], 4)),
    ("bidirectional", 4, lambda q, kv: True),
]


@pytest.mark.parametrize("expression, length, hf", FIDELITY_MASKS, ids=[e for e, _, _ in FIDELITY_MASKS])
def test_the_fidelity_masks_are_hugging_faces(expression, length, hf):
    result = runner.invoke(app, ["show", expression, "--len", str(length), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["mask"] == [[[[hf(q, kv) for kv in range(length)] for q in range(length)]]]


def test_the_table_is_large_and_covers_every_command():
    commands = {args[0] for args, _ in CASES}
    assert len(CASES) >= 80
    assert {"show", "chunk", "blocks", "diff", "attend", "verify", "inspect", "convert", "kinds"} <= commands


# --- slow corners: exact and quick where the math allows, else refused up front -----------------------------


def chain(n: int) -> str:
    return " & ".join(["window(3)"] * n)


MILLION = 1 << 20
FINISH = [  # the exact command lines of issue 18; the expected counts from closed forms written here
    (["show", chain(1_000), "--len", str(MILLION), "--summary"], f"visible cells: {3 * MILLION - 3:,} of {MILLION**2:,}"),
    (["show", chain(10_000), "--len", str(MILLION), "--summary"], f"visible cells: {3 * MILLION - 3:,} of {MILLION**2:,}"),
    # 50,000 document ids cycling through 7 values: query q sees the q // 7 + 1 keys of its id up to itself
    (["show", f"document({','.join(str(i % 7) for i in range(50_000))})", "--summary"],
     f"visible cells: {sum(q // 7 + 1 for q in range(50_000)):,} of {50_000**2:,} (7.14%) · exact, from running counts per label"),
]


@pytest.mark.parametrize("args, says", FINISH, ids=[" ".join(a)[:60] + f" ({len(' '.join(a)):,} chars)" for a, _ in FINISH])
def test_slow_corners_finish_exactly(args, says):
    result = maskcli(*args, timeout=300)  # a hang guard, not a timing: they take about a second here
    assert result.returncode == 0 and result.stderr == "", result.stderr[-500:]
    assert says in result.stdout, result.stdout[:500]


def test_a_billion_token_document_is_refused_before_anything_is_made():
    import resource

    def limit():  # 12 GiB: room for the 8 GB of labels it used to make before the guard, not for its 89 GiB of rows
        resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))

    result = maskcli("show", "document(sizes=[1000000000])", "--summary", preexec_fn=limit, timeout=300)
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    intervals = result.stderr.startswith(
        "maskcli: error: a mask of 1 x 1000000000 would need 89.4 GiB (96,000,000,000 bytes) for its key intervals"
    ) and result.stderr.rstrip().endswith("use fewer positions in its labels: maskcli keeps a few integers per query row")
    # on a machine with less than 8 GB free, the labels themselves are refused first: as early, and as clear
    labels = result.stderr.startswith("maskcli: error: labels 1 x 1000000000 would need 7.5 GiB (8,000,000,000 bytes)")
    assert intervals or labels, result.stderr


# --- a full disk, and other failures while writing ---------------------------------------------------


FULL = OSError(errno.ENOSPC, "No space left on device")
TORCH_FULL = RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file data/0: file write failed")


@pytest.mark.parametrize("error, said", [(FULL, "No space left on device"), (TORCH_FULL, "is the disk full?")], ids=["ENOSPC", "torch"])
@pytest.mark.parametrize("args", [
    ["show", "causal", "--save", "out.npy"],
    ["show", "causal", "--save", "out.NPY"],
    ["show", "causal", "--save", "out.pt"],
    ["show", "causal", "--png", "out.png"],
    ["blocks", "causal", "--save", "b.pt"],
    ["convert", "good.pt", "--out", "out.json", "--to", "additive"],
    ["diff", "causal", "window(2)", "--png", "d.svg"],
    ["attend", "causal", "--len", "3", "--png", "a.pdf"],
], ids=lambda args: " ".join(args))
def test_a_disk_that_fills_midway_is_one_line_and_leaves_no_file(tmp_path, monkeypatch, args, error, said):
    from maskcli import files

    real = files.atomic_write

    def filling(path, write):
        def half_then_full(temp):
            with open(temp, "wb") as handle:  # part of the file reaches the disk, then it is full
                handle.write(b"partial")
            raise error

        real(path, half_then_full)

    plant(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(files, "atomic_write", filling)
    before = set(tmp_path.rglob("*"))
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith("maskcli: error: ") and said in line, result.stderr
    assert set(tmp_path.rglob("*")) == before


@pytest.fixture
def unwritable(tmp_path):
    """A folder this process cannot write in: read-only by its mode, or for root (whom modes do not stop)
    a read-only tmpfs mounted there."""
    folder = tmp_path / "readonly"
    folder.mkdir()
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
        yield folder
        os.chmod(folder, 0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=16k", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("running as root, and no read-only tmpfs can be mounted here")
    yield folder
    subprocess.run(["umount", str(folder)], capture_output=True)


@pytest.mark.parametrize("args", [
    ["show", "causal", "--save", "readonly/out.npy"],
    ["show", "causal", "--png", "readonly/out.png"],
    ["blocks", "causal", "--save", "readonly/b.pt"],
    ["convert", "good.pt", "--out", "readonly/out.pt", "--to", "block"],
    ["diff", "causal", "window(2)", "--png", "readonly/d.png"],
    ["attend", "causal", "--len", "3", "--png", "readonly/a.png"],
    ["inspect", "good.pt", "--png", "readonly/i.png"],
], ids=lambda args: " ".join(args))
def test_an_unwritable_folder_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, unwritable, args):
    plant(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith("maskcli: error: ") and "readonly" in line, result.stderr
    assert list(unwritable.iterdir()) == []


def test_a_real_small_disk_keeps_every_write_whole_or_absent(tmp_path):
    """A 64 KiB tmpfs where the system lets us mount one (root); the simulated disk above covers the rest."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (disk / "fill").write_bytes(b"\0" * 40 * 1024)
        for args in (["show", "causal", "--len", "200", "--save", str(disk / "a.npy")],
                     ["show", "causal", "--len", "200", "--save", str(disk / "a.pt")],
                     ["show", "causal", "--len", "300", "--png", str(disk / "a.png")]):
            result = runner.invoke(app, args)
            assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        (disk / "more").write_bytes(b"\0" * 20 * 1024)  # a PDF fills the rest midway: matplotlib said 'Stream' has no 'pos'
        result = runner.invoke(app, ["show", "causal", "--len", "300", "--png", str(disk / "a.pdf")])
        assert result.exit_code == 2 and result.stderr.endswith("No space left on device\n"), result.stderr
        assert sorted(p.name for p in disk.iterdir()) == ["fill", "more"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)  # lazy: a busy disk still goes


# --- interruption and the environment, in a real process -----------------------------------------------


def maskcli(*args, env=None, preexec_fn=None, stdin=None, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "maskcli", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "MASKCLI_DEVICE": "cpu", **(env or {})}, preexec_fn=preexec_fn, stdin=stdin,
    )


def test_ctrl_c_exits_130_with_one_line(tmp_path):
    import time

    # a mask_mod that says it started, then waits: the interrupt lands while maskcli works
    (tmp_path / "slow.py").write_text(
        "import pathlib, time\n"
        "def slow(b, h, q, kv):\n    pathlib.Path('started').touch()\n    time.sleep(60)\n    return q >= kv\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "maskcli", "show", "--mask-mod", "slow.py:slow", "--len", "4", "--save", "out.npy"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # (a suite run in the background ignores it)
    )
    deadline = time.time() + 60
    while not (tmp_path / "started").exists() and time.time() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, (process.returncode, err)
    assert err.strip() == "maskcli: interrupted" and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slow.py", "started"]  # no out.npy, no temporary file


def test_a_kill_while_writing_leaves_no_file(tmp_path):
    import time

    process = subprocess.Popen([sys.executable, "-m", "maskcli", "show", "causal", "--len", "30000", "--save", "big.npy"],
                               cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not any(p.name.startswith(".big") for p in tmp_path.iterdir()) and time.time() < deadline and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)
    assert process.returncode in (143, 0)
    assert [p.name for p in tmp_path.iterdir()] in ([], ["big.npy"])  # whole, or nothing: never a temporary file


def test_an_ascii_terminal_gets_question_marks_not_a_traceback():
    result = maskcli("show", "window", "--len", "100000", "--window", "3", env={"PYTHONIOENCODING": "ascii", "COLUMNS": "60"})
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "?" in result.stdout


def test_a_closed_pipe_stops_quietly():
    process = subprocess.Popen(
        [sys.executable, "-m", "maskcli", "show", "causal", "--len", "2000", "--json"],  # 4M cells, the most --json prints
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "MASKCLI_DEVICE": "cpu"},
    )
    process.stdout.read(10)
    process.stdout.close()
    err = process.stderr.read().decode()
    process.wait(timeout=60)
    assert process.returncode in (0, 141) and err == "", (process.returncode, err)


def test_a_closed_pipe_is_not_read_as_diff_saying_the_masks_differ():
    process = subprocess.Popen(
        [sys.executable, "-m", "maskcli", "diff", "causal", "tril(0)", "--len", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "MASKCLI_DEVICE": "cpu", "COLUMNS": "4000"},
    )
    process.stdout.readline()
    process.stdout.close()
    err = process.stderr.read().decode()
    process.wait(timeout=60)
    assert process.returncode in (0, 141) and "Traceback" not in err, (process.returncode, err)


def test_an_address_space_limit_is_respected_before_allocating(tmp_path):
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))

    result = subprocess.run(
        [sys.executable, "-m", "maskcli", "show", "causal", "--len", "100000", "--save", str(tmp_path / "big.pt")],
        capture_output=True, text=True, preexec_fn=limit, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "would need" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_file_too_large_to_work_on_is_refused_up_front_naming_it(tmp_path):
    import resource

    # 120M cells (a sparse file): loads in 120 MB, but inspecting or converting it needs about 1.3 GB more
    np.lib.format.open_memmap(tmp_path / "huge.npy", mode="w+", dtype=bool, shape=(10_000, 12_000)).flush()

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (int(1.5 * 2**30), int(1.5 * 2**30)))

    for args, doing in ((["inspect", "huge.npy"], "to inspect"), (["convert", "huge.npy", "--to", "int", "--out", "out.npy"], "to convert")):
        result = subprocess.run(
            [sys.executable, "-m", "maskcli", *args], cwd=tmp_path, capture_output=True, text=True, preexec_fn=limit, timeout=120,
        )
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        # (refused from its cells where it is read, or from its .npy header before it is read: tensorfile/npy.py)
        assert "'huge.npy' (" in result.stderr and " would need " in result.stderr and doing in result.stderr
        assert "--len" not in result.stderr and "slice" in result.stderr
    assert [path.name for path in tmp_path.iterdir()] == ["huge.npy"]


def test_a_zip_bomb_npz_is_refused_from_its_headers_before_unpacking(tmp_path):
    import resource
    import zipfile

    # numpy.lib.format's own header writer; the member holds 1 kB where its header declares 65536 x 65536 bools
    # (4.3 GB): np.load allocates what the header says (numpy/lib/_format_impl.py read_array: numpy.ndarray(count))
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|b1", "fortran_order": False, "shape": (65536, 65536)})
    with zipfile.ZipFile(tmp_path / "bomb.npz", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("mask.npy", header.getvalue() + bytes(1000))
    np.savez_compressed(tmp_path / "fine.npz", mask=np.tril(np.ones((3, 3), dtype=bool)))

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (int(1.5 * 2**30), int(1.5 * 2**30)))

    def show(name):
        return subprocess.run([sys.executable, "-m", "maskcli", "show", "--mask", name, "--json"], cwd=tmp_path,
                              capture_output=True, text=True, preexec_fn=limit, timeout=120)

    refused = show("bomb.npz")
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("maskcli: error: --mask 'bomb.npz' (")
    assert "bytes on disk, its arrays as their headers declare them) would need 16.0 GiB (17,179,869,184 bytes) to read as a mask" in refused.stderr  # (4 bytes a cell)
    fine = show("fine.npz")
    assert fine.returncode == 0 and json.loads(fine.stdout)["mask"] == [[np.tril(np.ones((3, 3), dtype=int)).tolist()]]


REFUSED_BEFORE_TORCH = [
    ["attend", "causal", "--len", str(2**40)],
    ["attend", "causal", "--len", "4000", "--dropout", "0.5", "--batch", "4000"],  # the stages with dropout, device auto
    ["verify", "causal", "--len", "30000", "--batch", "400"],
    ["blocks", "causal", "--len", "100", "--block", "1", "--heads", str(2**40), "--save", "b.pt"],
    ["show", "causal", "--len", str(2**40), "--save", "big.pt"],
    ["attend", "causal", "--dtype", "int8"],
    ["attend", "causal", "--device", "tpu"],
    ["verify", "causal", "--device", "cuda:x"],
    ["attend", "causal", "--png", "a.bmp"],
    ["attend", "causal", "--png", "nodir/a.png"],
    ["attend", "causal", "--q", "q.npy"],
]


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_impossible_sizes_are_refused_before_torch_is_imported(tmp_path, device):
    # importing torch alone takes longer than the second a refusal may take. auto is known to compute on the CPU
    # without torch only where no GPU driver is installed (inputs._computes_on_cpu); elsewhere torch must say
    from maskcli.commands.inputs import _computes_on_cpu

    if not _computes_on_cpu(device):
        pytest.skip("a GPU driver is installed: --device auto is decided by torch")
    script = (
        "import sys, json\n"
        "from maskcli.commands import app\n"
        "def run(args):\n"
        "    try:\n"
        "        return app(args, standalone_mode=False)\n"
        "    except SystemExit as stop:\n"
        "        return stop.code\n"
        "codes = [run(args) for args in json.loads(sys.argv[1])]\n"
        "print(json.dumps([codes, 'torch' in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(REFUSED_BEFORE_TORCH)], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env={**os.environ, "MASKCLI_DEVICE": device},
    )
    codes, imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert codes == [2] * len(REFUSED_BEFORE_TORCH), done.stderr
    assert done.stderr.count("maskcli: error: ") == len(REFUSED_BEFORE_TORCH), done.stderr
    assert not imported
    assert list(tmp_path.iterdir()) == []


def test_impossible_sizes_are_refused_without_building_anything(tmp_path):
    # in a process of its own, so its peak memory is its own (VmHWM, the peak of its own address space: ru_maxrss keeps
    # the peak of the pytest process it was forked from across exec, 5.6 GiB in CI): a refusal that built even a
    # sliver of 2**40 cells, or looped over them, would pass the memory bound or the timeout (no wall-clock bound:
    # CI machines are shared)
    if not os.path.exists("/proc/self/status"):
        pytest.skip("reads its peak memory from /proc (Linux)")
    script = (
        "import json, sys\n"
        "from typer.testing import CliRunner\n"
        "from maskcli.commands import app\n"
        "runner = CliRunner()\n"
        "out = [(r.exit_code, r.stderr) for r in (runner.invoke(app, a) for a in json.loads(sys.argv[1]))]\n"
        "status = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
        "print(json.dumps([out, int(status)]))\n"
    )
    cases = [["attend", "causal", "--len", str(2**40)], ["show", "padding", "--lengths", str(10**12), "--json"],
             ["verify", "causal", "--heads", str(10**12)]]
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    results, peak_kib = json.loads(done.stdout.strip().splitlines()[-1])
    for args, (code, stderr) in zip(cases, results):
        assert code == 2 and "would need" in stderr, (args, stderr)
    assert peak_kib < 1024 * 1024, peak_kib  # under 1 GiB: torch and matplotlib themselves take a few hundred MiB
    assert list(tmp_path.iterdir()) == []


def test_a_closed_stdout_is_one_line_not_lost_output(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "maskcli", "show", "causal", "--len", "4"], stderr=subprocess.PIPE, text=True, timeout=60,
        preexec_fn=lambda: os.close(1), cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr == "maskcli: error: stdout is closed, so nothing maskcli prints can be seen: send it to a file or /dev/null instead\n"


def test_diff_names_a_bad_file_by_its_side(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.save("good.npy", np.tril(np.ones((4, 4), dtype=bool)))
    (tmp_path / "trunc.npy").write_bytes((tmp_path / "good.npy").read_bytes()[:90])
    result = runner.invoke(app, ["diff", "good.npy", "trunc.npy"])
    assert result.exit_code == 2 and result.stderr.startswith("maskcli: error: B 'trunc.npy': not a readable numpy file")


# --- exit statuses that say what happened ----------------------------------------------------------------


@pytest.mark.parametrize("args", [["show", "causal", "--len", "4"], ["blocks", "causal", "--len", "300"],
                                  ["diff", "causal", "window(2)", "--len", "4"], ["kinds"], ["--help"], ["show", "--help"]])
def test_a_zero_or_tiny_width_draws_at_the_least_width(args):
    for columns in ("0", "1"):
        result = runner.invoke(app, args, env={"COLUMNS": columns})
        assert result.exit_code in (0, 1) and result.stderr == "", result.output  # diff: 1, they differ
        lines = result.stdout.splitlines()
        assert len(lines) >= 3 and max(map(len, lines)) <= 40 and max(map(len, lines)) >= 30, result.stdout


@pytest.mark.parametrize("unbuffered", ["1", ""])
@pytest.mark.parametrize("args", [["show", "causal", "--len", "600", "--json"], ["show", "causal", "--len", "600", "--summary", "--json", "--grid", "600,600"],
                                  ["blocks", "causal", "--len", "8000", "--block", "16", "--json"]])
def test_json_cut_short_by_its_reader_stops_with_141_as_a_table_does(args, unbuffered):
    process = subprocess.Popen([sys.executable, "-m", "maskcli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "MASKCLI_DEVICE": "cpu", "PYTHONUNBUFFERED": unbuffered})
    process.stdout.read(10)  # | head -c 10: the output is far larger than the pipe holds
    process.stdout.close()
    err = process.stderr.read().decode()
    process.wait(timeout=60)
    assert process.returncode == 141 and err == "", (process.returncode, err)
    table = subprocess.Popen([sys.executable, "-m", "maskcli", "show", "causal", "--len", "600"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "4000", "PYTHONUNBUFFERED": unbuffered})
    table.stdout.read(10)
    table.stdout.close()
    assert table.wait(timeout=60) in (0, 141) and table.stderr.read() == b""


def test_help_cut_short_by_its_reader_stops_with_141():
    process = subprocess.Popen([sys.executable, "-m", "maskcli", "attend", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "COLUMNS": "60"})
    process.stdout.readline()
    process.stdout.close()
    assert process.wait(timeout=60) in (0, 141) and process.stderr.read() == b""  # rich's own handler exited 1


def test_an_error_that_cannot_be_written_still_exits_2(tmp_path):
    with open("/dev/full", "w") as full:
        for args in (["show", "causal", "--len", "-1"], ["show", "causal", "--len", "3", "--png", "nodir/x.png"]):
            result = subprocess.run([sys.executable, "-m", "maskcli", *args], stdout=subprocess.DEVNULL, stderr=full, cwd=tmp_path, timeout=60)
            assert result.returncode == 2
    assert list(tmp_path.iterdir()) == []


def test_a_full_stdout_after_a_file_is_written_leaves_one_line_and_no_file(tmp_path):
    """`show --html x.html > /dev/full` wrote x.html, said so, then failed on the table: two lines and a file left by a
    command that exited 2. The "wrote" lines wait for the command to end well; where it fails, the files it made go."""
    (tmp_path / "kept.html").write_text("the user's own")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # (this checkout's maskcli)
    with open("/dev/full", "w") as full:
        for name in ("x.html", "kept.html"):
            result = subprocess.run([sys.executable, "-m", "maskcli", "show", "causal", "--len", "6", "--html", name],
                                    stdout=full, stderr=subprocess.PIPE, text=True, cwd=tmp_path, timeout=120, env=env)
            assert (result.returncode, result.stderr) == (2, "maskcli: error: No space left on device while writing the output: "
                                                  "send it (stdout) to a disk with room, or to /dev/null\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["kept.html"]  # (one that was there is replaced, not lost)
    shown = runner.invoke(app, ["show", "causal", "--len", "6", "--html", str(tmp_path / "y.html")])
    assert shown.exit_code == 0 and shown.stderr == f"wrote {tmp_path / 'y.html'}\n" and "<html" in (tmp_path / "y.html").read_text().lower()


def test_a_kill_while_a_mask_mod_runs_exits_143_not_blaming_it(tmp_path):
    import time

    (tmp_path / "slow.py").write_text(
        "import pathlib, time\n"
        "def slow(b, h, q, kv):\n    pathlib.Path('started').touch()\n    time.sleep(60)\n    return q >= kv\n"
    )
    process = subprocess.Popen([sys.executable, "-m", "maskcli", "show", "--mask-mod", "slow.py:slow", "--len", "4", "--save", "out.npy"],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (tmp_path / "started").exists() and time.time() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 143 and err == "", (process.returncode, err)  # it said "raised SystemExit: 143", exit 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slow.py", "started"]


def test_a_block_far_longer_than_the_mask_is_one_padded_block_not_out_of_memory():
    result = runner.invoke(app, ["blocks", "causal", "--len", "8", "--block", str(10**12), "--json"])
    assert result.exit_code == 0, result.output  # it advised "a larger --block"
    found = json.loads(result.stdout)
    assert (found["kv_num_blocks"], found["full_kv_num_blocks"]) == ([[[1]]], [[[0]]])  # as create_block_mask pads it


def test_a_refusal_comes_before_any_announcement_of_a_long_write(tmp_path, monkeypatch):
    from maskcli import memory

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(memory, "available_memory", lambda device=None: 2**30)  # room for less than the 2 GB written
    result = runner.invoke(app, ["blocks", "causal", "--len", "252800", "--block", "16", "--save", "b.pt"])
    assert result.exit_code == 2 and result.stderr.startswith("maskcli: error: ") and "warning" not in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_dtype_that_does_not_apply_is_a_warning_in_convert_as_in_show(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plant(tmp_path)
    result = runner.invoke(app, ["convert", "good.pt", "--to", "keep", "--dtype", "bfloat16", "--out", "x.npy"])
    assert result.exit_code == 0, result.output
    assert "maskcli: warning: --dtype bfloat16 is for --to additive or min; --to keep is written as bool" in result.stderr
    assert np.load("x.npy").dtype == bool
    shown = runner.invoke(app, ["show", "causal", "--len", "3", "--dtype", "bfloat16", "--save", "y.npy"])
    assert shown.exit_code == 0 and "--dtype bfloat16 is ignored" in shown.stderr


@pytest.mark.parametrize("args, where, says", [
    (["pack", "--cu-seqlens", "0,2,4"], "maskcli.pack.fields.read", "save fewer batch rows or tokens (a part of the batch)"),
    (["serve", "v.pt"], "maskcli.serve.engines.read", "save fewer requests (a part of the batch)"),
], ids=["pack", "serve"])
def test_running_out_of_memory_advises_what_the_command_takes_not_len(monkeypatch, tmp_path, args, where, says):
    """pack and serve have no --len: "use a smaller --len" was advice no option could follow."""
    import importlib

    module, _, name = where.rpartition(".")

    def exhausted(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(importlib.import_module(module), name, exhausted)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and result.stderr.startswith("maskcli: error: ran out of memory: ") and says in result.stderr, result.output
    assert "--len" not in result.stderr


@pytest.mark.parametrize("columns", ["\u00b2", "abc", "-5", str(10**23)])
@pytest.mark.parametrize("args", [["kinds"], ["--help"], ["show", "causal", "--len", "100000"]], ids=" ".join)
def test_columns_that_is_no_number_or_past_5000_is_read_as_a_width_that_draws(args, columns):
    """rich reads COLUMNS with str.isdigit and int(): COLUMNS=² was a traceback, 10^23 an OverflowError (kinds, help)
    or a density map 10^23 characters wide (a hang)."""
    result = runner.invoke(app, args, env={"COLUMNS": columns, "LINES": columns})
    assert result.exit_code == 0 and result.stderr == "", result.output[-500:]
    widths = [len(line) for line in result.stdout.splitlines()]
    assert widths and max(widths) <= 5000
