"""A FlexAttention decode over a preallocated cache whose mask_mod never bounds the key by the slots written
(written here, for checks/zerokv.py: another kernel).

Bug: the cache holds 16 slots per row, zeros until written; each step's block mask is made over the whole cache from
a mask_mod that keeps every key (`kv_idx >= 0`), its author taking the cache to hold only what was written, so each
step's queries attend the unwritten slots after them.
Fix: the mask_mod keeps a key only at or before the query's own slot (`kv_idx <= offset + q_idx`).
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

FIXED = "--fixed" in sys.argv
SLOTS, HEADS, DIM = 16, 2, 8


def attend(q, k_cache, v_cache, offset):
    def written(b, h, q_idx, kv_idx):
        return kv_idx <= offset + q_idx if FIXED else kv_idx >= 0

    block_mask = create_block_mask(written, B=None, H=None, Q_LEN=q.shape[2], KV_LEN=SLOTS, device="cpu")
    return flex_attention(q, k_cache, v_cache, block_mask=block_mask)


if __name__ == "__main__":
    torch.manual_seed(0)
    proj = torch.nn.Linear(DIM * HEADS, 3 * DIM * HEADS)
    k_cache, v_cache = torch.zeros(2, HEADS, SLOTS, DIM), torch.zeros(2, HEADS, SLOTS, DIM)
    x, offset = torch.randn(2, 5, DIM * HEADS), 0
    with torch.no_grad():
        for _ in range(3):
            n = x.shape[1]
            q, k, v = (t.view(2, n, HEADS, DIM).transpose(1, 2) for t in proj(x).chunk(3, dim=-1))
            k_cache[:, :, offset:offset + n], v_cache[:, :, offset:offset + n] = k, v
            y = attend(q, k_cache, v_cache, offset)
            offset += n
            x = y.transpose(1, 2).reshape(2, n, -1)[:, -1:]
    print("y", [round(t, 4) for t in y[0, 0, 0, :3].tolist()])
