"""Files for hostile-input tests: good masks, damaged ones, hostile pickles, and things that are not files."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import warnings

import numpy as np
import torch

LONG = "a" * 300


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch exploited",))


def safetensors(path, offsets, shape=(2, 2), dtype="F32", name="mask"):
    raw = np.tril(np.ones((2, 2), dtype="<f4")).tobytes()
    header = json.dumps({name: {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw)


def plant(folder):
    """The files the cases read: good ones, damaged ones, and things that are not files."""
    torch.save(torch.tril(torch.ones(4, 4, dtype=torch.bool)), folder / "good.pt")
    np.save(folder / "good.npy", np.tril(np.ones((4, 4), dtype=bool)))
    torch.save(torch.empty(4, 4, device="meta"), folder / "meta.pt")
    torch.save(torch.empty(1, 4, 8, device="meta"), folder / "meta3.pt")
    torch.save(torch.randn(1, 4, 8), folder / "q.pt")
    torch.save({"mask": Exploit()}, folder / "evil.pt")
    (folder / "pickle.pt").write_bytes(pickle.dumps(Exploit()))
    safetensors(folder / "negative.safetensors", (-16, 0))
    safetensors(folder / "beyond.safetensors", (0, 10**6))
    safetensors(folder / "short.safetensors", (0, 8))
    safetensors(folder / "negshape.safetensors", (0, 16), shape=(-2, -2))
    safetensors(folder / "strshape.safetensors", (0, 16), shape=("2", 2))
    (folder / "header.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    (folder / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (folder / "bad.json").write_text("[[1, 0], [1")
    (folder / "empty.npy").write_bytes(b"")
    (folder / "labels.txt").write_text("0 0 1 x\n")
    (folder / "mod.py").write_text(
        "def raises(b, h, q, kv):\n    raise ValueError('boom')\n\n"
        "def floats(b, h, q, kv):\n    return (q >= kv).float()\n\n"
        "def shape(b, h, q, kv):\n    import torch\n    return torch.ones(3, dtype=torch.bool)\n\n"
        "def exits(b, h, q, kv):\n    import sys\n    sys.exit(0)\n\n"
        "def factory(w):\n    return lambda b, h, q, kv: (q - kv < w) & (q >= kv)\n\n"
        "class Halt(BaseException):\n    pass\n\n"
        "def halts(b, h, q, kv):\n    raise Halt('stop here')\n"
    )
    (folder / "empty_labels.npy").write_bytes(b"")
    (folder / "system.pt").write_bytes(pickle.dumps(os.system))  # a pickled function as a labels file
    np.save(folder / "scalar.npy", np.array(True))  # 0-d: a single number, not a mask of one cell
    np.save(folder / "u64.npy", np.array([0, 0, 2**64 - 1, 2**64 - 1], dtype=np.uint64))  # would wrap to -1
    (folder / "big.txt").write_text("0 1000000000000000000000000000000\n")
    (folder / "syntax.py").write_text("def broken(:\n")
    # imported, it leaves a file behind: no command may import it unless --mask-mod names it
    (folder / "evilmod.py").write_text("open('imported', 'w').close()\ndef f(b, h, q, kv):\n    return kv <= q\n")
    (folder / "dir.pt").mkdir()
    # a program trace would run and a package -m would import: each leaves a file, so a refusal must come first
    (folder / "prog.py").write_text("open('ran', 'w').close()\n")
    (folder / "evilpkg").mkdir()
    (folder / "evilpkg" / "__init__.py").write_text("open('imported', 'w').close()\n")
    (folder / "evilpkg" / "mod.py").write_text("open('ran', 'w').close()\n")
    os.symlink("loop.pt", folder / "loop.pt")
    if hasattr(os, "mkfifo"):
        os.mkfifo(folder / "fifo.pt")


BIG = 2**63 - 1


def _vllm(**over) -> dict:
    """Two requests (3 cached + 2 new, 0 + 5 new) in pages of 4, as vLLM's CommonAttentionMetadata holds them."""
    fields = {"query_start_loc": [0, 2, 7], "seq_lens": [5, 5], "num_computed_tokens_cpu": [3, 0],
              "block_table_tensor": [[1, 2], [3, 4]], "slot_mapping": [7, 8, 12, 13, 14, 15, 16], "block_size": 4}
    return {**fields, **over}


