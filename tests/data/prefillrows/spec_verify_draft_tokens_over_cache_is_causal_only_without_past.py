"""A speculative-decoding verify pass: several draft tokens over a KV cache, with no causal mask among them.

The same slip as intel/ipex-llm PR #9968 (Qwen over the fp8 KV cache built its causal mask only when key_size ==
kv_seq_len), written another way: SDPA's `is_causal` flag set only while there is no cache (`is_causal=past is
None`), a batch of two prompts, and the target model's verify pass of 4 draft tokens in one forward over the cached
prompt, then decode steps. The draft tokens see each other's future. The fix hands the verify pass a boolean mask
aligned to the bottom right of the cache (`tril(diagonal=past_len)`).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))

    def forward(self, x, past=None):
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        past_len = 0 if past is None else past[0].shape[2]
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        if FIXED and past is not None and t > 1:
            mask = torch.ones(t, past_len + t, dtype=torch.bool).tril(diagonal=past_len)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=past is None)
        return y.transpose(1, 2).reshape(b, t, d), (k, v)


attn = Attention().eval()
prompt, drafts = 6, 4
x = torch.randn(2, prompt + drafts + 2, 32)
with torch.no_grad():
    _, cache = attn(x[:, :prompt])
    verified, cache = attn(x[:, prompt:prompt + drafts], cache)  # the target model scores every draft at once
    for t in range(prompt + drafts, prompt + drafts + 2):
        _, cache = attn(x[:, t:t + 1], cache)
    _, one = attn(x[:, :prompt])
    steps = []
    for t in range(prompt, prompt + drafts):
        y, one = attn(x[:, t:t + 1], one)
        steps.append(y)
print(f"max |verify pass - draft tokens one by one| = {(verified - torch.cat(steps, 1)).abs().max():.6f}")
