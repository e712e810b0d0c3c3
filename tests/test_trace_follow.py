"""trace/follow.py: the trace's mode on the torch-function stack beside the program's default device.

`torch.set_default_device` keeps a DeviceContext (a TorchFunctionMode) at the bottom of the stack. The trace pushes
its mode while a tensor it follows is alive; pushed from a patched Tensor method that the DeviceContext's own
handler called, it landed beneath the DeviceContext, could not be popped as the trace ended, and the program's next
`set_default_device` (or a second trace in the same process: a notebook, CUDA's tests) raised torch's
"Found nested DeviceContext on the mode stack".
"""

from __future__ import annotations

import torch
from torch.overrides import _get_current_function_mode_stack
from typer.testing import CliRunner

from maskcli.commands import app

runner = CliRunner()

PROGRAM = """import torch
torch.set_default_device("cpu")
q = torch.randn(1, 2, 4, 8)
keep = torch.ones(4, 4, dtype=torch.bool).tril()
weights = (q @ q.transpose(-1, -2)).masked_fill(~keep, float("-inf")).softmax(-1)
torch.set_default_device("cpu")  # (again, a tensor followed all the while: torch's DeviceContext swapped)
with torch.device("cpu"):
    again = (q @ q.transpose(-1, -2)).masked_fill(~keep, float("-inf")).softmax(-1)
stack = [type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()]
print("device context at the bottom:", stack[0] == "DeviceContext", "once:", stack.count("DeviceContext") == 1)
"""


def test_a_program_that_sets_its_default_device_is_traced_again_and_again_in_one_process(tmp_path):
    program = tmp_path / "default_device.py"
    program.write_text(PROGRAM)
    before = _get_current_function_mode_stack()
    try:
        for _ in range(3):
            result = runner.invoke(app, ["trace", str(program)])
            assert result.exit_code == 0, result.output
            assert "device context at the bottom: True once: True" in result.output
            assert "2 attention calls" in result.output
            # the trace's mode is off the stack as it ends: only the program's DeviceContext stays, as under python
            assert [type(m).__name__ for m in _get_current_function_mode_stack()] == ["DeviceContext"]
    finally:
        torch.set_default_device(None)
    assert _get_current_function_mode_stack() == before
