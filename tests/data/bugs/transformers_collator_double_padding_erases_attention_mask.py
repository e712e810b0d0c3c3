"""transformers tokenizer.pad: padding already-padded samples again erased their attention mask (#8915).

Citation: huggingface/transformers#8915 ("Avoid erasing the attention mask when double padding",
sgugger, merged 2020-12-03). The PR description shows the bug: ``tokenizer(..., padding=
"max_length", max_length=32)`` gives a mask ending in zeros, and ``tokenizer.pad(inputs,
padding="max_length", max_length=32)`` on that output gives all ones. The PR text says this is
what ``DataCollatorWithPadding`` (the Trainer's default collator) does to samples that were
already padded. I did not see the diff; the branch replaced below is the one the description
implies in ``PreTrainedTokenizerBase._pad`` of v4.0 (``else: if return_attention_mask: mask =
[1] * len``), and the fixed form is the one v4.1+ carries (``elif return_attention_mask and
"attention_mask" not in encoded_inputs``).

Bug: when no more padding was needed, ``_pad`` rebuilt ``attention_mask`` as all ones over
the whole (already padded) row, so the padding tokens became real keys for the model.

Fix: keep an existing ``attention_mask`` when the row needs no padding.

Reproduction: the v4.0 pad path on a toy word-level tokenizer (pad id 0), a dataset mapped
with ``padding="max_length", max_length=8`` as the run_glue example does, the default
``DataCollatorWithPadding`` padding the batch again, and a small BertForSequenceClassification
built from a BertConfig with random weights (SDPA attention) that gets the collated batch.
"""
import sys
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import BertConfig, BertForSequenceClassification

FIXED = "--fixed" in sys.argv


class ToyWordTokenizer:
    """Just the parts of PreTrainedTokenizerBase (v4.0) that encode and pad."""

    model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
    padding_side = "right"
    pad_token_id = 0
    pad_token_type_id = 0

    def __init__(self, words):
        self.vocab = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2}
        for w in words:
            self.vocab.setdefault(w, len(self.vocab))

    def __call__(self, text, padding=False, max_length=None):
        ids = [1] + [self.vocab[w] for w in text.split()] + [2]
        encoded = {"input_ids": ids, "token_type_ids": [0] * len(ids)}
        strategy = "max_length" if padding == "max_length" else "do_not_pad"
        return self._pad(encoded, max_length=max_length, padding_strategy=strategy)

    def pad(self, encoded_inputs, padding=True, max_length=None, return_tensors=None):
        # a list of dicts -> a dict of lists, as PreTrainedTokenizerBase.pad does
        encoded_inputs = {key: [example[key] for example in encoded_inputs] for key in encoded_inputs[0].keys()}
        required_input = encoded_inputs[self.model_input_names[0]]
        strategy = "longest" if padding is True or padding == "longest" else padding
        if strategy == "longest":
            max_length = max(len(inputs) for inputs in required_input)
            strategy = "max_length"
        batch_outputs = {}
        for i in range(len(required_input)):
            inputs = dict((k, v[i]) for k, v in encoded_inputs.items())
            outputs = self._pad(inputs, max_length=max_length, padding_strategy=strategy)
            for key, value in outputs.items():
                batch_outputs.setdefault(key, []).append(value)
        if return_tensors == "pt":
            batch_outputs = {k: torch.tensor(v) for k, v in batch_outputs.items()}
        return batch_outputs

    def _pad(self, encoded_inputs, max_length=None, padding_strategy="do_not_pad",
             return_attention_mask: Optional[bool] = None):
        # Load from model defaults
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        required_input = encoded_inputs[self.model_input_names[0]]
        needs_to_be_padded = padding_strategy != "do_not_pad" and len(required_input) != max_length

        if needs_to_be_padded:
            difference = max_length - len(required_input)
            if return_attention_mask:
                encoded_inputs["attention_mask"] = [1] * len(required_input) + [0] * difference
            if "token_type_ids" in encoded_inputs:
                encoded_inputs["token_type_ids"] = encoded_inputs["token_type_ids"] + [self.pad_token_type_id] * difference
            encoded_inputs[self.model_input_names[0]] = required_input + [self.pad_token_id] * difference
        elif FIXED:
            if return_attention_mask and "attention_mask" not in encoded_inputs:
                encoded_inputs["attention_mask"] = [1] * len(required_input)
        else:
            if return_attention_mask:
                encoded_inputs["attention_mask"] = [1] * len(required_input)
        return encoded_inputs


@dataclass
class DataCollatorWithPadding:
    tokenizer: ToyWordTokenizer
    padding: bool = True
    max_length: Optional[int] = None

    def __call__(self, features):
        labels = [f.pop("label") for f in features]
        batch = self.tokenizer.pad(features, padding=self.padding, max_length=self.max_length, return_tensors="pt")
        batch["labels"] = torch.tensor(labels)
        return batch


def main():
    torch.manual_seed(0)
    raw = [("the movie was great fun", 1), ("dull", 0), ("not my kind of film", 0)]
    tokenizer = ToyWordTokenizer(" ".join(t for t, _ in raw).split())
    # preprocess_function of run_glue with --pad_to_max_length
    train_dataset = []
    for text, label in raw:
        example = tokenizer(text, padding="max_length", max_length=8)
        example["label"] = label
        train_dataset.append(example)

    config = BertConfig(vocab_size=len(tokenizer.vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16, pad_token_id=tokenizer.pad_token_id,
                        num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config._attn_implementation = "sdpa"
    model = BertForSequenceClassification(config).eval()

    batch = DataCollatorWithPadding(tokenizer)(train_dataset)
    with torch.no_grad():
        out = model(**batch)
    print("attention_mask row sums", batch["attention_mask"].sum(-1).tolist(), "loss", round(float(out.loss), 6), "logits[1]", [round(float(x), 5) for x in out.logits[1]])


if __name__ == "__main__":
    main()
