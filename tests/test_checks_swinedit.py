"""checks/swinedit.py (and trace/assigned.py): a shifted-window block whose forward edited its own shift_size list in
place, a later map larger than its window run with no shift and no mask; windows counted by a loop here."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, traced
from maskcli.trace import assigned

SWINEDIT = Path(__file__).parent / "data" / "swinedit"


def windows(length: int, window: int) -> int:
    """Windows along an axis of the padded map, by a loop over its cells."""
    return len({cell // window for cell in range(length)})


def test_torchvision_shift_size_zeroed_in_place(tmp_path):
    """pytorch/vision#6266: `shift_size[i] = 0` on the module's own list after a 3x3 input; the 8x8 map that follows
    (2 windows per axis of 4) runs with no shift and no mask; the small call itself (one window) is not flagged."""
    hits = check_bug(tmp_path, "torchvision_swin_shifted_window_attention_shift_size_mutated_inplace", "swin-shift-edited")
    assert len({h["message"] for h in hits}) == 1
    message = hits[0]["message"]
    assert "shift_size to [2, 2]" in message and "in place to [0, 0]" in message, message
    assert f"axis 0 (8 long, {windows(8, 4)} windows), axis 1 (8 long, {windows(8, 4)} windows)" in message


def test_a_window_size_helper_zeroing_the_list_it_was_handed(tmp_path):
    """Written another way: Video Swin's get_window_size without its list() copy, a 4x4 map then an 8x12 one (2 x 3
    windows), a bool mask into SDPA only when shifted; the fix is quiet."""
    [hit] = check_bug(tmp_path, "window_size_helper_zeroes_block_shift", "swin-shift-edited", SWINEDIT)
    assert f"axis 0 (8 long, {windows(8, 4)} windows), axis 1 (12 long, {windows(12, 4)} windows)" in hit["message"]


def test_an_assignment_is_no_edit():
    """Swin's own `self.shift_size = 0` after `= window // 2` for a small map is the program's statement: nothing;
    the list edited in place after it is; once the trace ends the patch forgets its modules and records nothing."""
    class Block(torch.nn.Module):
        def __init__(self, small):
            super().__init__()
            self.window_size, self.shift_size = 4, [2, 2]
            if small:
                self.shift_size = [0, 0]

    undo = assigned.patch(None)
    try:
        quiet, edited = Block(True), Block(False)
        assert assigned.edited(quiet) is None and assigned.edited(edited) is None
        edited.shift_size[0] = 0
        found = assigned.edited(edited)
        assert found["assigned"] == (2, 2) and found["now"] == (0, 2) and found["window"] == (4, 4)
    finally:
        undo()
    assert assigned.edited(edited) is None
    writes, later = assigned.WRITES[0], Block(False)  # (the wrapper stays on the class from then on, recording nothing
    later.shift_size[0], later.cache = 0, torch.zeros(1)  # while no trace runs: every assignment passed straight through)
    assert assigned.edited(later) is None and assigned.WRITES[0] == writes and later.cache.shape == (1,)


def test_swins_own_blocks_are_quiet(tmp_path):
    """microsoft/Swin-Transformer's blocks and Video Swin's: no swin-shift-edited, no relative-index-collides."""
    folder = Path(__file__).parent / "data" / "quiet_blind"
    for name in ("swin_shifted_window_attention", "video_swin_3d_shifted_window_compute_mask_minus100_bias"):
        status, found, report = traced(tmp_path, name, False, folder)
        assert status == 0 and not {"swin-shift-edited", "relative-index-collides"} & {f["code"] for f in found}, report
