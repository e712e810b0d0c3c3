# huggingface/transformers PR #48817 (NemotronAsrStreamingEncoderAttention, eager path).
# Bug: the chunked/padding mask reaches the attention as an additive float mask (0 / finfo.min) under eager,
# but is applied with masked_fill_(attention_mask.logical_not(), -inf): allowed keys get masked, masked keys kept.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D, H, L, T, B = 32, 4, 2, 16, 2
LEFT_CTX, RIGHT_CTX = 4, 3  # att_context_size -> chunked_limited, chunk_size = 4


def chunked_limited_mask_function(left_ctx, right_ctx):
    chunk_size = right_ctx + 1
    left_context_chunks = left_ctx // chunk_size if left_ctx >= 0 else 10_000

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        q_chunk = torch.div(q_idx, chunk_size, rounding_mode="trunc")
        kv_chunk = torch.div(kv_idx, chunk_size, rounding_mode="trunc")
        chunk_diff = q_chunk - kv_chunk
        return (chunk_diff >= 0) & (chunk_diff <= left_context_chunks)

    return inner_mask


def create_bidirectional_mask(attn_implementation, padding_mask, dtype, and_mask_function):
    # masking_utils: bool mask for sdpa, additive float mask (0 / finfo.min) for eager
    q = torch.arange(T)[:, None]
    kv = torch.arange(T)[None, :]
    allowed = and_mask_function(None, None, q, kv)[None, None] & padding_mask[:, None, None, :].bool()
    if attn_implementation == "sdpa":
        return allowed
    return torch.where(allowed, torch.tensor(0.0, dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype))


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


def sdpa_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


ALL_ATTENTION_FUNCTIONS = {"eager": eager_attention_forward, "sdpa": sdpa_attention_forward}


class NemotronAsrStreamingEncoderAttention(nn.Module):
    def __init__(self, attn_implementation):
        super().__init__()
        self.attn_implementation = attn_implementation
        self.num_attention_heads = H
        self.head_dim = D // H
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(D, D)
        self.k_proj = nn.Linear(D, D)
        self.v_proj = nn.Linear(D, D)
        self.o_proj = nn.Linear(D, D)
        self.relative_k_proj = nn.Linear(D, D, bias=False)
        self.bias_u = nn.Parameter(torch.randn(H, self.head_dim) * 0.1)
        self.bias_v = nn.Parameter(torch.randn(H, self.head_dim) * 0.1)

    def _rel_shift(self, attention_scores):
        batch_size, num_heads, query_length, position_length = attention_scores.shape
        attention_scores = nn.functional.pad(attention_scores, pad=(1, 0))
        attention_scores = attention_scores.view(batch_size, num_heads, -1, query_length)
        attention_scores = attention_scores[:, :, 1:].view(batch_size, num_heads, query_length, position_length)
        return attention_scores

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        batch_size, seq_length = hidden_states.shape[:-1]
        hidden_shape = (batch_size, seq_length, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        total_key_length = key_states.shape[2]
        attention_interface = ALL_ATTENTION_FUNCTIONS[self.attn_implementation]

        query_states_with_bias_u = query_states + self.bias_u.view(1, H, 1, self.head_dim)
        query_states_with_bias_v = query_states + self.bias_v.view(1, H, 1, self.head_dim)
        relative_key_states = self.relative_k_proj(position_embeddings)
        relative_key_states = relative_key_states.view(batch_size, -1, H, self.head_dim)

        matrix_bd = query_states_with_bias_v @ relative_key_states.permute(0, 2, 3, 1)
        matrix_bd = self._rel_shift(matrix_bd)
        matrix_bd = matrix_bd[..., :total_key_length]
        matrix_bd = matrix_bd * self.scaling

        if attention_mask is not None:
            if FIXED and attention_mask.dtype != torch.bool:
                # additive float mask from create_bidirectional_mask (eager): 0 = attend
                attention_mask = attention_mask == 0
            matrix_bd = matrix_bd.masked_fill_(attention_mask.logical_not(), float("-inf"))

        attn_output, _ = attention_interface(
            self, query=query_states_with_bias_u, key=key_states, value=value_states,
            attention_mask=matrix_bd, scaling=self.scaling,
        )
        attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()
        return self.o_proj(attn_output)


def rel_positional_encoding(length):
    positions = torch.arange(length - 1, -length, -1, dtype=torch.float32).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, D, 2, dtype=torch.float32) * -(math.log(10000.0) / D))
    pe = torch.zeros(2 * length - 1, D)
    pe[:, 0::2] = torch.sin(positions * inv_freq)
    pe[:, 1::2] = torch.cos(positions * inv_freq)
    return pe.unsqueeze(0)


class Encoder(nn.Module):
    def __init__(self, attn_implementation):
        super().__init__()
        self.attn_implementation = attn_implementation
        self.layers = nn.ModuleList([NemotronAsrStreamingEncoderAttention(attn_implementation) for _ in range(L)])
        self.norms = nn.ModuleList([nn.LayerNorm(D) for _ in range(L)])

    def forward(self, hidden_states, padding_mask):
        attention_mask = create_bidirectional_mask(
            self.attn_implementation, padding_mask, hidden_states.dtype,
            and_mask_function=chunked_limited_mask_function(LEFT_CTX, RIGHT_CTX),
        )
        pos = rel_positional_encoding(hidden_states.shape[1]).expand(hidden_states.shape[0], -1, -1)
        for layer, norm in zip(self.layers, self.norms):
            hidden_states = hidden_states + layer(norm(hidden_states), pos, attention_mask=attention_mask.clone())
        return hidden_states


eager = Encoder("eager")
sdpa = Encoder("sdpa")
sdpa.load_state_dict(eager.state_dict())

x = torch.randn(B, T, D)
lengths = torch.tensor([T, 11])
padding_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
with torch.no_grad():
    out_eager = eager(x, padding_mask)
    out_sdpa = sdpa(x, padding_mask)
valid = padding_mask.bool()
diff = (out_eager - out_sdpa)[valid]
print("nan frames in eager output:", int(torch.isnan(out_eager[valid]).any(-1).sum()))
print("max |eager - sdpa| over valid frames:", float(torch.nan_to_num(diff, nan=1e9).abs().max()))
