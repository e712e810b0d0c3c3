"""ml-explore/mlx-lm#1906: MiniCPM3 built its mask as create_attention_mask(h, cache) with the list of caches, which
has no make_mask, so the prompt pass fell through to a plain "causal" mask and the batch's left padding was
attended as ordinary keys. The fix hands the layer's own cache, whose mask has the left padding. Written here in
torch: the model builds a causal mask, and the fix ands in the attention_mask it was given."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def create_attention_mask(length, attention_mask=None):
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :]
    return mask


class Layer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, h, mask):
        q, k, v = self.qkv(h).view(h.shape[0], h.shape[1], 2, -1).transpose(1, 2).chunk(3, dim=-1)
        return h + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(h.shape)


class MiniCPM3Model(nn.Module):
    def __init__(self, vocab=16, dim=12, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim) for _ in range(layers))

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids)
        mask = create_attention_mask(input_ids.shape[1], attention_mask if FIXED else None)
        for layer in self.layers:
            h = layer(h, mask)
        return h


torch.manual_seed(0)
ids = torch.tensor([[0, 0, 3, 4, 5], [6, 7, 8, 9, 10]])
with torch.no_grad():
    MiniCPM3Model().eval()(ids, attention_mask=(ids != 0).long())
