"""maskcli.trace.toplevel: the globals a script's running top-level statement reads, followed back through the
script's top-level assignments (a batch's lengths held while the script runs each sample alone are not read)."""

from __future__ import annotations

from maskcli.trace.toplevel import read_by

SCRIPT = """\
import torch
lengths = [6, 4]
real = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
pad = ~real
def run(x, mask):
    seq_lens = mask.sum(1)
    return x
with torch.no_grad():
    out = run(torch.randn(2, 6), pad)
    dec_lens = out.shape
    for b in range(2):
        n = int(real[b].sum())
        alone = run(torch.randn(1, n), pad[b:b + 1])
if lengths:
    again = run(out, pad)
"""


def _line(text: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if line.strip().startswith(text))


def test_the_running_statement_reads_what_it_was_built_from_and_not_what_a_later_line_holds(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    code = compile(SCRIPT, str(path), "exec")
    batched = read_by(code, _line("out = run"))
    assert {"pad", "real", "lengths", "torch", "run"} <= batched and "dec_lens" not in batched
    alone = read_by(code, _line("alone = run"))
    assert {"n", "b", "torch"} <= alone  # (what the statement reads, followed back)
    assert not {"pad", "real", "lengths", "dec_lens", "out"} & alone  # (a sample's part of pad and real: not the batch's)
    assert read_by(code, _line("dec_lens =")) == {"out", "run", "torch", "pad", "real", "lengths"}
    assert "seq_lens" not in read_by(code, _line("seq_lens ="))  # (a function's names are its own frame's)
    assert {"out", "pad", "lengths"} <= read_by(code, _line("again = run"))
    assert read_by(code, 999) == frozenset()


def test_a_script_whose_source_cannot_be_read_reads_nothing(tmp_path):
    code = compile("lengths = [1]\nx = lengths\n", str(tmp_path / "gone.py"), "exec")
    assert read_by(code, 2) == frozenset()


def test_a_view_of_every_sample_is_the_batch_and_an_index_of_some_is_not(tmp_path):
    """`lengths[:, None]`, `lengths[None]` and `lengths[..., None]` view all of the batch's lengths (the batch's
    statement); `lengths[b]`, `lengths[0]` and `lengths[b:b + 1]` take some samples (another batch's)."""
    script = ("import torch\nlengths = torch.tensor([6, 4])\n"
              "a = f(lengths[:, None])\nb = f(lengths[None])\nc = f(lengths[..., None])\n"
              "d = f(lengths[i])\ne = f(lengths[0])\ng = f(lengths[i:i + 1])\nh = f(lengths[1:, None])\n")
    path = tmp_path / "views.py"
    path.write_text(script)
    code = compile(script, str(path), "exec")
    assert ["lengths" in read_by(code, line) for line in range(3, 10)] == [True, True, True, False, False, False, False]
