"""BLOOM: ALiBi position bias added as a float tensor, causal + left-padding mask applied with finfo.min.

Follows huggingface/transformers src/transformers/models/bloom/modeling_bloom.py (build_alibi_tensor with
arange_tensor = ((attention_mask.cumsum(-1) - 1) * attention_mask), BloomAttention computing
matmul_result = alibi.baddbmm(batch1=query, batch2=key, beta=1.0, alpha=inv_norm_factor), then
masked_fill(causal_mask, finfo.min) and softmax in float32). Mask meant: causal, left pads hidden from
real tokens; the ALiBi bias is slope * key position (counted from the first real token), which within a
softmax row equals the linear penalty -slope * (query - key) distance.
Query rows that are left pads themselves see only pads; their outputs are discarded by generate.
"""
import math

import torch
from torch import nn


class BloomConfig:
    def __init__(self, hidden_size=32, n_head=4, vocab_size=64, pad_token_id=3):
        self.hidden_size, self.n_head, self.vocab_size, self.pad_token_id = hidden_size, n_head, vocab_size, pad_token_id


def build_alibi_tensor(attention_mask, num_heads, dtype):
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32)
    powers = torch.arange(1, 1 + closest_power_of_2, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


def _prepare_4d_causal_mask(attention_mask):
    """True = masked. Causal OR key is padding."""
    bsz, seq = attention_mask.shape
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    return causal[None, None] | (attention_mask[:, None, None, :] == 0)


class BloomAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.n_head
        self.head_dim = config.hidden_size // config.n_head
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, alibi, attention_mask):
        bsz, q_length, _ = hidden_states.shape
        fused = self.query_key_value(hidden_states).view(bsz, q_length, self.num_heads, 3, self.head_dim)
        query_layer = fused[..., 0, :].transpose(1, 2).reshape(bsz * self.num_heads, q_length, self.head_dim)
        key_layer = fused[..., 1, :].permute(0, 2, 3, 1).reshape(bsz * self.num_heads, self.head_dim, q_length)
        value_layer = fused[..., 2, :].transpose(1, 2).reshape(bsz * self.num_heads, q_length, self.head_dim)
        matmul_result = alibi.baddbmm(batch1=query_layer, batch2=key_layer, beta=1.0, alpha=self.inv_norm_factor)
        attention_scores = matmul_result.view(bsz, self.num_heads, q_length, q_length)
        attn_weights = torch.masked_fill(attention_scores, attention_mask, torch.finfo(attention_scores.dtype).min)
        attention_probs = torch.softmax(attn_weights, dim=-1, dtype=torch.float32).to(hidden_states.dtype)
        context = torch.bmm(attention_probs.view(bsz * self.num_heads, q_length, q_length), value_layer)
        context = context.view(bsz, self.num_heads, q_length, self.head_dim).transpose(1, 2).reshape(bsz, q_length, -1)
        return self.dense(context)


def main():
    torch.manual_seed(0)
    config = BloomConfig()
    p = config.pad_token_id
    input_ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18], [p, p, p, 21, 22, 23, 24, 25]])
    attention_mask = (input_ids != p).long()
    word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
    hidden_states = word_embeddings(input_ids)
    alibi = build_alibi_tensor(attention_mask, config.n_head, hidden_states.dtype)
    causal_mask = _prepare_4d_causal_mask(attention_mask)
    with torch.no_grad():
        out = BloomAttention(config)(hidden_states, alibi, causal_mask)
    print("out", tuple(out.shape))


if __name__ == "__main__":
    main()
