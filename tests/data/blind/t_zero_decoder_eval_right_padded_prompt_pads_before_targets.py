# Citation: bigscience-workshop/t-zero#29 (also #27), fixed by bigscience-workshop/t-zero#32
#           (commit a961d57704c682a8ef58f56bb9c8a41a8bd8f1a8, "Fix padding side").
# Upstream: evaluation/run_eval.py (tokenizer padding_side, preprocess_function),
#           t0/data_collator.py DataCollatorForMultipleChoice, t0/model.py DecoderModel.forward.
# Bug: the decoder-only rank-classification eval right-padded the prompts and then concatenated
#   the answer-choice tokens after them, so the padding mask is [prompt 1..1, 0..0, target 1..1, 0..0]:
#   pad holes sit between prompt and target, and the logits read at `prefix_length-1:-1` for the
#   first target token come from a pad position, so scores depend on the batch's longest prompt.
# Fix: tokenizer padding_side="left" (pads go before the prompt, targets tokenized without padding
#   and right-padded by the collator) and position_ids = max(cumsum(mask) - 1, 0).
import sys
from dataclasses import dataclass
from itertools import chain
from typing import Optional, Union

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------------------
# Stand-in for AutoTokenizer: word-level vocab, GPT-2 style (no pad token, pad := eos).
# ---------------------------------------------------------------------------
class ToyTokenizer:
    def __init__(self, words, padding_side="right"):
        self.vocab = {"<|endoftext|>": 0}
        for w in words:
            if w not in self.vocab:
                self.vocab[w] = len(self.vocab)
        self.eos_token = "<|endoftext|>"
        self.bos_token = "<|endoftext|>"
        self.sep_token = None
        self.pad_token = None
        self.padding_side = padding_side

    @property
    def pad_token_id(self):
        return self.vocab[self.pad_token]

    def _encode(self, text):
        return [self.vocab[w] for w in text.split()]

    def _pad_one(self, ids, mask, length):
        n = length - len(ids)
        if self.padding_side == "right":
            return ids + [self.pad_token_id] * n, mask + [0] * n
        return [self.pad_token_id] * n + ids, [0] * n + mask

    def __call__(self, texts, padding=False, max_length=None, truncation=False, add_special_tokens=True):
        ids = [self._encode(t) for t in texts]
        if truncation and max_length is not None:
            ids = [x[:max_length] for x in ids]
        masks = [[1] * len(x) for x in ids]
        if padding is True or padding == "longest":
            L = max(len(x) for x in ids)
        elif padding == "max_length":
            L = max_length
        else:
            L = None
        if L is not None:
            pairs = [self._pad_one(i, m, L) for i, m in zip(ids, masks)]
            ids, masks = [p[0] for p in pairs], [p[1] for p in pairs]
        return {"input_ids": ids, "attention_mask": masks}

    def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None):
        L = max(len(f["input_ids"]) for f in features)
        if pad_to_multiple_of is not None and L % pad_to_multiple_of:
            L = (L // pad_to_multiple_of + 1) * pad_to_multiple_of
        out = {k: [] for k in features[0]}
        for f in features:
            ids, mask = self._pad_one(list(f["input_ids"]), list(f["attention_mask"]), L)
            for k in f:
                if k == "input_ids":
                    out[k].append(ids)
                elif k == "attention_mask":
                    out[k].append(mask)
                else:
                    out[k].append(f[k])
        return out


# ---------------------------------------------------------------------------
# t0/data_collator.py
# ---------------------------------------------------------------------------
@dataclass
class DataCollatorForMultipleChoice:
    tokenizer: ToyTokenizer
    padding: Union[bool, str] = True
    max_length: Optional[int] = None
    pad_to_multiple_of: Optional[int] = None

    def __call__(self, features):
        num_choices = len(features[0]["input_ids"])
        flattened_features = [
            [
                {
                    k: v[i]
                    for k, v in feature.items()
                    if k != "targets"
                }
                for i in range(num_choices)
            ]
            for feature in features
        ]
        flattened_features = list(chain(*flattened_features))

        batch = self.tokenizer.pad(
            flattened_features,
            padding=self.padding,
            max_length=self.max_length,
            pad_to_multiple_of=self.pad_to_multiple_of,
        )

        # Pad the labels because it's not padded automatically
        max_label_length = max([len(elem["labels"]) for elem in flattened_features])
        batch["labels"] = [
            l + [self.tokenizer.pad_token_id] * (max_label_length - len(l))
            for l in [elem["labels"] for elem in flattened_features]
        ]
        batch["labels_attention_mask"] = [
            m + [0] * (max_label_length - len(m))
            for m in [elem["labels_attention_mask"] for elem in flattened_features]
        ]

        # Convert to tensors
        batch = {
            k: torch.tensor(v)
            for k, v in batch.items()
        }

        batch["targets"] = torch.tensor([f.pop("targets") for f in features])
        return batch


# ---------------------------------------------------------------------------
# t0/model.py
# ---------------------------------------------------------------------------
class DecoderModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self._model = GPT2LMHeadModel(config)
        self.last_seq_log_prob = None

    def forward(self, batch):
        device = batch["input_ids"].device
        _, prefix_length = batch["input_ids"].shape
        model_inputs = {
            "input_ids": torch.cat([batch["input_ids"], batch["labels"]], dim=-1),
            "attention_mask": torch.cat([batch["attention_mask"], batch["labels_attention_mask"]], dim=-1),
        }
        # Set position ids correctly to take care of padding tokens between inputs_ids and labels
        if FIXED:
            position_ids = torch.maximum(
                torch.cumsum(model_inputs["attention_mask"].to(torch.long), dim=-1) - 1,
                torch.zeros(1, dtype=torch.long, device=device)[None, None]
            )
        else:
            # Empty attention_mask is a forbidden value, ie full of zeros. In fact the first element should be 1 as the input
            #   cannot be empty
            assert torch.all(model_inputs["attention_mask"][:, 0] == 1), "First element in the attention mask should be 1."
            position_ids = torch.cumsum(model_inputs["attention_mask"].to(torch.long), dim=-1) - 1
        model_inputs["position_ids"] = position_ids

        # transformers 4.x (2022) GPT2Model.forward did `position_ids = position_ids.view(-1, input_shape[-1])`,
        # which flattens the (1, B, L) tensor torch.maximum broadcasts to; current GPT2Model no longer does.
        model_inputs["position_ids"] = model_inputs["position_ids"].view(-1, model_inputs["input_ids"].shape[-1])
        logits = self._model(**model_inputs).logits[:, prefix_length - 1:-1]
        masked_log_probs = batch["labels_attention_mask"].unsqueeze(-1) * torch.log_softmax(logits, dim=-1)
        seq_token_log_probs = torch.gather(masked_log_probs, -1, batch["labels"].unsqueeze(-1))
        seq_log_prob = seq_token_log_probs.squeeze(dim=-1).sum(dim=-1)
        seq_log_prob = seq_log_prob.view(batch["targets"].size(0), -1)
        self.last_seq_log_prob = seq_log_prob
        predictions = seq_log_prob.argmax(dim=-1)
        return predictions


# ---------------------------------------------------------------------------
# evaluation/run_eval.py (main, shrunk): prompted multiple-choice eval, batch size 4
# ---------------------------------------------------------------------------
EXAMPLES = [
    ("the cat sat on the mat . is the cat on the mat ?", ["yes", "no", "maybe not"], "yes"),
    ("rain ?", ["yes", "no", "maybe not"], "no"),
    ("a dog ran in the park near the old river bank and then slept . did the dog sleep ?", ["yes", "no", "maybe not"], "yes"),
    ("is it cold ?", ["yes", "no", "maybe not"], "maybe not"),
    ("the sun is hot .", ["yes", "no", "maybe not"], "yes"),
    ("birds can fly over the sea and the hills and the town . can birds fly ?", ["yes", "no", "maybe not"], "yes"),
    ("fish ?", ["yes", "no", "maybe not"], "no"),
    ("we ate bread .", ["yes", "no", "maybe not"], "maybe not"),
]


def main():
    words = sorted({w for p, ch, _ in EXAMPLES for w in (p + " " + " ".join(ch)).split()})
    if FIXED:
        tokenizer = ToyTokenizer(words, padding_side="left")
    else:
        tokenizer = ToyTokenizer(words)
    if tokenizer.pad_token is None:
        for token in [tokenizer.eos_token, tokenizer.bos_token, tokenizer.sep_token]:
            if token is not None:
                tokenizer.pad_token = token

    config = GPT2Config(vocab_size=len(tokenizer.vocab), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tokenizer.vocab[tokenizer.eos_token], eos_token_id=tokenizer.vocab[tokenizer.eos_token])
    config._attn_implementation = "eager"
    model = DecoderModel(config).eval()

    max_length, target_max_length = 32, 8
    padding = False  # args.pad_to_max_length is False

    def preprocess_function(examples):
        bs = len(examples)
        input_texts = [e[0] for e in examples]
        target_texts = [e[2] for e in examples]
        answer_choices_texts = [e[1] for e in examples]

        tokenized_inputs = tokenizer(
            input_texts,
            padding=padding,
            max_length=max_length,
            truncation=True,
            add_special_tokens=False,
        )
        if FIXED:
            tokenized_targets = [
                tokenizer(
                    ans_choi,
                    # padding is on the right here.
                    padding=False,
                    max_length=max_length,
                    truncation=True,
                )
                for ans_choi in answer_choices_texts
            ]
        else:
            tokenized_targets = [
                tokenizer(
                    ans_choi,
                    padding=True,
                    max_length=target_max_length,
                    truncation=True,
                )
                for ans_choi in answer_choices_texts
            ]

        features = {
            k: [
                [elem for _ in range(len(tokenized_targets[idx]["input_ids"]))]
                for idx, elem in enumerate(v)
            ]
            for k, v in tokenized_inputs.items()
        }
        features["labels"] = [tokenized_targets[idx]["input_ids"] for idx in range(bs)]
        features["labels_attention_mask"] = [tokenized_targets[idx]["attention_mask"] for idx in range(bs)]
        features["targets"] = [answer_choices_texts[idx].index(t) for idx, t in enumerate(target_texts)]
        return [{k: features[k][i] for k in features} for i in range(bs)]

    eval_dataset = preprocess_function(EXAMPLES)
    data_collator = DataCollatorForMultipleChoice(tokenizer)
    per_device_eval_batch_size = 4

    correct, total = 0, 0
    all_scores = []
    for start in range(0, len(eval_dataset), per_device_eval_batch_size):
        batch = data_collator([dict(f) for f in eval_dataset[start:start + per_device_eval_batch_size]])
        with torch.no_grad():
            predictions = model(batch)
        all_scores.append(model.last_seq_log_prob)
        correct += (predictions == batch["targets"]).sum().item()
        total += predictions.numel()
        print("predictions", predictions.tolist(), "targets", batch["targets"].tolist())

    scores = torch.cat(all_scores)
    torch.set_printoptions(precision=4, sci_mode=False)
    print("choice log-probs:\n", scores)
    print("Result: {'accuracy': %.4f}" % (correct / total))


if __name__ == "__main__":
    main()
