"""Correct program (quiet batch quiet-r125b): an AllenNLP BasicClassifier fine-tuned on SNLI pairs with a BERT
embedder and an averaged bag-of-embeddings pooler (mean over the real wordpieces of both sentences).

Ported from allenai/allennlp @80fb6061e568cb9d6ab5d45b661e86eb61b92c82:
  allennlp/data/tokenizers/pretrained_transformer_tokenizer.py (_reverse_engineer_special_tokens, tokenize with
      add_special_tokens=False, add_special_tokens(tokens1, tokens2) setting the pair's type ids),
  allennlp/data/token_indexers/pretrained_transformer_indexer.py (tokens_to_indices, as_padded_tensor_dict:
      token_ids padded with the pad id, mask with False, type_ids with 0, all on the right),
  allennlp/modules/text_field_embedders/basic_text_field_embedder.py (embedder(**tensors)),
  allennlp/modules/token_embedders/pretrained_transformer_embedder.py (forward: type_ids dropped when all zero,
      attention_mask=mask.float(), last_hidden_state),
  allennlp/modules/seq2vec_encoders/boe_encoder.py (BagOfEmbeddingsEncoder, averaged=True),
  allennlp/nn/util.py (get_text_field_mask, get_lengths_from_binary_sequence_mask),
  allennlp/models/basic_classifier.py (BasicClassifier.forward, dropout before the classification layer);
and allenai/allennlp-models @0700e5fc9d65626d7d50ae6af9c99c32814ad100:
  allennlp_models/pair_classification/dataset_readers/snli.py (SnliReader.text_to_instance with
      combine_input_fields: one "tokens" field, [CLS] premise [SEP] hypothesis [SEP]).
The transformer is a tiny BertModel from a BertConfig (random weights) with a BERT WordPiece tokenizer built from
an in-memory vocab, so nothing is downloaded.

Checks (float64): with dropout off, a batch's loss and gradients equal the mean over the pairs each run alone (no
padding), and the pooled vectors equal a by-hand mean over each pair's real wordpieces; after a few training steps
with dropout on, the evaluation pass (model.eval(), dropout off) gives each padded pair the logits of the pair alone.
"""

import copy
import dataclasses
from typing import Dict, List, Optional

import torch
from transformers import BertConfig, BertModel, BertTokenizer

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

WORDS = (
    "a the man woman dog cat child is are was on in at park street sofa sleeping running playing eating "
    "outside inside red blue ball food nobody someone two people near with".split()
)
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
LABELS = ["entailment", "contradiction", "neutral"]

SNLI = [
    ("a man is playing with a red ball in the park", "a man is playing outside", "entailment"),
    ("two people are eating", "nobody is eating", "contradiction"),
    ("a dog is sleeping on the sofa", "a dog is inside", "entailment"),
    ("a child is running on the street near a blue ball", "a child is playing", "neutral"),
    ("the cat is eating food", "the cat is sleeping", "contradiction"),
    ("a woman is at the park with two dogs", "someone is outside", "entailment"),
    ("people are running", "a man is running in the park with a red ball near the street", "neutral"),
    ("a cat", "a dog is sleeping", "contradiction"),
]


# --- allennlp/data/tokenizers -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Token:
    text: Optional[str] = None
    text_id: Optional[int] = None
    type_id: Optional[int] = None


