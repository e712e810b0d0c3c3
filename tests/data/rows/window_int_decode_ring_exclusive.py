"""A decode loop over a ring buffer of 8 slots, one query per step through an eager softmax: `attend_step` holds a
plain int `window_size = 5` and the step's `start_pos`, and writes the window's bound exclusive (`start_pos - pos <
window_size - 1`), so once the window is full the query sees 4 keys, not 5 (--fixed: `< window_size`). The slots are
not positions (the buffer wraps), so only how many keys the query sees says it."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
SLOTS = 8


def attend_step(q, k_ring, v_ring, slot_pos, start_pos, window_size):
    """q: (1, heads, 1, d); rings: (1, heads, SLOTS, d); slot_pos: the position written in each slot (-1: never)."""
    back = start_pos - slot_pos
    reach = window_size if FIXED else window_size - 1
    keep = (slot_pos >= 0) & (back >= 0) & (back < reach)
    scores = (q @ k_ring.transpose(-1, -2)) / q.shape[-1] ** 0.5  # (1, heads, 1, SLOTS)
    scores = scores.masked_fill(~keep[None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v_ring


def main():
    torch.manual_seed(0)
    heads, d = 2, 8
    proj = nn.Linear(d * heads, 3 * d * heads).eval()
    k_ring, v_ring = torch.zeros(1, heads, SLOTS, d), torch.zeros(1, heads, SLOTS, d)
    slot_pos = torch.full((SLOTS,), -1)
    outs = []
    with torch.no_grad():
        for start_pos in range(11):
            x = torch.randn(1, d * heads)
            q, k, v = (y.view(1, heads, 1, d) for y in proj(x).chunk(3, -1))
            slot = start_pos % SLOTS
            k_ring[:, :, slot], v_ring[:, :, slot], slot_pos[slot] = k[:, :, 0], v[:, :, 0], start_pos
            outs.append(attend_step(q, k_ring, v_ring, slot_pos, start_pos, window_size=5))
    print("last step norm %.4f" % outs[-1].norm().item())


if __name__ == "__main__":
    main()
