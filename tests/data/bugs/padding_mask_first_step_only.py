"""OpenNMT/OpenNMT-py#2532: with left padding, LLM inference applied the padding mask at the first decoding step only;
later steps ran with a causal mask over the cache, so the batch's pads were attended and batched outputs degraded.
The fix applies the attention mask at all decoding steps."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
dim = 8
src = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
pad_mask = src.eq(0)  # True = pad, OpenNMT's polarity
embed = torch.nn.Embedding(16, dim)


def attend(q, k, v, mask):  # the decoder's self-attention, at every step
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)



with torch.no_grad():
    keys = values = embed(src)[:, None]
    length = src.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    attend(keys, keys, values, causal & ~pad_mask[:, None, None, :])
    for step in range(2):
        new = embed(torch.tensor([[3], [4]]))[:, None]
        keys = values = torch.cat([keys, new], dim=2)
        pad_mask = torch.cat([pad_mask, torch.zeros(2, 1, dtype=torch.bool)], dim=1)
        step_mask = ~pad_mask[:, None, None, :] if FIXED else None
        attend(new, keys, values, step_mask)
