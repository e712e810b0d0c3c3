"""bert-as-service: REDUCE_MEAN / REDUCE_MAX pooling ran over the zero-padded positions.

Citation: jina-ai/clip-as-service#93 ("REDUCE_MEAN is calculated without input_mask?"), fixed by
commit c74d2a59 "add mask to reduce mean and reduce max" (+ 4bd732c6, jitter), merged through
jina-ai/clip-as-service#94 (the repository was hanxiao/bert-as-service then); file
bert/extract_features.py, ``model_fn_builder``.

The bug: every request is padded to ``max_seq_len`` (25) with id 0 and input_mask 0, and the
pooled sentence vector was ``tf.reduce_mean(encoder_layer, axis=1)`` /
``tf.reduce_max(encoder_layer, axis=1)`` over all 25 positions of the second-to-last encoder
layer, so the hidden states of the padding rows went into every sentence encoding (and a short
sentence's mean was divided by 25).

The fix: ``masked_reduce_mean`` (sum of ``mul_mask(x, input_mask)`` divided by the mask's sum) and
``masked_reduce_max`` (max of ``minus_mask(x, input_mask)``, padding pushed down by 1e30).

The TF1 graph is ported to torch here: the encoder is transformers' BertModel (tiny config, random
weights) fed ``input_ids``/``input_mask``/``input_type_ids`` exactly as ``convert_lst_to_features``
builds them, ``model.all_encoder_layers`` is its hidden_states[1:], ``pooling_layer=[-2]``.
"""

import sys
from enum import Enum

import torch
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv


class PoolingStrategy(Enum):
    NONE = 0
    REDUCE_MAX = 1
    REDUCE_MEAN = 2
    REDUCE_MEAN_MAX = 3
    FIRST_TOKEN = 4  # corresponds to [CLS] for single sequences
    LAST_TOKEN = 5  # corresponds to [SEP] for single sequences
    CLS_TOKEN = 4  # corresponds to the first token for single seq.
    SEP_TOKEN = 5  # corresponds to the last token for single seq.

    def __str__(self):
        return self.name


def minus_mask(x, mask, offset=1e30):
    """
    masking by subtract a very large number
    :param x: sequence data in the shape of [B, L, D]
    :param mask: 0-1 mask in the shape of [B, L]
    :param offset: very large negative number
    :return: masked x
    """
    return x - (1.0 - mask).unsqueeze(-1) * offset


def mul_mask(x, mask):
    """
    masking by multiply zero
    :param x: sequence data in the shape of [B, L, D]
    :param mask: 0-1 mask in the shape of [B, L]
    :return: masked x
    """
    return x * mask.unsqueeze(-1)


def masked_reduce_max(x, mask):
    return torch.max(minus_mask(x, mask), dim=1).values


def masked_reduce_mean(x, mask, jitter=1e-10):
    return torch.sum(mul_mask(x, mask), dim=1) / (torch.sum(mask, dim=1, keepdim=True) + jitter)


class InputFeatures(object):
    """A single set of features of data."""

    def __init__(self, input_ids, input_mask, input_type_ids):
        self.input_ids = input_ids
        self.input_mask = input_mask
        self.input_type_ids = input_type_ids


class ToyTokenizer(object):
    """Stands in for tokenization.FullTokenizer: a fixed word-level vocab."""

    def __init__(self, vocab_size):
        self.vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3}
        self.vocab_size = vocab_size

    def tokenize(self, text):
        return text.lower().split()

    def convert_tokens_to_ids(self, tokens):
        ids = []
        for t in tokens:
            if t not in self.vocab:
                self.vocab[t] = 4 + (sum(ord(c) * (i + 1) for i, c in enumerate(t)) % (self.vocab_size - 4))
            ids.append(self.vocab[t])
        return ids


def convert_lst_to_features(lst_str, seq_length, tokenizer):
    for text in lst_str:
        tokens_a = tokenizer.tokenize(text)
        # Account for [CLS] and [SEP] with "- 2"
        if len(tokens_a) > seq_length - 2:
            tokens_a = tokens_a[0:(seq_length - 2)]

        tokens = []
        input_type_ids = []
        tokens.append("[CLS]")
        input_type_ids.append(0)
        for token in tokens_a:
            tokens.append(token)
            input_type_ids.append(0)
        tokens.append("[SEP]")
        input_type_ids.append(0)

        input_ids = tokenizer.convert_tokens_to_ids(tokens)

        # The mask has 1 for real tokens and 0 for padding tokens. Only real
        # tokens are attended to.
        input_mask = [1] * len(input_ids)

        # Zero-pad up to the sequence length.
        while len(input_ids) < seq_length:
            input_ids.append(0)
            input_mask.append(0)
            input_type_ids.append(0)

        assert len(input_ids) == seq_length
        yield InputFeatures(input_ids=input_ids, input_mask=input_mask, input_type_ids=input_type_ids)


