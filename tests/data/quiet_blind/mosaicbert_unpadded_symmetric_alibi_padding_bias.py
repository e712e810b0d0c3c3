"""MosaicBERT: tokens kept unpadded between layers, symmetric ALiBi plus a -10000 padding bias.

Follows mosaicml/examples examples/bert/src/bert_layers.py (BertEncoder.rebuild_alibi_tensor,
BertEncoder.forward, BertUnpadSelfAttention.forward without flash-attn) and bert_padding.py
(unpad_input, pad_input, index_first_axis). The encoder removes pad tokens (a flat
[total_nnz, dim] tensor with `indices` and `cu_seqlens`); each attention layer scatters q/k/v back
to [batch, seqlen], adds `attn_bias + alibi` and runs a softmax over all seqlen keys, then gathers
the real tokens again. The ALiBi is bidirectional: slope_h * -|i - j| (an encoder, so the bias is
symmetric, not causal). The padding bias is (1 - attention_mask) * -10000 over keys.
Mask meant: bidirectional over each sequence's real tokens; pad keys get -10000 (a float mask, not
-inf); per-head distance penalty -slope_h * |i - j|; pad query rows are never read back.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class BertConfig:
    vocab_size: int = 120
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    intermediate_size: int = 128
    alibi_starting_size: int = 32


def index_first_axis(x, indices):
    return x[indices]


def unpad_input(hidden_states, attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    hidden_states = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return hidden_states, indices, cu_seqlens, max_seqlen_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    output = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])


def _get_alibi_head_slopes(n_heads):
    def get_slopes_power_of_2(n_heads):
        start = 2 ** (-(2 ** -(math.log2(n_heads) - 3)))
        ratio = start
        return [start * ratio ** i for i in range(n_heads)]

    if math.log2(n_heads).is_integer():
        return get_slopes_power_of_2(n_heads)
    closest_power_of_2 = 2 ** math.floor(math.log2(n_heads))
    slopes_a = get_slopes_power_of_2(closest_power_of_2)
    slopes_b = _get_alibi_head_slopes(2 * closest_power_of_2)
    return slopes_a + slopes_b[0::2][: n_heads - closest_power_of_2]


class BertUnpadSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = config.hidden_size
        self.Wqkv = nn.Linear(config.hidden_size, 3 * self.all_head_size)

    def forward(self, hidden_states, cu_seqlens, max_seqlen_in_batch, indices, attn_mask, bias):
        qkv = self.Wqkv(hidden_states)
        qkv = pad_input(qkv, indices, cu_seqlens.shape[0] - 1, max_seqlen_in_batch)
        qkv = qkv.view(*qkv.shape[:2], 3, self.num_attention_heads, self.attention_head_size)
        q = qkv[:, :, 0].permute(0, 2, 1, 3)
        k = qkv[:, :, 1].permute(0, 2, 3, 1)
        v = qkv[:, :, 2].permute(0, 2, 1, 3)
        attention_scores = torch.matmul(q, k) / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + bias
        attention_probs = F.softmax(attention_scores, dim=-1)
        attention = torch.matmul(attention_probs, v).permute(0, 2, 1, 3)
        # back to the unpadded layout: only real tokens continue
        attention = attention.reshape(-1, *attention.shape[2:])[attn_mask.flatten().nonzero().flatten()]
        return attention.reshape(-1, self.all_head_size)


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertUnpadSelfAttention(config)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.LayerNorm2 = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, cu_seqlens, seqlen, indices, attn_mask, bias):
        a = self.self(hidden_states, cu_seqlens, seqlen, indices, attn_mask, bias)
        hidden_states = self.LayerNorm(hidden_states + self.dense(a))
        return self.LayerNorm2(hidden_states + self.mlp(hidden_states))


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.num_attention_heads = config.num_attention_heads
        self._current_alibi_size = int(config.alibi_starting_size)
        self.alibi = torch.zeros((1, self.num_attention_heads, self._current_alibi_size, self._current_alibi_size))
        self.rebuild_alibi_tensor(size=config.alibi_starting_size)

    def rebuild_alibi_tensor(self, size):
        n_heads = self.num_attention_heads
        context_position = torch.arange(size)[:, None]
        memory_position = torch.arange(size)[None, :]
        relative_position = torch.abs(memory_position - context_position)
        relative_position = relative_position.unsqueeze(0).expand(n_heads, -1, -1)
        slopes = torch.Tensor(_get_alibi_head_slopes(n_heads))
        alibi = slopes.unsqueeze(1).unsqueeze(1) * -relative_position
        self._current_alibi_size = size
        self.alibi = alibi.unsqueeze(0)

    def forward(self, hidden_states, attention_mask):
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2).float()
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        attention_mask_bool = attention_mask.bool()
        batch, seqlen = hidden_states.shape[:2]
        hidden_states, indices, cu_seqlens, _ = unpad_input(hidden_states, attention_mask_bool)
        if self._current_alibi_size < seqlen:
            self.rebuild_alibi_tensor(size=seqlen)
        attn_bias = extended_attention_mask[:, :, :seqlen, :seqlen]
        alibi_attn_mask = attn_bias + self.alibi[:, :, :seqlen, :seqlen]
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, cu_seqlens, seqlen, indices,
                                         attention_mask_bool, alibi_attn_mask)
        return pad_input(hidden_states, indices, batch, seqlen)


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(2, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids, token_type_ids, attention_mask):
        # no position embeddings: ALiBi carries position
        x = self.LayerNorm(self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids))
        return self.encoder(x, attention_mask)


if __name__ == "__main__":
    torch.manual_seed(0)
    config = BertConfig()
    model = BertModel(config).eval()
    input_ids = torch.tensor([[101, 7, 8, 9, 102, 11, 12, 102, 0, 0],
                              [101, 21, 22, 23, 24, 25, 102, 31, 32, 102],
                              [101, 40, 102, 41, 102, 0, 0, 0, 0, 0]])
    attention_mask = (input_ids != 0).long()
    token_type_ids = torch.zeros_like(input_ids)
    with torch.no_grad():
        out = model(input_ids, token_type_ids, attention_mask)
    print("sequence_output", tuple(out.shape), "real tokens", int(attention_mask.sum()))
