# The same bug as TransformerLens#777 written another way: a T5-style decoder self-attention (relative position buckets
# from an nn.Embedding, one bias for every layer, computed by the first) decodes a left-padded batch through a tuple
# cache. compute_bias places the queries at arange(query_length), so at a cached step the one query sits at distance 0
# from key 0: it gets the bias of the first query's row instead of its own (T5's own code takes the last query rows,
# position_bias[:, :, -query_length:, :], of a bias computed over every key). The padding mask (finfo.min on pad keys)
# is added with the bias in one tensor, as T5 adds position_bias + mask.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D_MODEL, HEADS, BUCKETS, MAX_DISTANCE, LAYERS = 32, 4, 16, 64, 2
D_KV = D_MODEL // HEADS


def relative_position_bucket(relative_position, num_buckets=BUCKETS, max_distance=MAX_DISTANCE):
    """T5's unidirectional buckets: exact below num_buckets // 2, logarithmic beyond, for keys at or before the query."""
    relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return torch.where(is_small, relative_position, large)


class SelfAttention(nn.Module):
    def __init__(self, has_relative_attention_bias):
        super().__init__()
        self.q = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.k = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.v = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.o = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.has_relative_attention_bias = has_relative_attention_bias
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(BUCKETS, HEADS)
            nn.init.normal_(self.relative_attention_bias.weight, std=2.0)

    def compute_bias(self, query_length, key_length):
        if FIXED:
            context_position = torch.arange(key_length - query_length, key_length)[:, None]
        else:
            context_position = torch.arange(query_length)[:, None]
        memory_position = torch.arange(key_length)[None, :]
        buckets = relative_position_bucket(memory_position - context_position)
        return self.relative_attention_bias(buckets).permute(2, 0, 1)[None]  # (1, H, Lq, Lk)

    def forward(self, hidden, mask, past=None, position_bias=None):
        b, t, _ = hidden.shape
        q = self.q(hidden).view(b, t, HEADS, D_KV).transpose(1, 2)
        k = self.k(hidden).view(b, t, HEADS, D_KV).transpose(1, 2)
        v = self.v(hidden).view(b, t, HEADS, D_KV).transpose(1, 2)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        scores = torch.matmul(q, k.transpose(3, 2))  # (T5 does not scale)
        if position_bias is None:
            position_bias = self.compute_bias(t, k.shape[2]) + mask
        scores += position_bias
        weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(b, t, D_MODEL)
        return self.o(out), (k, v), position_bias


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, D_MODEL)
        self.layers = nn.ModuleList([SelfAttention(i == 0) for i in range(LAYERS)])
        self.head = nn.Linear(D_MODEL, 50, bias=False)

    def forward(self, ids, attention_mask, cache=None):
        t, k_len = ids.shape[1], attention_mask.shape[1]
        causal = torch.ones(k_len, k_len, dtype=torch.bool).tril()[-t:]
        keep = causal[None, None] & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        x, new_cache, bias = self.embed(ids), [], None
        for i, layer in enumerate(self.layers):
            y, kv, bias = layer(x, mask, None if cache is None else cache[i], bias)
            x = x + y
            new_cache.append(kv)
        return self.head(x), new_cache


model = Decoder().eval()
ids = torch.tensor([[0, 0, 5, 7, 9, 11], [3, 4, 5, 6, 7, 8]])
attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # left padded
with torch.no_grad():
    logits, cache = model(ids, attention_mask)
    for _ in range(4):
        nxt = logits[:, -1:].argmax(-1)
        ids = torch.cat([ids, nxt], dim=1)
        attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        logits, cache = model(nxt, attention_mask, cache)
    full, _ = model(ids, attention_mask)
print(f"max |cached last logits - uncached|: {(logits[:, -1] - full[:, -1]).abs().max().item():.6f}")
