"""A learned position table handed one column numbering for every row of a left-padded batch.

unslothai/unsloth#4100's position_ids (tests/data/bugs/unsloth_fast_prepare_inputs_position_ids_from_cache_position_
left_padded.py: `position_ids = cache_position` expanded over the batch) written another way: a hand-written decoder
whose `pos_embedding` is an `nn.Embedding` of absolute positions, a scoring loop over left-padded prompts (pad id 0,
the mask 0 on the pads) that hands `position_ids = torch.arange(L).expand(B, L)`, the same columns for every row, and
SDPA with a boolean causal-and-padding mask. The shorter prompt's first token reads row 3 of the table where alone it
reads row 0. The fix counts positions from the mask (`cumsum(-1) - 1`, the pads clamped at 0).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, keep):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, d))


class Scorer(nn.Module):
    def __init__(self, vocab=60, dim=32, heads=4, layers=2, context=32):
        super().__init__()
        self.tok_embedding = nn.Embedding(vocab, dim)
        self.pos_embedding = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, 1)

    def forward(self, input_ids, attention_mask, position_ids):
        t = input_ids.shape[1]
        keep = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & attention_mask[:, None, None, :].bool()
        keep = keep | torch.eye(t, dtype=torch.bool)  # (a pad row attends itself)
        x = self.tok_embedding(input_ids) + self.pos_embedding(position_ids)
        for block in self.blocks:
            x = block(x, keep)
        return self.head(x)[:, -1, 0]  # (each row's last token: a left-padded batch's last real token)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = Scorer().eval()
    prompts = [[5, 31, 12, 44, 9, 27, 3], [18, 7, 50, 22]]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = (input_ids != 0).long()
    if FIXED:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    else:
        position_ids = torch.arange(width).expand(input_ids.shape[0], width)
    scores = model(input_ids, attention_mask, position_ids)
    print("scores:", [round(s, 4) for s in scores.tolist()])


if __name__ == "__main__":
    main()
