# wangyuxinwhy/uniem#23 (commit ba0a8e4, "fix:attention mask bug"): uniem's Embedders (LastMeanEmbedder,
# FirstLastEmbedder, ...) built `mask = input_ids != pad_token_id` (or took the tokenizer's attention_mask from
# UniEmbedder.encode) but used it only for mean pooling: the encoder was called as `self.encoder(input_ids)`,
# so in a right-padded batch every real token attended the [PAD] tokens.
# Fix: the mask is renamed attention_mask and also passed as `self.encoder(input_ids, attention_mask=...)`.
import sys
from enum import Enum
from itertools import islice
from typing import ClassVar, Type

import numpy as np
import torch
from transformers import BertConfig, BertModel, BertTokenizer, PreTrainedModel

FIXED = "--fixed" in sys.argv


# ---- uniem/utils.py ----
def generate_batch(data, batch_size=32):
    iterator = iter(data)
    while batch := list(islice(iterator, batch_size)):
        yield batch


# ---- uniem/criteria.py ----
class CoSentLoss(torch.nn.Module):
    bias: torch.Tensor

    def __init__(self, temperature: float = 0.05) -> None:
        super().__init__()
        self.temperature = temperature
        self.register_buffer('bias', torch.tensor([0.0]))

    def forward(self, predict_similarity: torch.Tensor, true_similarity: torch.Tensor) -> torch.Tensor:
        predict_similarity = predict_similarity / self.temperature

        cosine_similarity_diff = -(predict_similarity.unsqueeze(0) - predict_similarity.unsqueeze(1))
        smaller_mask = true_similarity.unsqueeze(0) <= true_similarity.unsqueeze(1)
        cosine_similarity_diff = cosine_similarity_diff.masked_fill(smaller_mask, -1e12)

        cosine_diff_scores_add_bias = torch.cat((cosine_similarity_diff.view(-1), self.bias))

        loss = torch.logsumexp(cosine_diff_scores_add_bias, dim=0)
        return loss


# ---- uniem/model.py ----
class PoolingStrategy(str, Enum):
    cls = 'cls'
    last_mean = 'last_mean'
    first_last_mean = 'first_last_mean'


