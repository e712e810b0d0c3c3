# HKUSTDial/flash-sparse-attention#146 (examples/modeling/modeling_doge.py, flex variant): with a
# causal BlockMask, prepare_dynamic_mask skipped the causal mask, so the top-k key selection ran on
# dt_states expanded over all queries and kept future keys that the causal block mask then removed.
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

warnings.filterwarnings("ignore")
FIXED = "--fixed" in sys.argv


class DogeConfig:
    hidden_size = 32
    num_attention_heads = 4
    head_dim = 8
    keep_window_size = 4  # dynamic masking only when the sequence is longer than this
    vocab_size = 50


def flex_attention_forward(module, query, key, value, attention_mask, attention_bias, scaling):
    block_mask = attention_mask if isinstance(attention_mask, BlockMask) else None

    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        return score + attention_bias[batch_idx][head_idx][q_idx][kv_idx]

    return flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling)


class DogeAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
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

        # calculate dynamic mask from value_states
        dt_states = self.dt_proj(value_states.transpose(1, 2).reshape(bsz, value_states.shape[-2], -1))
        dt_states = torch.exp(self.A * F.softplus(dt_states)).transpose(-1, -2)
        attn_bias, attn_mask = self.prepare_dynamic_mask(hidden_states, dt_states, self.keep_window_size,
                                                         attention_mask)
        self.last_attn_mask = attn_mask
        attn_output = flex_attention_forward(self, query_states, key_states, value_states,
                                             attention_mask, attn_bias, self.scaling)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)

    def prepare_dynamic_mask(self, hidden_states, dt_states, keep_window_size=2048, attention_mask=None):
        min_dtype = torch.finfo(hidden_states.dtype).min
        dtype = hidden_states.dtype
        attn_bias = dt_states[:, :, None, :].expand(-1, -1, hidden_states.shape[1], -1)  # [b, h, q, k]
        if FIXED and isinstance(attention_mask, BlockMask):
            q_idx = torch.arange(hidden_states.shape[1])
            attention_mask = torch.where(q_idx[:, None] >= q_idx[None, :], 0.0, min_dtype)[None, None]
        if attention_mask is not None and not isinstance(attention_mask, BlockMask):
            attn_bias = attn_bias.masked_fill(attention_mask[:, :, :, : attn_bias.shape[-1]] != 0, min_dtype)
        if attn_bias.shape[-1] > keep_window_size:
            topk_values, topk_indices = torch.topk(attn_bias, keep_window_size, dim=-1, largest=True, sorted=False)
            valid_topk = topk_values != min_dtype
            attn_mask = torch.zeros_like(attn_bias, dtype=dtype).scatter(-1, topk_indices, valid_topk.to(dtype))
            attn_bias = attn_bias.masked_fill(attn_mask == 0.0, min_dtype)
        else:
            attn_mask = torch.ones_like(attn_bias, dtype=dtype)
        return attn_bias, attn_mask


def main():
    torch.manual_seed(0)
    config = DogeConfig()
    embed = nn.Embedding(config.vocab_size, config.hidden_size)
    attn = DogeAttention(config)
    input_ids = torch.randint(0, config.vocab_size, (2, 16))
    seq_len = input_ids.shape[1]

    def causal_mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = create_block_mask(causal_mask_mod, None, None, seq_len, seq_len, device="cpu")
    with torch.no_grad():
        out = attn(embed(input_ids), block_mask)
    causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
    kept = ((attn.last_attn_mask != 0) & causal).sum(-1).float().mean().item()
    print(f"mean past keys kept per query: {kept:.2f} (window {config.keep_window_size}); "
          f"output norm {out.norm().item():.4f}")


if __name__ == "__main__":
    main()