class PretrainedTransformerTokenizer:
    def __init__(self, tokenizer, add_special_tokens: bool = True, max_length: Optional[int] = None) -> None:
        self.tokenizer = tokenizer
        self._add_special_tokens = add_special_tokens
        self._max_length = max_length
        self._reverse_engineer_special_tokens("a", "b")

    def _reverse_engineer_special_tokens(self, token_a: str, token_b: str):
        self.sequence_pair_start_tokens = []
        self.sequence_pair_mid_tokens = []
        self.sequence_pair_end_tokens = []
        self.sequence_pair_first_token_type_id = None
        self.sequence_pair_second_token_type_id = None
        self.single_sequence_start_tokens = []
        self.single_sequence_end_tokens = []
        self.single_sequence_token_type_id = None

        dummy_output = self.tokenizer(
            token_a, token_b, add_special_tokens=True, return_token_type_ids=True, return_attention_mask=False
        )
        dummy_a = self.tokenizer.encode(token_a, add_special_tokens=False)[0]
        dummy_b = self.tokenizer.encode(token_b, add_special_tokens=False)[0]
        seen_dummy_a = False
        seen_dummy_b = False
        for token_id, token_type_id in zip(dummy_output["input_ids"], dummy_output["token_type_ids"]):
            if token_id == dummy_a:
                seen_dummy_a = True
                self.sequence_pair_first_token_type_id = token_type_id
                continue
            if token_id == dummy_b:
                seen_dummy_b = True
                self.sequence_pair_second_token_type_id = token_type_id
                continue
            token = Token(self.tokenizer.convert_ids_to_tokens(token_id), text_id=token_id, type_id=token_type_id)
            if not seen_dummy_a:
                self.sequence_pair_start_tokens.append(token)
            elif not seen_dummy_b:
                self.sequence_pair_mid_tokens.append(token)
            else:
                self.sequence_pair_end_tokens.append(token)

        dummy_output = self.tokenizer(
            token_a, add_special_tokens=True, return_token_type_ids=True, return_attention_mask=False
        )
        seen_dummy_a = False
        for token_id, token_type_id in zip(dummy_output["input_ids"], dummy_output["token_type_ids"]):
            if token_id == dummy_a:
                seen_dummy_a = True
                self.single_sequence_token_type_id = token_type_id
                continue
            token = Token(self.tokenizer.convert_ids_to_tokens(token_id), text_id=token_id, type_id=token_type_id)
            if not seen_dummy_a:
                self.single_sequence_start_tokens.append(token)
            else:
                self.single_sequence_end_tokens.append(token)

    def tokenize(self, text: str) -> List[Token]:
        encoded_tokens = self.tokenizer(
            text=text,
            add_special_tokens=True,
            return_attention_mask=False,
            return_token_type_ids=True,
            return_special_tokens_mask=True,
        )
        tokens = []
        for token_id, token_type_id, special_token_mask in zip(
            encoded_tokens["input_ids"], encoded_tokens["token_type_ids"], encoded_tokens["special_tokens_mask"]
        ):
            if not self._add_special_tokens and special_token_mask == 1:
                continue
            tokens.append(
                Token(
                    text=self.tokenizer.convert_ids_to_tokens(token_id, skip_special_tokens=False),
                    text_id=token_id,
                    type_id=token_type_id,
                )
            )
        return tokens

    def add_special_tokens(self, tokens1: List[Token], tokens2: Optional[List[Token]] = None) -> List[Token]:
        def with_new_type_id(tokens: List[Token], type_id: int) -> List[Token]:
            return [dataclasses.replace(t, type_id=type_id) for t in tokens]

        tokens2 = copy.deepcopy(tokens2)
        if tokens2 is None:
            return (
                self.single_sequence_start_tokens
                + with_new_type_id(tokens1, self.single_sequence_token_type_id)
                + self.single_sequence_end_tokens
            )
        return (
            self.sequence_pair_start_tokens
            + with_new_type_id(tokens1, self.sequence_pair_first_token_type_id)
            + self.sequence_pair_mid_tokens
            + with_new_type_id(tokens2, self.sequence_pair_second_token_type_id)
            + self.sequence_pair_end_tokens
        )


# --- allennlp/data/token_indexers/pretrained_transformer_indexer.py ---------------------------------------------


def pad_sequence_to_length(sequence, desired_length, default_value=lambda: 0):
    padded_sequence = list(sequence)[:desired_length]
    padded_sequence = padded_sequence + [default_value() for _ in range(desired_length - len(padded_sequence))]
    return padded_sequence


