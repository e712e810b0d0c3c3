"""transformers TokenClassificationPipeline (NER) run with batch_size > 1: no attention mask in the batch.

Citation: huggingface/transformers#16222 "Attention mask is important in the case of batching..."
(fixes #16221; src/transformers/pipelines/token_classification.py ``preprocess`` and
src/transformers/pipelines/base.py ``pad_collate_fn``, read in the 4.17.0 and 4.18.0 wheels).

Each sentence is tokenized alone in ``preprocess``; when the pipeline batches, ``pad_collate_fn``
right-pads every key of the items to the longest one (``input_ids`` with the tokenizer's pad id)
and ``_forward`` calls ``self.model(**model_inputs)``.

The bug: ``preprocess`` called the tokenizer with ``return_attention_mask=False``, so the padded
batch carried no ``attention_mask`` and the model (BertForTokenClassification) attended to the
[PAD] slots of the shorter sentences: their entity predictions changed with the batch.
The fix: drop ``return_attention_mask=False`` (the mask is then padded with 0 by the collator),
and pad ``special_tokens_mask`` with 1.

Ported with the pipeline's preprocess / pad_collate_fn / _forward / postprocess (aggregation
"none") at toy sizes: a BertTokenizer over a small vocab written to a temporary file and a
BertForTokenClassification built from a tiny BertConfig with random weights.
"""

import os
import sys
import tempfile

import numpy as np
import torch
from transformers import BertConfig, BertForTokenClassification, BertTokenizer

FIXED = "--fixed" in sys.argv


# ---- pipelines/base.py -------------------------------------------------------------------------
def _pad(items, key, padding_value, padding_side):
    batch_size = len(items)
    if isinstance(items[0][key], torch.Tensor):
        # Others include `attention_mask` etc...
        shape = items[0][key].shape
        dim = len(shape)
        if dim == 4:
            # This is probable image so padding shouldn't be necessary
            # B, C, H, W
            return torch.cat([item[key] for item in items], dim=0)
        max_length = max(item[key].shape[1] for item in items)
        dtype = items[0][key].dtype

        if dim == 2:
            tensor = torch.zeros((batch_size, max_length), dtype=dtype) + padding_value
        elif dim == 3:
            tensor = torch.zeros((batch_size, max_length, shape[-1]), dtype=dtype) + padding_value

        for i, item in enumerate(items):
            if dim == 2:
                if padding_side == "left":
                    tensor[i, -len(item[key][0]) :] = item[key][0].clone()
                else:
                    tensor[i, : len(item[key][0])] = item[key][0].clone()
            elif dim == 3:
                if padding_side == "left":
                    tensor[i, -len(item[key][0]) :, :] = item[key][0].clone()
                else:
                    tensor[i, : len(item[key][0]), :] = item[key][0].clone()
        return tensor
    else:
        return [item[key] for item in items]


def pad_collate_fn(tokenizer, feature_extractor):
    t_padding_value = tokenizer.pad_token_id
    padding_side = tokenizer.padding_side

    def inner(items):
        keys = set(items[0].keys())
        for item in items:
            if set(item.keys()) != keys:
                raise ValueError(
                    f"The elements of the batch contain different keys. Cannot batch them ({set(item.keys())} != {keys})"
                )
        # input_values, input_pixels, input_ids, ...
        padded = {}
        for key in keys:
            if key in {"input_ids"}:
                _padding_value = t_padding_value
            elif key in ({"p_mask", "special_tokens_mask"} if FIXED else {"p_mask"}):
                _padding_value = 1
            elif key in {"attention_mask", "token_type_ids"}:
                _padding_value = 0
            else:
                # This is likely another random key maybe even user provided
                _padding_value = 0
            padded[key] = _pad(items, key, _padding_value, padding_side)
        return padded

    return inner


