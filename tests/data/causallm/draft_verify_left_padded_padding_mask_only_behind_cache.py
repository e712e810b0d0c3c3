# Written another way than ipex-llm#11767 (a compressed cache's lookup step handed no mask): a hand-written
# LlamaForCausalLM of a speculative-decoding loop, over a left-padded batch of two prompts, builds its mask as
# "causal & padding" only where there is no cache yet ("a decode step needs no causal mask": written for one token).
# The verify step feeds the 3 draft tokens at once behind the cache, with the padding mask alone, so each draft token
# sees the drafts after it. Fix: lay the causal part bottom-right over the cache's keys at every step.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, mask, past):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, t, d)), (k, v)


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab=40, dim=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Attention(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask, past_key_values=None):
        t, s = input_ids.shape[1], attention_mask.shape[1]
        keep = attention_mask[:, None, None, :].bool()  # (B, 1, 1, S): the real tokens, cached ones included
        if past_key_values is None or FIXED:
            keep = keep & torch.ones(t, s, dtype=torch.bool).tril(s - t)  # causal, the queries the last t keys
        x, cache = self.embed(input_ids), []
        for i, layer in enumerate(self.layers):
            h, kv = layer(x, keep, None if past_key_values is None else past_key_values[i])
            x = x + h
            cache.append(kv)
        return self.head(x), cache


model = LlamaForCausalLM().eval()
prompts = [[5, 9, 14, 22, 7], [11, 4, 26]]
width = max(map(len, prompts))
input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left-padded
attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
draft = torch.tensor([[3, 8, 12], [6, 2, 19]])  # the draft model's 3 tokens per row
with torch.no_grad():
    _, cache = model(input_ids, attention_mask)
    verify_mask = torch.cat([attention_mask, torch.ones_like(draft)], dim=1)
    logits, _ = model(draft, verify_mask, cache)  # one verify pass over every draft token
print(f"{'fixed' if FIXED else 'buggy'}: verified drafts, argmax {logits.argmax(-1).tolist()}")
