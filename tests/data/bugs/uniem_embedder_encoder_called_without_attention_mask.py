"""uniem text embedder: the BERT encoder is called without the attention mask; padding is only left out of the pooling.

Citation: wangyuxinwhy/uniem#23 ("fix: attention mask bug", commit ba0a8e4).

Bug: ``LastMeanEmbedder.forward(input_ids, mask)`` (and the CLS / first-last / embedding-last embedders)
builds ``mask = input_ids != pad_token_id`` but calls ``self.encoder(input_ids)`` with no
``attention_mask``: inside the encoder every token of a short sentence attends the pad tokens of the
batch, and the mask is only used afterwards by ``mean_pooling``. Embeddings depend on how much padding the
batch has, in training (in-batch negatives) and in inference.
Fix: ``self.encoder(input_ids, attention_mask=attention_mask)`` (argument renamed ``attention_mask``).

This program: ``LastMeanEmbedder`` as the project wrote it, wrapping a one-layer BERT encoder written in
plain torch the way transformers 4.x ``BertModel`` (eager attention) treats its argument: a missing
``attention_mask`` becomes all ones, ``get_extended_attention_mask`` turns it into ``(1 - mask) * finfo.min``
added to the scores before the softmax. Right-padded batch of two sentences (lengths 6 and 3, pad id 0).
"""
import sys
from enum import Enum
from typing import ClassVar

import math
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class BertConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    max_position_embeddings: int = 32
    pad_token_id: int = 0


@dataclass
class BaseModelOutput:
    last_hidden_state: torch.Tensor


class BertModel(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size)
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.output = nn.Linear(config.hidden_size, config.hidden_size)

    def get_extended_attention_mask(self, attention_mask, dtype):
        extended_attention_mask = attention_mask[:, None, None, :].to(dtype)
        return (1.0 - extended_attention_mask) * torch.finfo(dtype).min

    def forward(self, input_ids, attention_mask=None):
        batch_size, seq_length = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length))
        positions = torch.arange(seq_length)[None]
        hidden = self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(positions))
        extended_attention_mask = self.get_extended_attention_mask(attention_mask, hidden.dtype)

        heads = self.config.num_attention_heads
        shape = (batch_size, seq_length, heads, -1)
        q = self.query(hidden).view(shape).transpose(1, 2)
        k = self.key(hidden).view(shape).transpose(1, 2)
        v = self.value(hidden).view(shape).transpose(1, 2)
        attention_scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        attention_scores = attention_scores + extended_attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context = torch.matmul(attention_probs, v).transpose(1, 2).reshape(batch_size, seq_length, -1)
        return BaseModelOutput(last_hidden_state=self.LayerNorm(hidden + self.output(context)))


class PoolingStrategy(str, Enum):
    cls = "cls"
    last_mean = "last_mean"


def creat_mask_from_input_ids(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    return input_ids != pad_token_id


def mean_pooling(hidden_state: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    if mask is None:
        return torch.mean(hidden_state, dim=1)
    mask = mask.float()
    return torch.sum(hidden_state * mask.unsqueeze(-1), dim=1) / torch.sum(mask, dim=-1, keepdim=True)


class Embedder(torch.nn.Module):
    pooling_strategy: ClassVar[PoolingStrategy]

    def __init__(self, encoder, pad_token_id: int | None = None):
        super().__init__()
        self.encoder = encoder
        self.pad_token_id = pad_token_id if pad_token_id is not None else encoder.config.pad_token_id


class LastMeanEmbedder(Embedder):
    pooling_strategy: ClassVar[PoolingStrategy] = PoolingStrategy.last_mean

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:
            mask = creat_mask_from_input_ids(input_ids, self.pad_token_id)
        if FIXED:
            embeddings = self.encoder(input_ids, attention_mask=mask).last_hidden_state
        else:
            embeddings = self.encoder(input_ids).last_hidden_state
        embeddings = mean_pooling(embeddings, mask)
        return embeddings


def main():
    torch.manual_seed(0)
    embedder = LastMeanEmbedder(BertModel(BertConfig())).eval()
    input_ids = torch.tensor([[2, 11, 23, 17, 9, 3], [2, 14, 3, 0, 0, 0]])
    with torch.no_grad():
        embeddings = embedder(input_ids)
    print("embeddings", tuple(embeddings.shape), "cos %.5f" % torch.cosine_similarity(embeddings[0], embeddings[1], dim=0))


if __name__ == "__main__":
    main()
