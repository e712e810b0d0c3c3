"""tests/cuda_draws.py (the CUDA trace test's harness): on the CPU every patched draw gives what torch gives unpatched,
seed for seed, so a trace run through the harness is the trace of the program as written. Run in a process of its own:
the patches are the process's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DRAWS = """import importlib.util, sys, torch
import torch.nn.functional as F

def draws():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.empty(3, 4)
    out = [torch.rand(3), torch.randn(2, 3, generator=g), torch.randint(0, 9, (5,)), torch.randperm(6),
           torch.rand_like(x), torch.randn_like(x), torch.randint_like(x, 0, 4), torch.bernoulli(torch.full((4,), 0.5)),
           torch.multinomial(torch.ones(5), 3), torch.normal(torch.zeros(3), 1.0), torch.normal(0.0, 1.0, (2,)),
           x.clone().normal_(), x.clone().uniform_(-1, 1), x.clone().bernoulli_(0.3), torch.full((4,), 0.5).bernoulli(),
           F.dropout(torch.ones(8), 0.5, True), torch.nn.init.xavier_uniform_(torch.empty(3, 3))]
    return [t.tolist() for t in out]

before = draws()
spec = importlib.util.spec_from_file_location("cuda_draws", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.drawn_on_the_cpu()
after = draws()
print("same" if before == after else f"differ: {[i for i, (a, b) in enumerate(zip(before, after)) if a != b]}")
"""


def test_each_draw_on_the_cpu_is_torch_s_own_seed_for_seed(tmp_path):
    script = tmp_path / "draws.py"
    script.write_text(DRAWS)
    run = subprocess.run([sys.executable, str(script), str(Path(__file__).parent / "cuda_draws.py")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "same", run.stdout