class PretrainedTransformerIndexer:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def tokens_to_indices(self, tokens: List[Token]) -> Dict[str, list]:
        indices: List[int] = []
        type_ids: List[int] = []
        for token in tokens:
            indices.append(
                token.text_id if token.text_id is not None else self._tokenizer.convert_tokens_to_ids(token.text)
            )
            type_ids.append(token.type_id if token.type_id is not None else 0)
        # The mask has 1 for real tokens and 0 for padding tokens. Only real tokens are attended to.
        return {"token_ids": indices, "mask": [True] * len(indices), "type_ids": type_ids or [0] * len(indices)}

    def as_padded_tensor_dict(self, tokens: Dict[str, list], padding_lengths: Dict[str, int]):
        tensor_dict = {}
        for key, val in tokens.items():
            if key == "type_ids":
                padding_value = 0
                mktensor = torch.LongTensor
            elif key == "mask" or key == "wordpiece_mask":
                padding_value = False
                mktensor = torch.BoolTensor
            else:
                padding_value = self._tokenizer.pad_token_id
                if padding_value is None:
                    padding_value = 0
                mktensor = torch.LongTensor
            tensor_dict[key] = mktensor(
                pad_sequence_to_length(val, padding_lengths[key], default_value=lambda: padding_value)
            )
        return tensor_dict


# --- allennlp_models/pair_classification/dataset_readers/snli.py + batching --------------------------------------


class SnliReader:
    def __init__(self, tokenizer: PretrainedTransformerTokenizer, token_indexers) -> None:
        self._tokenizer = tokenizer
        assert not self._tokenizer._add_special_tokens
        self._token_indexers = token_indexers
        self._combine_input_fields = True

    def text_to_instance(self, premise: str, hypothesis: str, label: str = None):
        premise = self._tokenizer.tokenize(premise)
        hypothesis = self._tokenizer.tokenize(hypothesis)
        fields = {}
        if self._combine_input_fields:
            tokens = self._tokenizer.add_special_tokens(premise, hypothesis)
            fields["tokens"] = {name: idx.tokens_to_indices(tokens) for name, idx in self._token_indexers.items()}
        if label:
            fields["label"] = LABELS.index(label)
        return fields


def batch_instances(instances, token_indexers):
    """Batch.as_tensor_dict: every TextField padded (on the right) to the batch's longest one."""
    tokens = {}
    for name, indexer in token_indexers.items():
        keys = instances[0]["tokens"][name]
        lengths = {key: max(len(inst["tokens"][name][key]) for inst in instances) for key in keys}
        padded = [indexer.as_padded_tensor_dict(inst["tokens"][name], lengths) for inst in instances]
        tokens[name] = {key: torch.stack([p[key] for p in padded]) for key in padded[0]}
    batch = {"tokens": tokens}
    if "label" in instances[0]:
        batch["label"] = torch.tensor([inst["label"] for inst in instances])
    return batch


# --- allennlp/nn/util.py ------------------------------------------------------------------------------------------


def get_text_field_mask(text_field_tensors, num_wrapping_dims: int = 0, padding_id: int = 0) -> torch.BoolTensor:
    masks = []
    for indexer_name, indexer_tensors in text_field_tensors.items():
        if "mask" in indexer_tensors:
            masks.append(indexer_tensors["mask"].bool())
    if len(masks) == 1:
        return masks[0]
    raise ValueError("found two mask outputs; not sure which to use!")


def get_lengths_from_binary_sequence_mask(mask: torch.BoolTensor) -> torch.LongTensor:
    return mask.sum(-1)


# --- allennlp/modules ---------------------------------------------------------------------------------------------


