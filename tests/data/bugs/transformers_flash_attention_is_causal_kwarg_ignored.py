# huggingface/transformers#39707 (fixes #39554): flash_attention_forward popped the caller's
# `is_causal` kwarg and always used `module.is_causal` (True), so a decoder turned bidirectional
# for embeddings (model(..., is_causal=False)) still ran causal attention.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length,
                             is_causal, dropout=0.0, softmax_scale=None, **kwargs):
    # CPU stand-in for flash_attn_varlen_func(..., causal=is_causal): the 2D padding mask selects
    # the keys of each sequence, `causal` adds the lower triangle.
    # inputs are (batch, seq, heads, head_dim) as flash-attn expects
    q, k, v = (t.transpose(1, 2) for t in (query_states, key_states, value_states))
    allowed = attention_mask[:, None, None, :].bool()
    if is_causal:
        tril = torch.ones(query_length, k.shape[2], dtype=torch.bool).tril()
        allowed = allowed & tril
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=softmax_scale)
    return out.transpose(1, 2)


def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    seq_len = query.shape[2]
    query = query.transpose(1, 2)
    key = key.transpose(1, 2)
    value = value.transpose(1, 2)
    if FIXED:
        is_causal = kwargs.pop("is_causal", None)
        if is_causal is None:
            is_causal = module.is_causal
    else:
        # FA2 always relies on the value set in the module, so remove it if present in kwargs
        kwargs.pop("is_causal", None)
        is_causal = module.is_causal
    attn_output = _flash_attention_forward(query, key, value, attention_mask, query_length=seq_len,
                                           is_causal=is_causal, dropout=dropout, softmax_scale=scaling, **kwargs)
    return attn_output, None


class Qwen3Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.num_heads, self.head_dim = heads, hidden // heads
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, hidden_states, attention_mask, **kwargs):
        b, s, _ = hidden_states.shape
        shape = (b, s, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out, _ = flash_attention_forward(self, q, k, v, attention_mask, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(b, s, -1))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.self_attn = Qwen3Attention(hidden, heads)
        self.input_layernorm = nn.LayerNorm(hidden)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x, attention_mask, **kwargs):
        x = x + self.self_attn(self.input_layernorm(x), attention_mask, **kwargs)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    """attn_implementation="flash_attention_2": the 2D padding mask is handed to the kernel as is."""

    def __init__(self, vocab=100, hidden=32, heads=4, layers=2, max_pos=64):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.embed_positions = nn.Embedding(max_pos, hidden)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, input_ids, attention_mask, **kwargs):
        pos = torch.arange(input_ids.shape[1])
        h = self.embed_tokens(input_ids) + self.embed_positions(pos)
        for layer in self.layers:
            h = layer(h, attention_mask, **kwargs)
        return self.norm(h)


def mean_pool(last_hidden, attention_mask):
    m = attention_mask.unsqueeze(-1).float()
    return (last_hidden * m).sum(1) / m.sum(1)


model = Qwen3Model().eval()
input_ids = torch.randint(1, 100, (2, 10))
attention_mask = torch.ones(2, 10, dtype=torch.long)
attention_mask[1, 7:] = 0  # right padding for the shorter text
input_ids[1, 7:] = 0

with torch.no_grad():
    # LLM2Vec-style bidirectional encoding of a decoder-only backbone
    emb = mean_pool(model(input_ids, attention_mask, is_causal=False), attention_mask)
    # reference: the same layers with every attention module switched to non-causal
    for layer in model.layers:
        layer.self_attn.is_causal = False
    ref = mean_pool(model(input_ids, attention_mask), attention_mask)

print(f"fixed={FIXED} max |embedding - bidirectional reference| = {(emb - ref).abs().max():.4e}")
