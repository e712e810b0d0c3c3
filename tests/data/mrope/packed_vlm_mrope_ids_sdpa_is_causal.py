# Written another way (EasyR1#494's kind, helper fix-cd): a hand-written padding-free VLM decoder takes Qwen2-VL style
# multimodal rope ids (3, 1, nnz) for two samples packed into one row, the second opening with a 2x2 image (its t/h/w
# grid ids), and runs F.scaled_dot_product_attention(is_causal=True) over the whole row: the second sample sees the
# first. Fixed: each sample's tokens from where all three rope rows restart at 0, a block-diagonal causal bool mask.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.proj(out.transpose(1, 2).reshape(b, n, d))


class PackedVLDecoder(nn.Module):
    def __init__(self, vocab=64, dim=32, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rope_embed = nn.Linear(3, dim, bias=False)  # (stands in for the multimodal rotary embedding)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, input_ids, position_ids):
        x = self.embed(input_ids) + self.rope_embed(position_ids.permute(1, 2, 0).float())
        mask = None
        if FIXED:
            starts = (position_ids == 0).all(dim=0)  # (1, nnz): a sample's first token
            sample = starts.long().cumsum(-1)
            n = input_ids.shape[1]
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            mask = ((sample[:, :, None] == sample[:, None, :]) & causal)[:, None]
        for block in self.blocks:
            x = block(x, mask)
        return x


model = PackedVLDecoder().eval()
text_a = [5, 6, 7, 8, 9]
image_b, text_b = [60, 60, 60, 60], [11, 12, 13]
ids = torch.tensor([text_a + image_b + text_b])
t = [0, 1, 2, 3, 4] + [0, 0, 0, 0] + [2, 3, 4]
h = [0, 1, 2, 3, 4] + [0, 0, 1, 1] + [2, 3, 4]
w = [0, 1, 2, 3, 4] + [0, 1, 0, 1] + [2, 3, 4]
position_ids = torch.tensor([t, h, w])[:, None, :]  # (3, 1, nnz)
with torch.no_grad():
    out = model(ids, position_ids)
print(f"fixed={FIXED} packed output {tuple(out.shape)}")
