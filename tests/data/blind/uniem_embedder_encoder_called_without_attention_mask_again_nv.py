# Citation: wangyuxinwhy/uniem#23 (commit ba0a8e4, "fix:attention mask bug"); buggy parent ba0a8e4^.
# Upstream: uniem/model.py (creat_mask_from_input_ids, mean_pooling, LastMeanEmbedder, ClsEmbedder,
#   EmbedderForPairInBatchNegTrain, UniEmbedder.encode), uniem/criteria.py
#   (PairInBatchNegSoftmaxContrastLoss), uniem/utils.py (generate_batch).
# Bug: the embedders built a padding mask (input_ids != pad_token_id) or received the tokenizer's
#   attention_mask, but used it only for mean pooling: the BERT encoder itself was called as
#   `self.encoder(input_ids)`, so every real token of a right-padded sentence attended to the
#   [PAD] positions of the batch (ClsEmbedder never used the mask at all).
# Fix: the mask is renamed attention_mask, built from the pad id when absent, and passed to the
#   encoder: `self.encoder(input_ids, attention_mask=attention_mask)`.
# Port notes: the M3E-style BERT encoder is a tiny BertModel from BertConfig (random weights);
#   the HF tokenizer is replaced by a tiny whitespace tokenizer that pads on the right with id 0
#   and returns input_ids / attention_mask like `tokenizer(batch, padding=True, ...)`.
import sys
from enum import Enum
from itertools import islice
from typing import ClassVar, Type

import numpy as np
import torch
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- uniem/utils.py
def generate_batch(data, batch_size: int = 32):
    iterator = iter(data)
    while batch := list(islice(iterator, batch_size)):
        yield batch


# ---------------------------------------------------------------- uniem/criteria.py
class ContrastLoss(torch.nn.Module):
    def __init__(self, temperature: float = 0.05):
        super().__init__()
        self.temperature = temperature


class PairInBatchNegSoftmaxContrastLoss(ContrastLoss):
    def __init__(self, temperature: float = 0.05):
        super().__init__()
        self.temperature = temperature
        self._cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, text_embeddings: torch.Tensor, text_pos_embeddings: torch.Tensor) -> torch.Tensor:
        sim_matrix = torch.cosine_similarity(
            text_embeddings.unsqueeze(1),
            text_pos_embeddings.unsqueeze(0),
            dim=-1,
        )
        sim_matrix = sim_matrix / self.temperature
        labels = torch.arange(sim_matrix.size(0), device=text_embeddings.device, dtype=torch.long)
        loss = self._cross_entropy_loss(sim_matrix, labels)
        return loss


# ---------------------------------------------------------------- uniem/model.py
class PoolingStrategy(str, Enum):
    cls = 'cls'
    last_mean = 'last_mean'


