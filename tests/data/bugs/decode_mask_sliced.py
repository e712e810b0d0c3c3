"""thu-nics/C2C#19: generate() passed the full attention mask (cached tokens plus the new one) to forward(), but forward()
sliced it as base_attention_mask[:, :end], end counting only this call's tokens: while decoding, a (batch, 1) mask
was left while the cache held the whole prompt, so the left padding was no longer masked after the first generated
token. The fix offsets the slice by the cached positions (mask.shape[1] - seqlen)."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, mask, cache):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1), (k, v)


class Model(nn.Module):
    def __init__(self, vocab=16, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = Attention(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask, past=None):
        seqlen = input_ids.shape[1]
        end = seqlen
        if FIXED:
            start = attention_mask.shape[1] - seqlen
            base = attention_mask[:, start:start + end]
        else:
            base = attention_mask[:, :end]
        total = attention_mask.shape[1]
        causal = torch.ones(seqlen, total, dtype=torch.bool).tril(total - seqlen)
        keys = attention_mask.bool() if FIXED else F.pad(base, (total - base.shape[1], 0), value=1).bool()
        mask = causal[None, None] & keys[:, None, None, :]
        out, cache = self.attn(self.embed(input_ids), mask, past)
        return self.head(out), cache


torch.manual_seed(0)
model = Model().eval()
ids = torch.tensor([[0, 0, 3, 4], [5, 6, 7, 8]])  # left padded with 0
attention_mask = (ids != 0).long()
past = None
with torch.no_grad():
    for _ in range(3):
        logits, past = model(ids if past is None else ids[:, -1:], attention_mask, past)
        ids = torch.cat([ids, logits[:, -1:].argmax(-1) + 1], dim=1)
        attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
