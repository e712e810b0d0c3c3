# huggingface/transformers#46914: with a StaticCache the flash-attention mask was returned as None, so
# FA ran plain causal (bottom-right) over the whole padded cache and attended the empty, zero-filled slots.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def flash_attn_func(q, k, v, causal=True):
    # CPU stand-in for flash_attn_func: causal alignment is bottom-right, as in flash-attn >= 2.1
    bias = causal_lower_right(q.shape[-2], k.shape[-2]) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def flash_attn_varlen_like(q, k, v, key_padding_mask):
    # CPU stand-in for the unpad + flash_attn_varlen_func path (one sequence per row)
    outs = []
    for b in range(q.shape[0]):
        keep = key_padding_mask[b].bool()
        outs.append(flash_attn_func(q[b : b + 1], k[b : b + 1, :, keep], v[b : b + 1, :, keep], causal=True))
    return torch.cat(outs)


def _flash_attention_forward(query, key, value, attention_mask, is_causal=True):
    if attention_mask is not None:
        return flash_attn_varlen_like(query, key, value, attention_mask)
    return flash_attn_func(query, key, value, causal=is_causal)


class StaticCache:
    def __init__(self, num_layers, batch, heads, max_cache_len, head_dim):
        self.max_cache_len = max_cache_len
        self.keys = [torch.zeros(batch, heads, max_cache_len, head_dim) for _ in range(num_layers)]
        self.values = [torch.zeros(batch, heads, max_cache_len, head_dim) for _ in range(num_layers)]

    def update(self, k, v, layer_idx, cache_position):
        self.keys[layer_idx].index_copy_(2, cache_position, k)
        self.values[layer_idx].index_copy_(2, cache_position, v)
        return self.keys[layer_idx], self.values[layer_idx]


def flash_attention_mask(batch_size, cache_position, kv_length, attention_mask=None, is_static=False):
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.all():
            attention_mask = None
    if FIXED and attention_mask is None and is_static:
        # the static cache is padded to kv_length: only slots up to the last written position are valid
        valid = torch.arange(kv_length) <= cache_position[-1]
        attention_mask = valid[None, :].expand(batch_size, -1).long()
    return attention_mask


class LlamaAttention(nn.Module):
    def __init__(self, layer_idx, hidden=32, heads=4):
        super().__init__()
        self.layer_idx, self.heads, self.head_dim = layer_idx, heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, attention_mask, past_key_values, cache_position):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx, cache_position)
        out = _flash_attention_forward(q, k, v, attention_mask, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class LlamaModel(nn.Module):
    def __init__(self, vocab=64, hidden=32, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaAttention(i, hidden) for i in range(layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, past_key_values=None, cache_position=None, attention_mask=None):
        if cache_position is None:
            cache_position = torch.arange(input_ids.shape[1])
        is_static = isinstance(past_key_values, StaticCache)
        kv_length = past_key_values.max_cache_len if is_static else input_ids.shape[1]
        mask = flash_attention_mask(input_ids.shape[0], cache_position, kv_length, attention_mask, is_static)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = h + layer(h, mask, past_key_values, cache_position)
        return self.lm_head(h)


model = LlamaModel().eval()
prompt = torch.randint(0, 64, (1, 5))
cache = StaticCache(2, 1, 4, max_cache_len=16, head_dim=8)
tokens = prompt
with torch.no_grad():
    logits = model(prompt, past_key_values=cache, cache_position=torch.arange(5))
    for step in range(3):  # greedy decode with the static cache
        nxt = logits[:, -1:].argmax(-1)
        tokens = torch.cat([tokens, nxt], dim=1)
        pos = tokens.shape[1] - 1
        logits = model(nxt, past_key_values=cache, cache_position=torch.tensor([pos]))
    ref = model(tokens)[:, -1:]  # no cache, nothing padded: the correct logits
print("static cache decode, last-step logits vs no-cache forward, max diff: %.4g" % (logits - ref).abs().max().item())