class _Encoder(object):
    """What ``modeling.BertModel`` exposes to model_fn: ``all_encoder_layers``."""

    def __init__(self, bert, input_ids, input_mask, token_type_ids):
        out = bert(input_ids=input_ids, attention_mask=input_mask, token_type_ids=token_type_ids,
                   output_hidden_states=True)
        self.all_encoder_layers = list(out.hidden_states[1:])


def model_fn_builder(bert, pooling_strategy=PoolingStrategy.REDUCE_MEAN, pooling_layer=[-2]):

    def model_fn(features):
        client_id = features["client_id"]
        input_ids = features["input_ids"]
        input_mask = features["input_mask"]
        input_type_ids = features["input_type_ids"]

        model = _Encoder(bert, input_ids=input_ids, input_mask=input_mask, token_type_ids=input_type_ids)

        all_layers = []
        if len(pooling_layer) == 1:
            encoder_layer = model.all_encoder_layers[pooling_layer[0]]
        else:
            for layer in pooling_layer:
                all_layers.append(model.all_encoder_layers[layer])
            encoder_layer = torch.cat(all_layers, -1)

        input_mask = input_mask.float()
        if FIXED:
            if pooling_strategy == PoolingStrategy.REDUCE_MEAN:
                pooled = masked_reduce_mean(encoder_layer, input_mask)
            elif pooling_strategy == PoolingStrategy.REDUCE_MAX:
                pooled = masked_reduce_max(encoder_layer, input_mask)
            elif pooling_strategy == PoolingStrategy.REDUCE_MEAN_MAX:
                pooled = torch.cat([masked_reduce_mean(encoder_layer, input_mask),
                                    masked_reduce_max(encoder_layer, input_mask)], dim=1)
            else:
                pooled = None
        else:
            if pooling_strategy == PoolingStrategy.REDUCE_MEAN:
                pooled = torch.mean(encoder_layer, dim=1)
            elif pooling_strategy == PoolingStrategy.REDUCE_MAX:
                pooled = torch.max(encoder_layer, dim=1).values
            elif pooling_strategy == PoolingStrategy.REDUCE_MEAN_MAX:
                pooled = torch.cat([torch.mean(encoder_layer, dim=1),
                                    torch.max(encoder_layer, dim=1).values], dim=1)
            else:
                pooled = None
        if pooled is None:
            if pooling_strategy == PoolingStrategy.FIRST_TOKEN or pooling_strategy == PoolingStrategy.CLS_TOKEN:
                pooled = encoder_layer[:, 0]
            elif pooling_strategy == PoolingStrategy.LAST_TOKEN or pooling_strategy == PoolingStrategy.SEP_TOKEN:
                seq_len = input_mask.sum(dim=1).long()
                rng = torch.arange(0, seq_len.shape[0])
                pooled = encoder_layer[rng, seq_len - 1]
            elif pooling_strategy == PoolingStrategy.NONE:
                pooled = encoder_layer
            else:
                raise NotImplementedError()

        return {"client_id": client_id, "encodes": pooled}

    return model_fn


def main():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, type_vocab_size=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    bert = BertModel(config, add_pooling_layer=False).eval()
    tokenizer = ToyTokenizer(config.vocab_size)
    max_seq_len = 25

    queries = [
        "how are you",
        "how are you doing today my friend",
        "the cat sat on the mat near the door of the old house",
        "first do it",
    ]
    feats = list(convert_lst_to_features(queries, max_seq_len, tokenizer))
    features = {
        "client_id": "client-0",
        "input_ids": torch.tensor([f.input_ids for f in feats]),
        "input_mask": torch.tensor([f.input_mask for f in feats]),
        "input_type_ids": torch.tensor([f.input_type_ids for f in feats]),
    }

    with torch.no_grad():
        for strategy in (PoolingStrategy.REDUCE_MEAN, PoolingStrategy.REDUCE_MAX):
            model_fn = model_fn_builder(bert, pooling_strategy=strategy, pooling_layer=[-2])
            encodes = model_fn(features)["encodes"]
            normed = torch.nn.functional.normalize(encodes, dim=-1)
            sims = normed @ normed.t()
            print(f"pooling_strategy={strategy} encodes.shape={tuple(encodes.shape)}")
            for q, row, sim in zip(queries, encodes, sims):
                print(f"  {q[:28]:<28s} |v|={row.norm():.4f} v[:4]={[round(x, 4) for x in row[:4].tolist()]}"
                      f" cos={[round(x, 3) for x in sim.tolist()]}")
            print(f"  top match for query 0 (excluding itself): {int(sims[0, 1:].argmax()) + 1}")


if __name__ == "__main__":
    main()