class PretrainedTransformerEmbedder(torch.nn.Module):
    def __init__(self, transformer_model, train_parameters: bool = True) -> None:
        super().__init__()
        self.transformer_model = transformer_model
        self.config = self.transformer_model.config
        self.output_dim = self.config.hidden_size
        self.train_parameters = train_parameters
        if not train_parameters:
            for param in self.transformer_model.parameters():
                param.requires_grad = False

    def get_output_dim(self):
        return self.output_dim

    def _number_of_token_type_embeddings(self):
        return getattr(self.config, "type_vocab_size", 0)

    def forward(self, token_ids, mask, type_ids=None, segment_concat_mask=None):
        if type_ids is not None:
            max_type_id = type_ids.max()
            if max_type_id == 0:
                type_ids = None
            else:
                if max_type_id >= self._number_of_token_type_embeddings():
                    raise ValueError("Found type ids too large for the chosen transformer model.")
                assert token_ids.shape == type_ids.shape

        transformer_mask = mask
        # We call this with kwargs because some of the huggingface models don't have the
        # token_type_ids parameter and fail even when it's given as None.
        # Also, as of transformers v2.5.1, they are taking FloatTensor masks.
        parameters = {"input_ids": token_ids, "attention_mask": transformer_mask.float()}
        if type_ids is not None:
            parameters["token_type_ids"] = type_ids

        transformer_output = self.transformer_model(**parameters)
        return transformer_output.last_hidden_state


class BasicTextFieldEmbedder(torch.nn.Module):
    def __init__(self, token_embedders: Dict[str, torch.nn.Module]) -> None:
        super().__init__()
        self._token_embedders = token_embedders
        self._ordered_embedder_keys = sorted(token_embedders.keys())
        for key, embedder in token_embedders.items():
            self.add_module("token_embedder_%s" % key, embedder)

    def get_output_dim(self) -> int:
        return sum(embedder.get_output_dim() for embedder in self._token_embedders.values())

    def forward(self, text_field_input) -> torch.Tensor:
        embedded_representations = []
        for key in self._ordered_embedder_keys:
            embedder = getattr(self, "token_embedder_{}".format(key))
            tensors: Dict[str, torch.Tensor] = text_field_input[key]
            embedded_representations.append(embedder(**tensors))
        return torch.cat(embedded_representations, dim=-1)


class BagOfEmbeddingsEncoder(torch.nn.Module):
    def __init__(self, embedding_dim: int, averaged: bool = False) -> None:
        super().__init__()
        self._embedding_dim = embedding_dim
        self._averaged = averaged

    def get_output_dim(self) -> int:
        return self._embedding_dim

    def forward(self, tokens: torch.Tensor, mask: torch.BoolTensor = None):
        if mask is not None:
            tokens = tokens * mask.unsqueeze(-1)

        # Our input has shape `(batch_size, num_tokens, embedding_dim)`, so we sum out the `num_tokens`
        # dimension.
        summed = tokens.sum(1)

        if self._averaged:
            if mask is not None:
                lengths = get_lengths_from_binary_sequence_mask(mask)
                length_mask = lengths > 0

                # Set any length 0 to 1, to avoid dividing by zero.
                lengths = torch.max(lengths, lengths.new_ones(1))
            else:
                lengths = tokens.new_full((1,), fill_value=tokens.size(1))
                length_mask = None

            summed = summed / lengths.unsqueeze(-1).float()

            if length_mask is not None:
                summed = summed * (length_mask > 0).unsqueeze(-1)

        return summed


# --- allennlp/models/basic_classifier.py --------------------------------------------------------------------------


class BasicClassifier(torch.nn.Module):
    def __init__(self, text_field_embedder, seq2vec_encoder, dropout: float = None, num_labels: int = None) -> None:
        super().__init__()
        self._text_field_embedder = text_field_embedder
        self._seq2seq_encoder = None
        self._seq2vec_encoder = seq2vec_encoder
        self._feedforward = None
        self._classifier_input_dim = self._seq2vec_encoder.get_output_dim()
        if dropout:
            self._dropout = torch.nn.Dropout(dropout)
        else:
            self._dropout = None
        self._num_labels = num_labels
        self._classification_layer = torch.nn.Linear(self._classifier_input_dim, self._num_labels)
        self._loss = torch.nn.CrossEntropyLoss()

    def forward(self, tokens, label: torch.IntTensor = None) -> Dict[str, torch.Tensor]:
        embedded_text = self._text_field_embedder(tokens)
        mask = get_text_field_mask(tokens)

        if self._seq2seq_encoder:
            embedded_text = self._seq2seq_encoder(embedded_text, mask=mask)

        embedded_text = self._seq2vec_encoder(embedded_text, mask=mask)

        if self._dropout:
            embedded_text = self._dropout(embedded_text)

        if self._feedforward is not None:
            embedded_text = self._feedforward(embedded_text)

        logits = self._classification_layer(embedded_text)
        probs = torch.nn.functional.softmax(logits, dim=-1)

        output_dict = {"logits": logits, "probs": probs}
        if label is not None:
            loss = self._loss(logits, label.long().view(-1))
            output_dict["loss"] = loss
        return output_dict


