"""Starting a job of several ranks under torchrun for the tests: maskcli from this checkout, a free port, one thread."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCHED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE")
PROGRAMS = ROOT / "tests" / "data" / "ranks"


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def torchrun(ranks: int, args: list[str], cwd: Path, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node RANKS -m maskcli ARGS` in `cwd` (the same as --no-python maskcli where it is installed)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHED} | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} | (env or {})
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", free_port(),
               "-m", "maskcli", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
