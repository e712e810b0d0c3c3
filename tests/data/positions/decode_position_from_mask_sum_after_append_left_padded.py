# The draft-decode position bug of sglang#25015 (positions advanced before the forward that writes their keys) written
# as a hand-rolled batched generate loop: a left-padded batch, a KV cache grown by torch.cat, and each step's
# position_ids read off the attention_mask. Before the fix the loop appended the new token's 1 to the attention_mask
# and then took `attention_mask.sum(-1)` as its position, one past the key it writes; the fix takes `sum - 1`.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(2)
VOCAB, DIM, HEADS = 30, 24, 3
HEAD_DIM = DIM // HEADS


def rope(x, pos):  # x (B, H, T, D), pos (B, T)
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    ang = pos.float()[:, None, :, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    half = HEAD_DIM // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, position_ids, attention_mask, cache=None):
        b, t = input_ids.shape
        x = self.wte(input_ids)
        q, k, v = self.c_attn(x).view(b, t, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        q, k = rope(q, position_ids), rope(k, position_ids)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        total = k.shape[2]
        keep = torch.ones(t, total, dtype=torch.bool).tril(total - t)[None, None] & attention_mask[:, None, None, :].bool()
        bias = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.head(self.c_proj(out.transpose(1, 2).reshape(b, t, DIM)) + x), (k, v)


model = TinyLM().eval()
input_ids = torch.tensor([[3, 4, 5, 6, 7], [1, 1, 1, 8, 9]])  # pad id 1, row 1 left-padded
attention_mask = (input_ids != 1).long()
with torch.no_grad():
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    logits, cache = model(input_ids, position_ids, attention_mask)
    next_tokens = logits[:, -1].argmax(-1, keepdim=True)
    for step in range(3):
        attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], dim=-1)
        if FIXED:
            position_ids = attention_mask.sum(-1, keepdim=True) - 1
        else:
            position_ids = attention_mask.sum(-1, keepdim=True)
        logits, cache = model(next_tokens, position_ids, attention_mask, cache)
        next_tokens = logits[:, -1].argmax(-1, keepdim=True)
        print("step", step, "positions", position_ids.flatten().tolist())
