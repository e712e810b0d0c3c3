"""Files for hostile-input tests: good masks, damaged ones, hostile pickles, and things that are not files."""

from __future__ import annotations

import json
import os
import pickle
import struct

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
    os.symlink("loop.pt", folder / "loop.pt")
    if hasattr(os, "mkfifo"):
        os.mkfifo(folder / "fifo.pt")
