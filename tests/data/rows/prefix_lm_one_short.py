"""A hand-written PaliGemma-style prefix LM: the image and prompt (prefix_len tokens) see each other both ways, the
suffix is causal. The prefix mask is built one token short (`<` where the prefix's last token needs `<=`)."""
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class PrefixLM(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.emb = nn.Embedding(40, d)
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, input_ids, prefix_len):
        n = input_ids.shape[1]
        i = torch.arange(n)
        last = prefix_len if FIXED else prefix_len - 1
        mask = (i[None, :] <= i[:, None]) | (i[None, :] < last) & (i[:, None] < last)
        q, k, v = self.qkv(self.emb(input_ids))[:, None].chunk(3, -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


torch.manual_seed(0)
PrefixLM()(torch.arange(3, 11)[None], prefix_len=5)
