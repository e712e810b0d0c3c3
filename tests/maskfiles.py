"""One mask saved as each file type maskcli reads without torch, each in another convention, and maskcli commands
run in a fresh Python that says after each one whether torch has been imported."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import torch

LENGTH = 8
EXPRESSION = "causal & window(3)"


def reference() -> np.ndarray:
    """causal & window(3) over 8 positions, by a double loop: query q sees keys q-2..q."""
    return np.array([[q - 3 < k <= q for k in range(LENGTH)] for q in range(LENGTH)])


def write_safetensors(path, name: str, code: str, raw: bytes, shape) -> None:
    """The format by hand: an 8-byte little-endian header length, a JSON header, the raw little-endian bytes."""
    header = json.dumps({name: {"dtype": code, "shape": list(shape), "data_offsets": [0, len(raw)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw)


def tensors() -> dict[str, tuple[str, torch.Tensor]]:
    """{label: (file name, tensor)}: the reference in the convention each file holds it in, built by torch."""
    keep = torch.from_numpy(reference())
    return {
        "npy": ("keep.npy", keep[None, None]),
        "npz": ("ones.npz", keep.long()),
        "safetensors bf16": ("min_bf16.safetensors", torch.where(keep, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)),
        "safetensors f16": ("additive_f16.safetensors", torch.where(keep, 0.0, float("-inf")).half()),
        "json": ("block.json", ~keep),
    }


def write(folder) -> dict[str, str]:
    """The reference saved as each file type (`tensors`), {label: file name}; bfloat16 bytes come from torch."""
    files = tensors()
    (npy, keep), (npz, ones) = files["npy"], files["npz"]
    np.save(folder / npy, keep.numpy())
    np.savez(folder / npz, mask=ones.numpy())
    for label, code in (("safetensors bf16", "BF16"), ("safetensors f16", "F16")):
        name, tensor = files[label]
        write_safetensors(folder / name, "attention_mask", code, tensor.view(torch.int16).numpy().astype("<i2").tobytes(), tensor.shape)
    name, block = files["json"]
    (folder / name).write_text(json.dumps(block.tolist()))
    return {label: name for label, (name, _) in files.items()}


SCRIPT = """
import json, sys
from maskcli.commands import app
for args in json.loads(sys.argv[1]):
    try:
        code = app(args, standalone_mode=False) or 0
    except SystemExit as stop:
        code = stop.code
    print("RAN", json.dumps([args, code, "torch" in sys.modules]), flush=True)
"""


def torch_after_each(commands: list[list[str]], folder) -> list[tuple[list[str], int, bool]]:
    """(args, exit status, whether torch was imported by then) for each command, run in order in one fresh Python."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(commands)], cwd=folder, capture_output=True,
                          text=True, timeout=300)
    ran = [tuple(json.loads(line[4:])) for line in done.stdout.splitlines() if line.startswith("RAN [")]
    assert len(ran) == len(commands), done.stderr[-2000:]
    return ran
