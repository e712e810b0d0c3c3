"""fla-org/flash-linear-attention#842 (issue #838): a layer given both `cu_seqlens` and an `attention_mask` recomputed
cu_seqlens from the mask, overwriting the caller's. In packed training Hugging Face injects an all-ones attention_mask,
so the recomputed cu_seqlens collapsed to [0, total] and the packed samples attended to each other. The fix takes the
unpadding path only when cu_seqlens was not given. Written as fla's Attention layer (fla/layers/attn.py) with
flash_attn_varlen_func run as SDPA over the mask it applies (flash_attn needs a GPU)."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True):
    """flash_attn's packed layout (total, heads, dim): each sequence of cu_seqlens attends within itself, causal."""
    document = torch.repeat_interleave(torch.arange(len(cu_seqlens_q) - 1), cu_seqlens_q.diff())
    position = torch.arange(q.shape[0])
    keep = document[:, None] == document[None, :]
    if causal:
        keep = keep & (position[:, None] >= position[None, :])
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=keep)
    return o[0].transpose(0, 1)


def unpad_input(q, k, v, attention_mask):
    indices = attention_mask.flatten().nonzero().flatten()
    lengths = attention_mask.sum(-1)
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0))
    return q.flatten(0, 1)[indices], k.flatten(0, 1)[indices], v.flatten(0, 1)[indices], indices, cu_seqlens, int(lengths.max())


class Attention(nn.Module):
    def __init__(self, hidden_size=16, num_heads=2):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden_size, hidden_size) for _ in range(3))

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        batch_size, q_len, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(batch_size, q_len, self.num_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        cu_seqlens = kwargs.get("cu_seqlens")
        # the fix: unpad only where no cu_seqlens was given
        unpad = attention_mask is not None and cu_seqlens is None if FIXED else attention_mask is not None
        if unpad:
            q, k, v, indices_q, cu_seqlens, max_seqlen = unpad_input(q, k, v, attention_mask)
            o = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
            o = torch.zeros(batch_size * q_len, self.num_heads, self.head_dim).index_copy(0, indices_q, o)
        elif cu_seqlens is not None:
            o = flash_attn_varlen_func(q.squeeze(0), k.squeeze(0), v.squeeze(0), cu_seqlens, cu_seqlens, q_len, q_len, causal=True)
        return o.reshape(batch_size, q_len, -1)


class Model(nn.Module):
    def __init__(self, vocab_size=32, hidden_size=16, num_layers=2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(Attention(hidden_size) for _ in range(num_layers))

    def forward(self, input_ids, attention_mask=None, **kwargs):
        hidden_states = self.embeddings(input_ids)
        for layer in self.layers:
            hidden_states = hidden_states + layer(hidden_states, attention_mask=attention_mask, **kwargs)
        return hidden_states


torch.manual_seed(0)
samples = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
input_ids = torch.tensor([[t for s in samples for t in s]])
cu_seqlens = torch.tensor([0, 3, 7, 9], dtype=torch.int32)
with torch.no_grad():
    Model()(input_ids, attention_mask=torch.ones_like(input_ids), cu_seqlens=cu_seqlens)