# --- the run ------------------------------------------------------------------------------------------------------


def main():
    hf_tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)})
    tokenizer = PretrainedTransformerTokenizer(hf_tokenizer, add_special_tokens=False)
    token_indexers = {"tokens": PretrainedTransformerIndexer(hf_tokenizer)}
    reader = SnliReader(tokenizer, token_indexers)
    instances = [reader.text_to_instance(p, h, y) for p, h, y in SNLI]

    config = BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
        pad_token_id=hf_tokenizer.pad_token_id,
    )
    bert = BertModel(config, add_pooling_layer=False)
    embedder = BasicTextFieldEmbedder({"tokens": PretrainedTransformerEmbedder(bert)})
    model = BasicClassifier(
        embedder, BagOfEmbeddingsEncoder(embedder.get_output_dim(), averaged=True), dropout=0.1, num_labels=len(LABELS)
    )

    batch = batch_instances(instances, token_indexers)
    ids = batch["tokens"]["tokens"]
    assert ids["mask"].sum(-1).min() < ids["mask"].size(1)  # some pairs are padded
    assert ids["type_ids"].max() == 1

    # 1. A training step's loss and gradients, dropout off, equal the mean over the pairs run alone.
    model.eval()
    out = model(**batch)
    out["loss"].backward()
    with torch.no_grad():
        pooled = model._seq2vec_encoder(
            model._text_field_embedder(batch["tokens"]), mask=get_text_field_mask(batch["tokens"])
        )
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone_loss = 0.0
    alone_grads = {n: torch.zeros_like(g) for n, g in grads.items()}
    for i, inst in enumerate(instances):
        single = batch_instances([inst], token_indexers)
        one = model(**single)
        (one["loss"] / len(instances)).backward()
        alone_loss = alone_loss + one["loss"].item() / len(instances)
        for n, p in model.named_parameters():
            if p.grad is not None:
                alone_grads[n] += p.grad
        model.zero_grad()
        # the pooled vector is the mean over the pair's real wordpieces, special tokens included
        hidden = bert(
            input_ids=single["tokens"]["tokens"]["token_ids"],
            token_type_ids=single["tokens"]["tokens"]["type_ids"],
        ).last_hidden_state[0]
        torch.testing.assert_close(pooled[i], hidden.mean(0), rtol=0, atol=1e-10)
    assert abs(out["loss"].item() - alone_loss) < 1e-10, (out["loss"].item(), alone_loss)
    for n in grads:
        torch.testing.assert_close(grads[n], alone_grads[n], rtol=0, atol=1e-10)

    # 2. Fine-tune a few steps with dropout on (batches of 4, shuffled).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for epoch in range(3):
        order = torch.randperm(len(instances)).tolist()
        for start in range(0, len(order), 4):
            train_batch = batch_instances([instances[j] for j in order[start : start + 4]], token_indexers)
            optimizer.zero_grad()
            loss = model(**train_batch)["loss"]
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}: last batch loss {loss.item():.4f}")

    # 3. Evaluation pass, dropout off: each padded pair gets the logits of the pair alone.
    model.eval()
    with torch.no_grad():
        evaluated = model(**batch)
        for i, inst in enumerate(instances):
            alone = model(**batch_instances([inst], token_indexers))
            torch.testing.assert_close(evaluated["logits"][i], alone["logits"][0], rtol=0, atol=1e-10)
    accuracy = (evaluated["logits"].argmax(-1) == batch["label"]).double().mean().item()
    print(f"eval loss {evaluated['loss'].item():.4f}, accuracy {accuracy:.3f}; batched logits match pairs run alone")


if __name__ == "__main__":
    main()