def creat_attention_mask_from_input_ids(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    return input_ids != pad_token_id


def mean_pooling(hidden_state: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    if attention_mask is None:
        return torch.mean(hidden_state, dim=1)
    attention_mask = attention_mask.float()
    return torch.sum(hidden_state * attention_mask.unsqueeze(-1), dim=1) / torch.sum(attention_mask, dim=-1, keepdim=True)


StrategyEmbedderClsMap: dict = {}


class Embedder(torch.nn.Module):
    pooling_strategy: ClassVar[PoolingStrategy]

    def __init__(self, encoder, pad_token_id: int | None = None):
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

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class LastMeanEmbedder(Embedder):
    pooling_strategy: ClassVar[PoolingStrategy] = PoolingStrategy.last_mean

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = creat_attention_mask_from_input_ids(input_ids, self.pad_token_id)
        if FIXED:
            embeddings = self.encoder(input_ids, attention_mask=attention_mask).last_hidden_state
        else:
            embeddings = self.encoder(input_ids).last_hidden_state
        embeddings = mean_pooling(embeddings, attention_mask)
        return embeddings


class ClsEmbedder(Embedder):
    pooling_strategy: ClassVar[PoolingStrategy] = PoolingStrategy.cls

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if FIXED:
            if attention_mask is None:
                attention_mask = creat_attention_mask_from_input_ids(input_ids, self.pad_token_id)
            embeddings = self.encoder(input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        else:
            embeddings = self.encoder(input_ids).last_hidden_state[:, 0]
        return embeddings


class EmbedderForTrain(torch.nn.Module):
    def __init__(self, embedder: Embedder):
        super().__init__()
        self.embedder = embedder


class EmbedderForPairInBatchNegTrain(EmbedderForTrain):
    def __init__(self, pretrained_model, temperature: float | None = None,
                 embedding_strategy: PoolingStrategy | str = PoolingStrategy.last_mean):
        embedder = StrategyEmbedderClsMap[PoolingStrategy(embedding_strategy)](pretrained_model)
        super().__init__(embedder)
        temperature = temperature or 0.05
        self.criterion = PairInBatchNegSoftmaxContrastLoss(temperature)

    def forward(self, text_ids: torch.Tensor, text_pos_ids: torch.Tensor) -> dict:
        text_embeddings = self.embedder(text_ids)
        text_pos_embeddings = self.embedder(text_pos_ids)
        loss = self.criterion(text_embeddings, text_pos_embeddings)
        return {'loss': loss}


class UniEmbedder:
    def __init__(self, embedder: Embedder, tokenizer, normalize: bool = True, max_length: int | None = None):
        self.embedder = embedder.eval()
        self.tokenizer = tokenizer
        self.normalize = normalize
        self.max_length = max_length or self.embedder.encoder.config.max_position_embeddings

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
            attention_mask = encodes['attention_mask']
            with torch.inference_mode():
                batch_embeddings = self.embedder(input_ids, attention_mask=attention_mask)
                if self.normalize:
                    batch_embeddings = torch.nn.functional.normalize(batch_embeddings, dim=-1)
            embeddings.extend([i.cpu().numpy() for i in batch_embeddings])
        return embeddings


# ---------------------------------------------------------------- tokenizer stand-in
class TinyTokenizer:
    """[CLS] w1 w2 ... [SEP], right-padded with [PAD]=0, as a BERT tokenizer with padding=True."""

    pad_token_id, cls_token_id, sep_token_id = 0, 1, 2

    def __init__(self):
        self.vocab = {}

    def _ids(self, text):
        return [self.vocab.setdefault(w, 3 + len(self.vocab)) for w in text.split()]

    def __call__(self, batch, padding=True, truncation=True, return_tensors='pt',
                 return_attention_mask=True, max_length=512):
        rows = [[self.cls_token_id] + self._ids(t)[: max_length - 2] + [self.sep_token_id] for t in batch]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([r + [self.pad_token_id] * (width - len(r)) for r in rows])
        attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return {'input_ids': input_ids, 'attention_mask': attention_mask}


def main():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        initializer_range=0.2)
    config._attn_implementation = 'eager'
    encoder = BertModel(config, add_pooling_layer=False).eval()
    tokenizer = TinyTokenizer()

    sentences = [
        'how do i reset my password',
        'reset password',
        'the weather in beijing is sunny today with a light breeze',
        'sunny weather',
    ]

    # inference: UniEmbedder.encode with the default last_mean strategy and with cls
    for strategy in (PoolingStrategy.last_mean, PoolingStrategy.cls):
        embedder = StrategyEmbedderClsMap[strategy](encoder)
        uni = UniEmbedder(embedder, tokenizer)
        embs = np.stack(uni.encode(sentences, batch_size=4))
        sims = embs @ embs.T
        print(f'{strategy.value}: emb[1][:4] = {np.array2string(embs[1][:4], precision=4)}')
        print(f'{strategy.value}: cos(q0, q1) = {sims[0, 1]:.4f}  cos(q2, q3) = {sims[2, 3]:.4f}')

    # training step: EmbedderForPairInBatchNegTrain, ids padded with the pad id, no mask passed
    model = EmbedderForPairInBatchNegTrain(encoder, embedding_strategy='last_mean')
    text = tokenizer([sentences[0], sentences[2]])['input_ids']
    text_pos = tokenizer([sentences[1], sentences[3]])['input_ids']
    with torch.no_grad():
        out = model(text, text_pos)
    print(f"pair in-batch-neg loss = {out['loss'].item():.6f}")


if __name__ == '__main__':
    main()
