# HKUSTDial/flash-sparse-attention#146 (examples/modeling/modeling_doge.py): the dynamic-mask
# top-k key selection ran on dt_states expanded over all queries before the causal mask was applied.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class DogeConfig:
    hidden_size = 32
    num_attention_heads = 4
    head_dim = 8
    keep_window_size = 4  # each query keeps at most this many keys
    vocab_size = 50


def prepare_dynamic_mask(hidden_states, attn_bias, keep_window_size, attention_mask=None):
    """Keep the keep_window_size keys with the largest dynamic bias; mask out the rest."""
    min_dtype = torch.finfo(hidden_states.dtype).min
    attn_mask = attn_bias
    if FIXED and attention_mask is not None:
        attn_mask = attn_mask.masked_fill(attention_mask != 0, min_dtype)
    if attn_mask.shape[-1] > keep_window_size:
        topk_indices = torch.topk(attn_mask, keep_window_size, dim=-1, largest=True, sorted=False).indices
        active_mask = torch.zeros_like(attn_mask).scatter(-1, topk_indices, 1.0)
        attn_mask = attn_mask.masked_fill(active_mask == 0.0, min_dtype)
    return attn_mask


def eager_attention_forward(query, key, value, attention_mask, attention_bias, scaling):
    attn_weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    attn_weights = attn_weights + attention_bias
    if attention_mask is not None:
        attn_weights = attn_weights.masked_fill(attention_mask != 0, torch.finfo(attn_weights.dtype).min)
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(attn_weights, value)


class DogeAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        self.keep_window_size = config.keep_window_size
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.A = nn.Parameter(torch.ones(self.num_heads))
        self.dt_proj = nn.Linear(self.num_heads * self.head_dim, self.num_heads, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        hidden_shape = (bsz, q_len, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        # Sampling dt_states from value_states to generate attention bias
        dt_states = self.dt_proj(value_states.transpose(1, 2).reshape(bsz, value_states.shape[-2], -1))
        dt_states = torch.exp(self.A * F.softplus(dt_states)).transpose(-1, -2)
        attn_bias = dt_states[:, :, None, :].expand(-1, -1, hidden_states.shape[1], -1)  # [b, h, q, k]
        attn_bias = prepare_dynamic_mask(hidden_states, attn_bias, self.keep_window_size, attention_mask)

        attn_output = eager_attention_forward(query_states, key_states, value_states,
                                              attention_mask, attn_bias, self.scaling)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


def main():
    torch.manual_seed(0)
    config = DogeConfig()
    embed = nn.Embedding(config.vocab_size, config.hidden_size)
    attn = DogeAttention(config)
    input_ids = torch.randint(0, config.vocab_size, (2, 16))
    seq_len = input_ids.shape[1]
    # causal mask: nonzero above the diagonal (future keys)
    causal_mask = torch.triu(torch.ones(seq_len, seq_len), diagonal=1)[None, None]
    with torch.no_grad():
        out = attn(embed(input_ids), causal_mask)
    # how many keys each query actually attends to (should be min(i + 1, keep_window_size))
    hs = embed(input_ids)
    with torch.no_grad():
        v = attn.v_proj(hs)
        dt = torch.exp(attn.A * F.softplus(attn.dt_proj(v))).transpose(-1, -2)
        bias = prepare_dynamic_mask(hs, dt[:, :, None, :].expand(-1, -1, seq_len, -1),
                                    config.keep_window_size, causal_mask)
    visible = ((bias > torch.finfo(hs.dtype).min) & (causal_mask == 0)).sum(-1).float().mean().item()
    print(f"mean keys attended per query: {visible:.2f} (window {config.keep_window_size}); "
          f"output norm {out.norm().item():.4f}")


if __name__ == "__main__":
    main()
