# Citation: huggingface/text-embeddings-inference commit 8c507c3 ("fix: only use position offset for
#   xlm-roberta"). Code read at 8c507c3^ (before) and 8c507c3 (after).
# Upstream: router/src/main.rs (position_offset computed from the model config), core/src/tokenization.rs
#   encode_input (position_ids = position_offset .. seq_len + position_offset), backends/candle
#   BertModel::forward (requests concatenated by cumulative_seq_lengths, right-padded into a batch with
#   an attention mask). Rust ported to Python; the encoder is transformers' BertModel, tiny and random.
# Bug: the router took position_offset = pad_token_id + 1 whenever pad_token_id != 0 (meant for
#   XLM-RoBERTa, whose positions start after the padding index). A BERT checkpoint whose pad token is
#   not id 0 then had every request's position_ids start at pad_token_id + 1 instead of 0.
# Fix: position_offset = pad_token_id + 1 only when config.model_type == "xlm-roberta", else 0.
import sys
from dataclasses import dataclass
from typing import List

import torch
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class ModelConfig:  # router/src/main.rs `struct ModelConfig` (the fields it reads)
    model_type: str
    pad_token_id: int
    max_position_embeddings: int


@dataclass
class Encoding:  # core/src/tokenization.rs
    input_ids: List[int]
    token_type_ids: List[int]
    position_ids: List[int]


def position_offset_for(config: ModelConfig) -> int:
    # Position IDs offset. Used for Roberta.
    if FIXED:
        if config.model_type == "xlm-roberta":
            return config.pad_token_id + 1
        return 0
    if config.pad_token_id == 0:
        return 0
    return config.pad_token_id + 1


def encode_input(ids: List[int], truncate: bool, max_input_length: int, position_offset: int) -> Encoding:
    seq_len = len(ids)
    if seq_len > max_input_length:
        if truncate:
            ids = ids[:max_input_length]
            seq_len = max_input_length
        else:
            raise ValueError(f"`inputs` must have less than {max_input_length} tokens. Given: {seq_len}")
    return Encoding(
        input_ids=list(ids),
        token_type_ids=[0] * seq_len,
        position_ids=list(range(position_offset, seq_len + position_offset)),
    )


@dataclass
class Batch:  # backends/core/src/lib.rs
    input_ids: List[int]
    token_type_ids: List[int]
    position_ids: List[int]
    cumulative_seq_lengths: List[int]
    max_length: int


def make_batch(encodings: List[Encoding]) -> Batch:
    input_ids, token_type_ids, position_ids, cu = [], [], [], [0]
    max_length = 0
    for e in encodings:
        input_ids += e.input_ids
        token_type_ids += e.token_type_ids
        position_ids += e.position_ids
        cu.append(cu[-1] + len(e.input_ids))
        max_length = max(max_length, len(e.input_ids))
    return Batch(input_ids, token_type_ids, position_ids, cu, max_length)


class CandleBert:
    """backends/candle/src/models/bert.rs BertModel::forward, CLS pooling."""

    def __init__(self, model: BertModel):
        self.model = model.eval()

    @torch.no_grad()
    def embed(self, batch: Batch) -> torch.Tensor:
        batch_size = len(batch.cumulative_seq_lengths) - 1
        max_length = batch.max_length
        input_ids = torch.zeros(batch_size, max_length, dtype=torch.long)
        type_ids = torch.zeros(batch_size, max_length, dtype=torch.long)
        position_ids = torch.zeros(batch_size, max_length, dtype=torch.long)
        attention_mask = torch.zeros(batch_size, max_length, dtype=torch.long)
        for i in range(batch_size):
            start, end = batch.cumulative_seq_lengths[i], batch.cumulative_seq_lengths[i + 1]
            n = end - start
            input_ids[i, :n] = torch.tensor(batch.input_ids[start:end])
            type_ids[i, :n] = torch.tensor(batch.token_type_ids[start:end])
            position_ids[i, :n] = torch.tensor(batch.position_ids[start:end])
            attention_mask[i, :n] = 1
        out = self.model(
            input_ids=input_ids,
            token_type_ids=type_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
        ).last_hidden_state
        return out[:, 0]


def main():
    hf_config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=1, initializer_range=0.5,
    )
    model = BertModel(hf_config, add_pooling_layer=False)
    config = ModelConfig("bert", hf_config.pad_token_id, hf_config.max_position_embeddings)
    position_offset = position_offset_for(config)
    max_input_length = config.max_position_embeddings - position_offset

    requests = [[2, 17, 23, 9, 41, 3], [2, 30, 12, 3], [2, 5, 8, 19, 27, 33, 44, 3]]
    encodings = [encode_input(r, True, max_input_length, position_offset) for r in requests]
    batch = make_batch(encodings)
    emb = CandleBert(model).embed(batch)
    emb = torch.nn.functional.normalize(emb, dim=-1)
    sims = emb[0] @ emb[1:].T
    print("position_offset:", position_offset)
    print("embedding[0][:4]:", [round(v, 4) for v in emb[0, :4].tolist()])
    print("cosine(q, docs):", [round(v, 4) for v in sims.tolist()])


if __name__ == "__main__":
    main()
