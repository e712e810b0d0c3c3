# Citation: axolotl-ai-cloud/axolotl#131 ("fix packing so that concatenated sequences reset the attention",
#   fixes issue #128), commit 9b8585dc7 (merged as 5079753b7).
# Upstream: src/axolotl/datasets.py ConstantLengthDataset.__iter__ (packing of tokenized prompts into one
#   seq_length row; the packed attention_mask is the concatenation of each example's mask).
# Bug: every packed example kept its tokenizer attention_mask of all ones, so the BOS token that opens the
#   2nd, 3rd, ... example in a packed row was an ordinary attended key for everything after it.
# Fix: when the buffer already holds an example and the new example starts with bos_token_id, set that
#   example's attention_mask[0] = 0 before it is appended to the packed row.
import sys
from typing import List

import torch
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


class TinyTokenizer:
    """Stand-in for the llama tokenizer: only the ids ConstantLengthDataset reads."""

    bos_token_id = 1
    eos_token_id = 2
    pad_token_id = 0

    def get_vocab(self):
        return {f"tok{i}": i for i in range(128)}


class ConstantLengthDataset(torch.utils.data.IterableDataset):
    """
    Iterable dataset that returns constant length chunks of tokens from stream of text files.
    """

    def __init__(self, tokenizer, datasets, seq_length=2048):  # pylint: disable=super-init-not-called
        self.tokenizer = tokenizer
        self.concat_token_id = tokenizer.eos_token_id
        self.datasets: List = datasets
        self.seq_length = seq_length

        vocab_size = len(tokenizer.get_vocab())

        if vocab_size <= torch.iinfo(torch.int16).max:
            self.tokens_dtype = torch.int16
        elif vocab_size <= torch.iinfo(torch.int32).max:
            self.tokens_dtype = torch.int32
        else:
            self.tokens_dtype = torch.int64

    def __iter__(self):
        buffer = {"input_ids": [], "attention_mask": [], "labels": []}
        buffer_len = 0
        for dataset in self.datasets:
            iterator = iter(dataset)
            more_examples = True
            while more_examples:
                try:
                    example = next(iterator)
                except StopIteration:
                    more_examples = False
                    example = None

                add_concat_token = False
                if example:
                    example_len = len(example["input_ids"])
                    add_concat_token = example["input_ids"][-1] != self.concat_token_id
                else:
                    example_len = 0

                if not example_len or (buffer_len + int(add_concat_token) + example_len > self.seq_length):
                    if buffer["input_ids"]:
                        input_ids = torch.cat(buffer["input_ids"], dim=-1)[: self.seq_length]
                        attention_mask = torch.cat(buffer["attention_mask"], dim=-1)[: self.seq_length]
                        labels = torch.cat(buffer["labels"], dim=-1)[: self.seq_length]
                        if labels.size() == input_ids.size() and (attention_mask.size() == input_ids.size()):
                            yield {
                                "input_ids": input_ids,
                                "labels": labels,
                                "attention_mask": attention_mask,
                            }
                    buffer = {"input_ids": [], "attention_mask": [], "labels": []}
                    buffer_len = 0

                if example:
                    # just going to drop data points that are too long
                    if len(example["input_ids"]) <= self.seq_length:
                        input_ids = example["input_ids"]
                        attention_mask = example["attention_mask"]
                        labels = example["labels"]
                        if FIXED:
                            if buffer["input_ids"] and input_ids[0] == self.tokenizer.bos_token_id:
                                attention_mask[0] = 0

                        if add_concat_token:
                            input_ids.append(self.concat_token_id)
                            attention_mask.append(1)
                            labels.append(self.concat_token_id)

                        input_ids_with_concat = torch.tensor(input_ids, dtype=self.tokens_dtype)
                        attention_mask_with_concat = torch.tensor(attention_mask, dtype=self.tokens_dtype)
                        labels_with_concat = torch.tensor(labels, dtype=self.tokens_dtype)

                        buffer["input_ids"].append(input_ids_with_concat)
                        buffer["attention_mask"].append(attention_mask_with_concat)
                        buffer["labels"].append(labels_with_concat)
                        buffer_len += len(input_ids)


def tokenize_prompt(prompt_ids, response_ids, tok):
    """Alpaca-style tokenized example (train_on_inputs=False): bos + prompt + response + eos."""
    input_ids = [tok.bos_token_id] + prompt_ids + response_ids + [tok.eos_token_id]
    labels = [-100] * (1 + len(prompt_ids)) + response_ids + [tok.eos_token_id]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def main():
    tok = TinyTokenizer()
    g = torch.Generator().manual_seed(1)
    examples = []
    for n_prompt, n_resp in [(5, 4), (7, 3), (4, 6), (6, 5), (3, 4), (5, 5)]:
        p = torch.randint(3, 128, (n_prompt,), generator=g).tolist()
        r = torch.randint(3, 128, (n_resp,), generator=g).tolist()
        examples.append(tokenize_prompt(p, r, tok))

    packed = list(ConstantLengthDataset(tok, [examples], seq_length=32))

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    model.eval()

    for i, row in enumerate(packed):
        input_ids = row["input_ids"].long()[None]
        attention_mask = row["attention_mask"].long()[None]
        labels = row["labels"].long()[None]
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        print(f"packed row {i}: len={input_ids.shape[1]} mask_sum={int(attention_mask.sum())} "
              f"loss={out.loss.item():.6f} logits_sum={out.logits.sum().item():.5f}")


if __name__ == "__main__":
    main()