def _sglang(**over) -> dict:
    fields = {"seq_lens": [5, 5], "extend_prefix_lens": [3, 0], "extend_seq_lens": [2, 5],
              "req_to_token": [[4, 5, 6, 7, 8], [12, 13, 14, 15, 16]], "out_cache_loc": [7, 8, 12, 13, 14, 15, 16], "page_size": 4}
    return {**fields, **over}


def _trtllm_tree(**over) -> dict:
    """A context request (3 cached + 2 new) and a generation request verifying a 3-node tree (root, two children)."""
    fields = {"seq_lens": [2, 3], "num_cached_tokens_per_seq": [3, 4], "num_contexts": 1,
              "spec_decoding_packed_mask": np.array([[[1], [3], [5]]], np.int32), "spec_decoding_position_offsets": [[0, 1, 1]]}
    return {**fields, **over}


def _save(path, fields: dict) -> None:
    torch.save({k: v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v)) for k, v in fields.items()}, path)


def _trace(path, mutate=None) -> None:
    """A trace file as maskcli trace --save writes it (one causal call kept as intervals, one MHA call with key
    padding kept as bits), changed by `mutate`."""
    from maskcli.tracefile import FORMAT, from_dense

    keep = np.tril(np.ones((1, 1, 4, 4), bool))
    data = {"format": FORMAT, "masks": {"m": from_dense(keep, (1, 1, 4, 4)),
                                        "b": {"form": "bits", "shape": [2, 1, 4, 4], "planes": [1, 1], "bits": np.packbits(keep, axis=-1)}},
            "calls": [{"index": 0, "where": "layer", "api": "sdpa", "step": 0, "shape": [1, 1, 4, 4], "mask": "m", "details": {}},
                      {"index": 1, "where": "mha", "api": "mha", "step": 0, "shape": [2, 1, 4, 4], "mask": "b",
                       "details": {"key_padding": {"lengths": "4,3"}}}]}
    if mutate is not None:
        mutate(data)

    def plain(value):
        if isinstance(value, np.ndarray):
            return torch.from_numpy(np.array(value))
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return [plain(v) for v in value] if isinstance(value, list) else value

    torch.save(plain(data), path)


TRACE_DAMAGE = {  # file name -> what is changed in a good trace file
    "t_nocalls.pt": lambda d: d.pop("calls"),
    "t_masklist.pt": lambda d: d.update(masks=[1, 2]),
    "t_callstr.pt": lambda d: d.update(calls=["abc"]),
    "t_nomask.pt": lambda d: d["calls"][0].pop("mask"),
    "t_shape.pt": lambda d: d["calls"][0].update(shape=[1, 1, 5, 4]),
    "t_where.pt": lambda d: d["calls"][0].update(where=5),
    "t_frac.pt": lambda d: d["masks"]["m"].update(starts=d["masks"]["m"]["starts"].astype(float) + 0.5),
    "t_negative.pt": lambda d: d["masks"]["m"].update(starts=d["masks"]["m"]["starts"] - 3),
    "t_past.pt": lambda d: d["masks"]["m"].update(ends=d["masks"]["m"]["ends"] + 9),
    "t_planes.pt": lambda d: d["masks"]["m"].update(planes=[2, 1]),
    "t_bits.pt": lambda d: d["masks"]["b"].update(bits=np.zeros((1, 1, 4, 9), np.uint8)),
    "t_form.pt": lambda d: d["masks"]["m"].update(form="other"),
    "t_padding.pt": lambda d: d["calls"][1].update(details={"key_padding": {"lengths": "x"}}),
}