def creat_mask_from_input_ids(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    return input_ids != pad_token_id


def mean_pooling(hidden_state: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    if mask is None:
        return torch.mean(hidden_state, dim=1)
    mask = mask.float()
    return torch.sum(hidden_state * mask.unsqueeze(-1), dim=1) / torch.sum(mask, dim=-1, keepdim=True)


StrategyEmbedderClsMap: dict[PoolingStrategy, Type['Embedder']] = {}


class Embedder(torch.nn.Module):
    pooling_strategy: ClassVar[PoolingStrategy]

    def __init__(self, encoder: PreTrainedModel, pad_token_id: int | None = None):
        super().__init__()
        self.encoder = encoder
        self.encoder.config.uniem_pooling_strategy = str(self.pooling_strategy.value)

        if pad_token_id is None:
            if encoder.config.pad_token_id is not None:
                self.pad_token_id = encoder.config.pad_token_id
            else:
                self.pad_token_id = 0
        else:
            self.pad_token_id = pad_token_id

    def __init_subclass__(cls) -> None:
        StrategyEmbedderClsMap[cls.pooling_strategy] = cls

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


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


class ClsEmbedder(Embedder):
    pooling_strategy: ClassVar[PoolingStrategy] = PoolingStrategy.cls

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if FIXED:
            if mask is None:
                mask = creat_mask_from_input_ids(input_ids, self.pad_token_id)
            embeddings = self.encoder(input_ids, attention_mask=mask).last_hidden_state[:, 0]
        else:
            embeddings = self.encoder(input_ids).last_hidden_state[:, 0]
        return embeddings


class FirstLastEmbedder(Embedder):
    pooling_strategy: ClassVar[PoolingStrategy] = PoolingStrategy.first_last_mean

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:
            mask = creat_mask_from_input_ids(input_ids, self.pad_token_id)
        if FIXED:
            embeddings = self.encoder(input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
        else:
            embeddings = self.encoder(input_ids, output_hidden_states=True).hidden_states
        first_embeddings = mean_pooling(embeddings[0], mask)
        last_embeddings = mean_pooling(embeddings[-1], mask)
        embeddings = (first_embeddings + last_embeddings) / 2
        return embeddings


class EmbedderForScoredPairTrain(torch.nn.Module):
    def __init__(self, pretrained_model, temperature: float | None = None,
                 embedding_strategy: PoolingStrategy | str = PoolingStrategy.last_mean):
        super().__init__()
        self.embedder = StrategyEmbedderClsMap[PoolingStrategy(embedding_strategy)](pretrained_model)
        temperature = temperature or 0.05
        self.criterion = CoSentLoss(temperature)

    def forward(self, text_ids: torch.Tensor, text_pair_ids: torch.Tensor, labels: torch.Tensor):
        text_embeddings = self.embedder(text_ids)
        text_pos_embeddings = self.embedder(text_pair_ids)
        predict_labels = torch.cosine_similarity(text_embeddings, text_pos_embeddings, dim=-1)
        loss = self.criterion(predict_labels, labels)
        return {'loss': loss, 'predict_labels': predict_labels}


class UniEmbedder:
    def __init__(self, embedder: Embedder, tokenizer, normalize: bool = True, max_length: int | None = None,
                 device: str | None = None):
        super().__init__()
        self.embedder = embedder.eval()
        self.embedder = self.embedder.to(device or 'cpu')
        self.tokenizer = tokenizer
        self.normalize = normalize
        self.max_length = (
            max_length or self.embedder.encoder.config.max_length or self.embedder.encoder.config.max_position_embeddings
        )

    def encode(self, sentences: list[str], batch_size: int = 32):
        embeddings: list[np.ndarray] = []
        for batch in generate_batch(sentences, batch_size):
            encodes = self.tokenizer(
                batch,
                padding=True,
                truncation=True,
                return_tensors='pt',
                return_attention_mask=True,
                max_length=self.max_length,
            )

            input_ids = encodes['input_ids']
            input_ids = input_ids.to(self.embedder.encoder.device)

            attention_mask = encodes['attention_mask']
            attention_mask = attention_mask.to(self.embedder.encoder.device)

            with torch.inference_mode():
                batch_embeddings = self.embedder(input_ids, mask=attention_mask)
                if self.normalize:
                    batch_embeddings = torch.nn.functional.normalize(batch_embeddings, dim=-1)
            embeddings.extend([i.cpu().numpy() for i in batch_embeddings])
        return embeddings


# ---- uniem/data.py (ScoredPairCollator) ----
def scored_pair_collate(tokenizer, records, max_length):
    texts = [r[0] for r in records]
    texts_pair = [r[1] for r in records]
    labels = torch.tensor([r[2] for r in records], dtype=torch.float32)
    text_ids = tokenizer(texts, padding=True, max_length=max_length, truncation=True, return_tensors='pt')['input_ids']
    text_pair_ids = tokenizer(texts_pair, padding=True, max_length=max_length, truncation=True,
                              return_tensors='pt')['input_ids']
    return {'text_ids': text_ids, 'text_pair_ids': text_pair_ids, 'labels': labels}


def make_tokenizer():
    words = ("the weather is nice today it is sunny outside how do i reset my password forgot "
             "login a cat sits on mat dog sleeps").split()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(words))
    return BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)


def main():
    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                        initializer_range=0.3)
    encoder = BertModel(config)

    # inference: UniEmbedder.encode on a right-padded batch
    embedder = LastMeanEmbedder(encoder)
    uni = UniEmbedder(embedder, tokenizer, max_length=32)
    sentences = ["how do i reset my password i forgot my login", "the cat sits", "it is sunny"]
    embs = uni.encode(sentences, batch_size=8)
    for s, e in zip(sentences, embs):
        print(f"{s!r}: {np.round(e[:4], 5).tolist()}")

    # training step: EmbedderForScoredPairTrain on ScoredPairCollator output (ids only)
    model = EmbedderForScoredPairTrain(encoder, embedding_strategy='first_last_mean')
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    records = [
        ("the weather is nice today", "it is sunny outside", 1.0),
        ("how do i reset my password", "forgot login", 1.0),
        ("a cat sits on the mat", "the dog sleeps", 0.0),
    ]
    batch = scored_pair_collate(tokenizer, records, max_length=32)
    out = model(**batch)
    print("predict_labels", np.round(out['predict_labels'].detach().numpy(), 5).tolist())
    print("loss", round(out['loss'].item(), 5))


if __name__ == "__main__":
    main()
