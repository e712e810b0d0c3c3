# The same bug as FuxiCTR#30 (heads split by `.view(batch * heads, -1, head_dim)` of a (batch, tokens, heads*dim)
# projection, so each head's positions are slices cut across tokens), written as another project writes it: a small
# text classifier over right-padded token ids, its sizes in a config dict, q/k/v from one fused Linear, each folded
# (B·H, L, D) by a view and handed to F.scaled_dot_product_attention with the key padding repeated per head. Each
# plane of the fold holds L / H tokens cut into head slices, and the padding mask hides slots that are no padded
# tokens. The fix views (B, L, H, D), transposes, and folds the copy.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

config = {"vocab_size": 40, "d_model": 24, "n_heads": 4, "n_layers": 2, "pad_token_id": 0, "n_classes": 3}


class FoldedSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h, self.d = cfg["n_heads"], cfg["d_model"] // cfg["n_heads"]
        self.qkv = nn.Linear(cfg["d_model"], 3 * cfg["d_model"])
        self.proj = nn.Linear(cfg["d_model"], cfg["d_model"])

    def forward(self, x, keep):
        B, L, E = x.shape
        q, k, v = self.qkv(x).split(E, dim=-1)
        if FIXED:
            q, k, v = (t.reshape(B, L, self.h, self.d).transpose(1, 2).reshape(B * self.h, L, self.d) for t in (q, k, v))
        else:
            q, k, v = (t.contiguous().view(B * self.h, -1, self.d) for t in (q, k, v))
        mask = keep.repeat_interleave(self.h, dim=0)[:, None, :]  # (B·H, 1, L): True = a real token
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if FIXED:
            y = y.view(B, self.h, L, self.d).transpose(1, 2)
        return x + self.proj(y.reshape(B, L, E))


class Classifier(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg["vocab_size"], cfg["d_model"], padding_idx=cfg["pad_token_id"])
        self.blocks = nn.ModuleList(FoldedSelfAttention(cfg) for _ in range(cfg["n_layers"]))
        self.head = nn.Linear(cfg["d_model"], cfg["n_classes"])

    def forward(self, input_ids):
        keep = input_ids != self.cfg["pad_token_id"]
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, keep)
        pooled = (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
        return self.head(pooled)


ids = torch.tensor([[5, 9, 13, 2, 7, 11, 0, 0, 0],
                    [3, 8, 21, 17, 4, 6, 30, 12, 19],
                    [14, 22, 0, 0, 0, 0, 0, 0, 0]])
model = Classifier(config)
with torch.no_grad():
    print("fixed" if FIXED else "buggy", model(ids).argmax(-1).tolist())