def _ranked(data, rank0=0, rank1=1, ranks=None) -> None:
    """The trace of a job of two ranks (trace under torchrun --save), one call each, with the ranks given."""
    data["calls"][0]["rank"], data["calls"][1]["rank"] = rank0, rank1
    data["ranks"] = ranks if ranks is not None else [{"rank": 0, "exit_status": 0, "calls": [0, 1]},
                                                     {"rank": 1, "exit_status": 0, "calls": [1, 2]}]


RANK_DAMAGE = {  # hunt 7: a call's rank text or a list (sorted with the others: "unexpected TypeError"), no rank list
    "t_rankstr.pt": lambda d: _ranked(d, rank1="1"),
    "t_ranklist.pt": lambda d: _ranked(d, rank1=[1]),
    "t_ranksint.pt": lambda d: _ranked(d, ranks=5),
}


def _empty_batch(data) -> None:
    """A call over a batch of 0 rows, as trace --save writes one (SDPA accepts it): was an IndexError in show."""
    data["masks"]["e"] = {"form": "intervals", "shape": [0, 2, 4, 4], "planes": [0, 1],
                          "starts": np.zeros((0, 4, 1), np.int64), "ends": np.zeros((0, 4, 1), np.int64)}
    data["calls"].append({"index": 2, "where": "empty", "api": "sdpa", "step": 0, "shape": [0, 2, 4, 4], "mask": "e", "details": {}})