# ---- pipelines/token_classification.py ---------------------------------------------------------
class TokenClassificationPipeline:
    def __init__(self, model, tokenizer, framework="pt"):
        self.model = model
        self.tokenizer = tokenizer
        self.framework = framework

    def preprocess(self, sentence, offset_mapping=None):
        truncation = True if self.tokenizer.model_max_length and self.tokenizer.model_max_length > 0 else False
        if FIXED:
            model_inputs = self.tokenizer(
                sentence,
                return_tensors=self.framework,
                truncation=truncation,
                return_special_tokens_mask=True,
                return_offsets_mapping=self.tokenizer.is_fast,
            )
        else:
            model_inputs = self.tokenizer(
                sentence,
                return_attention_mask=False,
                return_tensors=self.framework,
                truncation=truncation,
                return_special_tokens_mask=True,
                return_offsets_mapping=self.tokenizer.is_fast,
            )
        model_inputs = dict(model_inputs)
        if offset_mapping:
            model_inputs["offset_mapping"] = offset_mapping
        model_inputs["sentence"] = sentence
        return model_inputs

    def _forward(self, model_inputs):
        # Forward
        special_tokens_mask = model_inputs.pop("special_tokens_mask")
        offset_mapping = model_inputs.pop("offset_mapping", None)
        sentence = model_inputs.pop("sentence")
        logits = self.model(**model_inputs)[0]

        return {
            "logits": logits,
            "special_tokens_mask": special_tokens_mask,
            "offset_mapping": offset_mapping,
            "sentence": sentence,
            **model_inputs,
        }

    def postprocess(self, model_outputs, ignore_labels=None):
        if ignore_labels is None:
            ignore_labels = ["O"]
        logits = model_outputs["logits"][0].numpy()
        input_ids = model_outputs["input_ids"][0]
        special_tokens_mask = model_outputs["special_tokens_mask"][0].numpy()

        maxes = np.max(logits, axis=-1, keepdims=True)
        shifted_exp = np.exp(logits - maxes)
        scores = shifted_exp / shifted_exp.sum(axis=-1, keepdims=True)

        entities = []
        for idx, token_scores in enumerate(scores):
            # Filter special_tokens, they should only occur
            # at the sentence boundaries since we're not encoding pairs of
            # sentences so we don't have to keep track of those.
            if special_tokens_mask[idx]:
                continue
            entity_idx = token_scores.argmax()
            entity = self.model.config.id2label[int(entity_idx)]
            if entity in ignore_labels:
                continue
            entities.append({
                "entity": entity,
                "score": float(token_scores[entity_idx]),
                "index": idx,
                "word": self.tokenizer.convert_ids_to_tokens(int(input_ids[idx])),
            })
        return entities

    def __call__(self, sentences, batch_size=1):
        # the pipeline's DataLoader over preprocess, collated by pad_collate_fn, then unbatched
        collate_fn = pad_collate_fn(self.tokenizer, None)
        outputs = []
        for start in range(0, len(sentences), batch_size):
            items = [self.preprocess(s) for s in sentences[start:start + batch_size]]
            batch = collate_fn(items)
            with torch.no_grad():
                model_outputs = self._forward(batch)
            # PipelineIterator.loader_batch_item: slice each batched tensor back to one row
            for i in range(len(items)):
                item = {}
                for k, v in model_outputs.items():
                    if isinstance(v, torch.Tensor):
                        item[k] = v[i].unsqueeze(0)
                    elif isinstance(v, list):
                        item[k] = v[i]
                    else:
                        item[k] = v
                outputs.append(self.postprocess(item, ignore_labels=[]))
        return outputs


VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
         "hello", ",", "i", "have", "influenza", "hepatitis", "is", "a", "known", "problem", "for",
         "many", "nations", "and", "cancer", "diabetes", "the", "patient", "was", "treated", "with",
         "insulin", "."]


def main():
    torch.manual_seed(0)
    vocab_dir = tempfile.mkdtemp()
    vocab_file = os.path.join(vocab_dir, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(VOCAB) + "\n")
    tokenizer = BertTokenizer(vocab=vocab_file, do_lower_case=True)

    config = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        max_position_embeddings=64, num_labels=3,
                        id2label={0: "O", 1: "B-DISEASE", 2: "I-DISEASE"},
                        label2id={"O": 0, "B-DISEASE": 1, "I-DISEASE": 2},
                        attn_implementation="eager")
    model = BertForTokenClassification(config).eval()

    pipeline = TokenClassificationPipeline(model=model, tokenizer=tokenizer)
    sentences = ["hello, i have influenza",
                 "hepatitis is a known problem for many nations , and cancer and diabetes .",
                 "the patient was treated with insulin ."]
    for sentence, entities in zip(sentences, pipeline(sentences, batch_size=3)):
        print(sentence)
        for e in entities:
            print("   {:>10s} {:<10s} {:.6f}".format(e["word"], e["entity"], e["score"]))


if __name__ == "__main__":
    main()
