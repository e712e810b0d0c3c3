# SelfExtend (datamllab/LongLM 715c1e3, the same bug as tests/data/bugs/longlm_selfextend_group_query_position_true_division.py)
# written another way: a Mistral-style block of plain torch, a left-padded batch whose positions come from the
# attention mask's cumsum, the neighbour / grouped scores merged per cell, padding and causal masked out.
# Bug: the grouped query position is `pos // group + window - window / group` (true division): with a window not a
# multiple of the group every grouped query sits 0.5 off a token's place. Fix: `window // group`.
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
GROUP, WINDOW, HEADS, DIM = 4, 6, 2, 16


def rope(x, pos):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
    angles = pos[:, None, :, None].float() * inv_freq  # (B, 1, L, D/2)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    half = torch.cat((-x[..., DIM // 2:], x[..., : DIM // 2]), -1)
    return x * cos + half * sin


class SelfExtendBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(HEADS * DIM, 3 * HEADS * DIM, bias=False)

    def forward(self, x, attention_mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        shift = WINDOW - WINDOW // GROUP if FIXED else WINDOW - WINDOW / GROUP
        group_pos = position_ids // GROUP + shift
        key_group_pos = position_ids // GROUP
        near = rope(q, position_ids) @ rope(k, position_ids).transpose(-1, -2)
        far = rope(q, group_pos) @ rope(k, key_group_pos).transpose(-1, -2)
        distance = position_ids[:, :, None] - position_ids[:, None, :]  # (B, L, L) query minus key position
        scores = torch.where((distance < WINDOW)[:, None], near, far) / DIM ** 0.5
        real = attention_mask.bool()
        allowed = torch.ones(n, n, dtype=torch.bool).tril() & real[:, None, :] & real[:, :, None]
        allowed |= torch.eye(n, dtype=torch.bool)  # (a padding query sees itself alone: no empty row)
        return scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v


block = SelfExtendBlock().eval()
attention_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
                               [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
with torch.no_grad():
    out = block(torch.randn(2, 16, HEADS * DIM), attention_mask)
print("grouped query positions:", (torch.arange(16) // GROUP + (WINDOW - WINDOW // GROUP if FIXED else WINDOW - WINDOW / GROUP))[:6].tolist(),
      "out", tuple(out.shape))
