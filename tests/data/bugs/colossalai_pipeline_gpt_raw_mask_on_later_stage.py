"""ColossalAI model_zoo GPT: only the first pipeline stage turns the 0/1 attention_mask into a -10000 bias.

Citation: hpcaitech/ColossalAI#430 "fixed gpt attention mask in pipeline" (commit 0f5f5dd55, fixes the first
problem of #425). Before the fix ``GPTEmbedding.forward`` converted the [batch, seq] 0/1 mask into the
additive ``(1.0 - mask) * -10000.0`` bias, but only the first stage of ``PipelineGPT`` owns the embedding.
Every later stage received the batch's raw 0/1 ``attention_mask`` and its ``GPTSelfAttention`` did
``x = x + attention_mask``: real keys got +1 and padded keys +0, so the padding was attended on every stage
but the first. The fix moves the conversion into ``PipelineGPT.forward`` for every stage.

This program keeps the pre-fix GPTEmbedding / GPTSelfAttention / GPTBlock / PipelineGPT code (``col_nn``
layers replaced by ``torch.nn``; ``partition_batch`` is the identity without tensor parallelism) and runs a
two-stage pipeline by hand on micro-batches of one left-padded sequence, passing the batch's
``attention_mask`` to both stages as the schedule does.
"""
import math
import sys
from typing import Callable

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def divide(numerator, denominator):
    assert numerator % denominator == 0
    return numerator // denominator


def partition_batch(input_):
    return input_


def to_additive(attention_mask, batch_size, dtype):
    # We create a 3D attention mask from a 2D tensor mask.
    # Sizes are [batch_size, 1, 1, to_seq_length]
    # So we can broadcast to [batch_size, num_heads, from_seq_length, to_seq_length]
    # Adapted from huggingface
    attention_mask = attention_mask.view(batch_size, -1)
    attention_mask = partition_batch(attention_mask)
    attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
    attention_mask = attention_mask.to(dtype=dtype)  # fp16 compatibility
    attention_mask = (1.0 - attention_mask) * -10000.0
    return attention_mask


class GPTEmbedding(nn.Module):
    def __init__(self, embedding_dim, vocab_size, max_position_embeddings, padding_idx=None, dropout=0.):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, embedding_dim, padding_idx=padding_idx)
        self.position_embeddings = nn.Embedding(max_position_embeddings, embedding_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        seq_length = input_ids.size(1)
        if position_ids is None:
            position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0)
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        x = self.dropout(x)

        if not FIXED and attention_mask is not None:
            attention_mask = to_additive(attention_mask, input_ids.shape[0], x.dtype)

        return x, attention_mask


class GPTSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, attention_dropout, dropout, bias=True):
        super().__init__()
        self.attention_head_size = divide(dim, num_heads)
        self.query_key_value = nn.Linear(dim, 3 * dim, bias=bias)
        self.softmax = nn.Softmax(dim=-1)
        self.attention_dropout = nn.Dropout(attention_dropout)
        self.dense = nn.Linear(dim, dim, bias=True)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, attention_mask=None):
        qkv = self.query_key_value(x)
        all_head_size = qkv.shape[-1] // 3
        num_attention_heads = divide(all_head_size, self.attention_head_size)
        new_qkv_shape = qkv.shape[:-1] + (num_attention_heads, 3 * self.attention_head_size)
        qkv = qkv.view(new_qkv_shape)
        qkv = qkv.permute((0, 2, 1, 3))
        q, k, v = torch.chunk(qkv, 3, dim=-1)

        x = torch.matmul(q, k.transpose(-1, -2))
        x = x / math.sqrt(self.attention_head_size)
        # causal mask
        q_len, k_len = q.size(-2), k.size(-2)
        causal_mask = torch.tril(torch.ones((q_len, k_len), dtype=torch.uint8)).view(1, 1, q_len, k_len).bool()
        x = torch.where(causal_mask, x, torch.tensor(-1e4, dtype=x.dtype))
        if attention_mask is not None:
            x = x + attention_mask
        x = self.softmax(x)

        x = self.attention_dropout(x)
        x = torch.matmul(x, v)
        x = x.transpose(1, 2)
        new_context_layer_shape = x.size()[:-2] + (all_head_size, )
        x = x.reshape(new_context_layer_shape)
        x = self.dense(x)
        x = self.dropout(x)
        return x


class GPTBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio, activation: Callable, attention_dropout=0., dropout=0.,
                 layernorm_epsilon=1e-5):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=layernorm_epsilon)
        self.attn = GPTSelfAttention(dim, num_heads, attention_dropout, dropout)
        self.norm2 = nn.LayerNorm(dim, eps=layernorm_epsilon)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.activation = activation

    def forward(self, x, attention_mask=None):
        residual = x
        x = self.norm1(x)
        x = residual + self.attn(x, attention_mask)
        residual = x
        x = self.norm2(x)
        x = residual + self.mlp(x)
        return x, attention_mask


class PipelineGPT(nn.Module):
    def __init__(self, vocab_size=128, max_position_embeddings=64, dim=32, num_heads=4, depth=1, mlp_ratio=4.0,
                 dropout=0., embedding_dropout=0., attention_dropout=0., layernorm_epsilon=1e-5,
                 activation=nn.functional.gelu, padding_idx=None, first=False, last=False):
        super().__init__()
        self.first = first
        self.last = last
        if first:
            self.embed = GPTEmbedding(dim, vocab_size, max_position_embeddings, padding_idx, embedding_dropout)
        self.blocks = nn.ModuleList([
            GPTBlock(dim, num_heads, mlp_ratio, activation, attention_dropout, dropout, layernorm_epsilon)
            for _ in range(depth)
        ])
        if self.last:
            self.norm = nn.LayerNorm(dim, eps=layernorm_epsilon)
            self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, x=None, input_ids=None, attention_mask=None):
        if self.first:
            x, attention_mask = self.embed(input_ids, attention_mask)

        if FIXED and attention_mask is not None:
            batch_size = input_ids.shape[0] if self.first else x.shape[0]
            attention_mask = to_additive(attention_mask, batch_size, x.dtype)

        for block in self.blocks:
            x, attention_mask = block(x, attention_mask)

        if self.last:
            x = self.head(self.norm(x))
        return x


def main():
    torch.manual_seed(0)
    # depth 4 split over 2 pipeline stages (partition_uniform): layers [0, 2) and [2, 4)
    stages = [PipelineGPT(depth=2, first=True, padding_idx=0).eval(), PipelineGPT(depth=2, last=True).eval()]
    input_ids = torch.tensor([[0, 0, 0, 17, 42, 8, 99, 23], [31, 5, 77, 64, 12, 9, 50, 3]])
    attention_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    micro_batch_size = 1
    outputs = []
    with torch.no_grad():
        for start in range(0, input_ids.shape[0], micro_batch_size):
            batch = {"input_ids": input_ids[start:start + micro_batch_size],
                     "attention_mask": attention_mask[start:start + micro_batch_size]}
            hidden = stages[0](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            outputs.append(stages[1](hidden, attention_mask=batch["attention_mask"]))
    logits = torch.cat(outputs)
    print("logits", tuple(logits.shape), "row 0 last:", [round(v, 4) for v in logits[0, -1, :3].tolist()])


if __name__ == "__main__":
    main()
