# Written another way (the bug of bigscience-workshop/Megatron-DeepSpeed 538c30b): a left-padded causal batch's keep
# mask (True = may attend) built as (batch, q, k) and handed to SDPA beside (batch, heads, q, k) scores. SDPA
# broadcasts it as (1, batch, q, k): with as many rows as heads, head h of every row uses row h's padding and
# triangle. The fix gives the mask its head axis, mask[:, None].
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD = 0


class SelfAttention(nn.Module):
    def __init__(self, dim=24, heads=3):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class TinyLM(nn.Module):
    def __init__(self, vocab=32, dim=24, heads=3, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.pos = nn.Embedding(16, dim)
        self.blocks = nn.ModuleList(SelfAttention(dim, heads) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask):
        n = input_ids.shape[1]
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        x = self.embed(input_ids) + self.pos(positions)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        mask = causal[None] & attention_mask.bool()[:, None, :]  # (batch, q, k)
        mask = mask | torch.eye(n, dtype=torch.bool)[None]  # a padded query sees itself: no NaN row
        if FIXED:
            mask = mask[:, None]  # (batch, 1, q, k)
        for block in self.blocks:
            x = x + block(x, mask)
        return self.head(x)


lengths = [9, 5, 7]
input_ids = torch.full((3, 9), PAD)
attention_mask = torch.zeros(3, 9, dtype=torch.long)
for row, length in enumerate(lengths):
    input_ids[row, 9 - length:] = torch.randint(1, 32, (length,))
    attention_mask[row, 9 - length:] = 1

model = TinyLM().eval()
with torch.no_grad():
    logits = model(input_ids, attention_mask)
    diff = 0.0
    for row, length in enumerate(lengths):
        alone = model(input_ids[row:row + 1, 9 - length:], attention_mask[row:row + 1, 9 - length:])
        diff = max(diff, (logits[row, 9 - length:] - alone[0]).abs().max().item())
print(f"max |batched logits - each row alone|: {diff:.6f}")