def plant_crafted(folder) -> None:
    """Crafted files for every reader: serve batches at the edges of int64, damaged trace files, tensors torch
    cannot hand to numpy, kernel formats with fractional or no indices, and numbers past what int() reads."""
    import zipfile

    header = b"{'descr': bogus, 'fortran_order': False, 'shape': (2, 2), }"  # a name numpy's parser cannot read
    (folder / "badheader.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\x00" * 4)
    torch.save(torch.tril(torch.ones(4, 4, dtype=torch.bool)), folder / "whole.pt")
    (folder / "cut.pt").write_bytes((folder / "whole.pt").read_bytes()[:300])  # a .pt cut short: no central directory
    torch.save(torch.tril(torch.ones(3, 4, 4, dtype=torch.bool)), folder / "good3.pt")
    _save(folder / "flexneg.pt", {"kv_num_blocks": torch.full((1, 1, 1), -4, dtype=torch.int32), "kv_indices": torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                                  "full_kv_num_blocks": torch.zeros(1, 1, 1, dtype=torch.int32), "full_kv_indices": torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                                  "block_size": (128, 128), "seq_lengths": (8, 8)})
    _save(folder / "ps0.pt", _sglang(page_size=0))
    _save(folder / "psneg.pt", _sglang(page_size=-4))
    _save(folder / "wsg.pt", _sglang(sliding_window_size=BIG))
    _save(folder / "wfa.pt", {"cu_seqlens_q": [0, 2], "seqused_k": [5], "causal": 1, "window_size": [BIG, 0]})
    _save(folder / "wfa2.pt", {"cu_seqlens_q": [0, 2], "seqused_k": [5], "causal": 1, "window_size": [BIG, BIG]})
    _save(folder / "wfi.pt", {"qo_indptr": [0, 2], "kv_indptr": [0, 5], "causal": 1, "window_left": BIG})
    _save(folder / "draft.pt", {"seq_lens": [4], "req_to_token": [[1, 2, 3, 4, 5, 6, 7]], "custom_mask": np.ones(7, bool),
                                "draft_token_num": -1})
    _save(folder / "trt_neg.pt", {"seq_lens": [-3, 2], "num_cached_tokens_per_seq": [5, 0]})
    # num_contexts past the requests, without a tree mask: was ignored, exit 0
    _save(folder / "trt_ctx.pt", {"seq_lens": [2, 3], "num_cached_tokens_per_seq": [3, 4], "num_contexts": -1})
    _save(folder / "trt_empty.pt", _trtllm_tree(spec_decoding_packed_mask=np.zeros((1, 3, 0), np.int32)))
    _save(folder / "pages62.pt", _vllm(block_table_tensor=[[1, 2], [2**62, 4]]))
    _save(folder / "cascade.pt", _vllm(common_prefix_len=-16))
    _save(folder / "slotwrap.pt", _vllm(slot_mapping=[2**62 + 1, 8, 12, 13, 14, 15, 16]))
    _save(folder / "nan.pt", _vllm(seq_lens=torch.tensor([float("nan"), 5.0])))
    _save(folder / "sparse.pt", _vllm(seq_lens=torch.tensor([5.0, 5.0]).to_sparse()))
    (folder / "digits.json").write_text('{"cu_seqlens_q": [0, ' + "9" * 5000 + '], "seqused_k": [5]}')
    (folder / "dump").mkdir()
    (folder / "dump" / "metadata.jsonl").write_text('["plan", 1]\n')
    (folder / "dump2").mkdir()
    (folder / "dump2" / "metadata.jsonl").write_text('"BatchPrefillWithPagedKVCacheWrapper.plan"\n')
    for name, mutate in {**TRACE_DAMAGE, **RANK_DAMAGE}.items():
        _trace(folder / name, mutate)
    _trace(folder / "t_good.pt")
    _trace(folder / "t_batch0.pt", _empty_batch)
    t = torch.tril(torch.ones(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are in prototype stage"
        torch.save(torch.nested.nested_tensor([t, t[:2]]), folder / "nested.pt")
        # one cell stored, 10^12 cells meant: to_dense tried 4 TB and quoted the allocator's message (hard15)
        torch.save(torch.sparse_coo_tensor([[0], [0]], [1.0], (10**6, 10**6)), folder / "sparse_huge.pt")
    torch.save({"cu_seqlens_q": torch.tensor([0.0, 2.5, 4.0]), "cu_seqlens_k": torch.tensor([0, 2, 4])}, folder / "fa_float.pt")
    torch.save({"cu_seqlens_q": torch.tensor([0.0, float("nan"), 4.0]), "cu_seqlens_k": torch.tensor([0, 2, 4])}, folder / "fa_nan.pt")
    torch.save({"startend_row_indices": torch.tensor([[[[1.5], [2.0], [3.0], [4.0]]]])}, folder / "fm_float.pt")
    # whole numbers in float tensors: flash_attn refuses them ("cu_seqlens_q must have dtype int32"), maskcli read them
    torch.save({"cu_seqlens_q": torch.tensor([0, 2, 4]), "cu_seqlens_k": torch.tensor([0.0, 2.0, 4.0])}, folder / "fa_whole.pt")
    torch.save({"startend_row_indices": torch.tensor([[[[4.0], [4.0], [4.0], [4.0]]]]), "causal": torch.tensor(1.0)}, folder / "fm_whole.pt")
    torch.save({"startend_row_indices": torch.zeros((1, 1, 0, 1), dtype=torch.int32), "causal": torch.tensor(1)}, folder / "fm_empty.pt")
    torch.save({"q_ranges": torch.zeros((0, 2), dtype=torch.int32), "k_ranges": torch.zeros((0, 2), dtype=torch.int32),
                "attn_type_map": torch.zeros(0, dtype=torch.int32)}, folder / "magi_empty.pt")
    (folder / "digits_mask.json").write_text("[[" + "9" * 5000 + "]]")
    with zipfile.ZipFile(folder / "nonpy.npz", "w") as archive:  # np.load hands a member that is no .npy over as bytes
        archive.writestr("a.txt", "hi")
    with zipfile.ZipFile(folder / "many.npz", "w") as archive:  # 3,000 names listed made a line of 26,000 characters
        one = io.BytesIO()
        np.save(one, np.zeros(1, bool))
        for index in range(3000):
            archive.writestr(f"m{index}.npy", one.getvalue())
    (folder / "protocol4.npy").write_bytes(b"\x80\x04K\x01.")  # torch.load warned of its pickle protocol: a second line
    # an .npz member whose .npy header declares 16 MiB where the archive says the member holds 1 kB
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|b1", "fortran_order": False, "shape": (4096, 4096)})
    with zipfile.ZipFile(folder / "liar.npz", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("mask.npy", header.getvalue() + bytes(1000))
