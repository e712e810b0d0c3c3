"""A hand-written causal LM whose prompt pass hands SDPA the left-padding mask alone: with an attn_mask given SDPA
applies no is_causal, so every real prompt token sees the later ones; greedy decoding follows over the cache
(--fixed: the padding mask and-ed with the causal one)."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x, keep, past=None):
        q, k, v = (t.view(*x.shape[:2], 4, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).flatten(2), (k, v)


class TinyForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 30)

    def forward(self, input_ids, attention_mask, past_key_values=None):
        n, total = input_ids.shape[1], attention_mask.shape[1]
        keep = attention_mask.bool()[:, None, None, :].expand(-1, 1, n, -1)
        if FIXED or past_key_values is not None:
            keep = keep & torch.ones(n, total, dtype=torch.bool).tril(total - n)
        keep = keep | ~keep.any(-1, keepdim=True)  # padding query rows see every key: no NaN
        x, cache = self.embed(input_ids), []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, keep, None if past_key_values is None else past_key_values[i])
            cache.append(kv)
        return self.head(x), cache


def main():
    torch.manual_seed(0)
    model = TinyForCausalLM().eval()
    ids = torch.tensor([[1, 2, 3, 4, 5], [0, 0, 6, 7, 8]])
    mask = (ids != 0).long()
    with torch.no_grad():
        logits, cache = model(ids, mask)
        for _ in range(2):
            nxt = logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            logits, cache = model(nxt, mask, cache)
    print("next", logits[:, -1].argmax(-1).tolist())


if __name__ == "__main__":
    main()
