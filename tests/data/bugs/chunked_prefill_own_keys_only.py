"""kekzl/imp#114 (and #117): imp's chunked prefill took the query, key and value views of the current chunk only
(executor_attention.cu), so each chunk after the first computed causal attention over [chunk_len, chunk_len] and never
read the earlier chunks' keys from the cache: a query at offset > 0 could not attend to positions [0, offset). Decode
read the whole cache, which hid it for full-attention models. The fix prefills the prompt in one chunk. Reduced to
torch: a model that writes its KV cache in prefill but attends over the chunk's own keys."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Attention(nn.Module):
    def __init__(self, dim=16, heads=2, max_len=32):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.k_cache = torch.zeros(1, heads, max_len, dim // heads)
        self.v_cache = torch.zeros(1, heads, max_len, dim // heads)

    def forward(self, x, input_pos):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        self.k_cache[:, :, input_pos], self.v_cache[:, :, input_pos] = k, v
        if n > 1:  # prefill: the chunk's own views
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        end = int(input_pos[-1]) + 1  # decode: every key written so far
        return F.scaled_dot_product_attention(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end])


class Model(nn.Module):
    def __init__(self, vocab=32, dim=16, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Attention(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, input_pos):
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h, input_pos).transpose(1, 2).reshape(h.shape)
        return self.head(h)


torch.manual_seed(0)
model = Model().eval()
prompt = torch.arange(1, 13)[None]
prefill_chunk_size = prompt.shape[1] if FIXED else 4  # the fix: the whole prompt in one chunk
with torch.no_grad():
    for start in range(0, prompt.shape[1], prefill_chunk_size):
        logits = model(prompt[:, start:start + prefill_chunk_size], torch.arange(start, min(start + prefill_chunk_size, prompt.shape[1])))
    for position in range(prompt.shape[1], prompt.shape[1] + 2):  # two decode steps
        token = logits[:, -1:].argmax(-1)
        logits = model(token, torch.tensor([position]))
