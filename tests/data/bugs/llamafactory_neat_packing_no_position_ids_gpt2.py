# LLaMA-Factory, hiyouga/LlamaFactory#7318 ("[data] specify position_ids in PackedSupervisedDatasetProcessor for
# neat_packing"; processor and collator code ported, the diff reconstructed from the PR description).
# With neat_packing the packed row's attention_mask holds a sequence index per token (1,1,2,2,2,0) and the collator
# turns it into a 4D block-diagonal causal mask, but the processor gave no position_ids, so the model numbered the
# whole packed row 0..L-1: the second and later samples are read at positions shifted by the samples before them.
# Fix: the processor emits packed_position_ids = range(len(sample)) per sample (0 for the padding) in the batch.
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Sequence

import torch
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
IGNORE_INDEX = -100


@dataclass
class DataArguments:
    cutoff_len: int = 23
    neat_packing: bool = True


class Tokenizer:
    pad_token_id = 0
    eos_token_id = 1


def greedy_knapsack(numbers: List[int], capacity: int) -> List[List[int]]:
    """src/llamafactory/data/data_utils.py (bisect search replaced by a scan)"""
    numbers.sort()
    knapsacks = []
    while numbers:
        current_knapsack = []
        remaining_capacity = capacity
        while True:
            fits = [i for i, n in enumerate(numbers) if n <= remaining_capacity]
            if not fits:
                break
            index = fits[-1]
            remaining_capacity -= numbers[index]
            current_knapsack.append(numbers.pop(index))
        knapsacks.append(current_knapsack)
    return knapsacks


class PackedSupervisedDatasetProcessor:
    """src/llamafactory/data/processor/supervised.py (examples arrive already encoded)"""

    def __init__(self, data_args, tokenizer):
        self.data_args = data_args
        self.tokenizer = tokenizer

    def preprocess_dataset(self, examples: Dict[str, List[Any]]) -> Dict[str, List[Any]]:
        # TODO: use `position_ids` to achieve packing
        # build inputs with format `<bos> X1 Y1 <eos> <bos> X2 Y2 <eos>`
        # and labels with format `<ignore> ... <ignore> Y1 <eos> <ignore> ... <ignore> Y2 <eos>`
        valid_num = 0
        batch_input_ids, batch_labels = [], []
        lengths = []
        length2indexes = defaultdict(list)
        for i in range(len(examples["input_ids"])):
            input_ids, labels = examples["input_ids"][i], examples["labels"][i]
            length = len(input_ids)
            if length > self.data_args.cutoff_len:
                print(f"Dropped lengthy example with length {length} > {self.data_args.cutoff_len}.")
            else:
                lengths.append(length)
                length2indexes[length].append(valid_num)
                batch_input_ids.append(input_ids)
                batch_labels.append(labels)
                valid_num += 1

        model_inputs = defaultdict(list)
        knapsacks = greedy_knapsack(lengths, self.data_args.cutoff_len)
        for knapsack in knapsacks:
            packed_input_ids, packed_attention_masks, packed_position_ids, packed_labels = [], [], [], []
            for i, length in enumerate(knapsack):
                index = length2indexes[length].pop()
                packed_input_ids += batch_input_ids[index]
                if FIXED:
                    packed_position_ids += list(range(len(batch_input_ids[index])))  # NOTE: pad_to_multiple_of ignore this
                packed_labels += batch_labels[index]
                if self.data_args.neat_packing:
                    packed_attention_masks += [i + 1] * len(batch_input_ids[index])  # start from 1
                else:
                    packed_attention_masks += [1] * len(batch_input_ids[index])

            if len(packed_input_ids) < self.data_args.cutoff_len + 1:  # avoid flash_attn drops attn mask
                pad_length = self.data_args.cutoff_len - len(packed_input_ids) + 1
                packed_input_ids += [self.tokenizer.pad_token_id] * pad_length
                if FIXED:
                    packed_position_ids += [0] * pad_length
                packed_labels += [IGNORE_INDEX] * pad_length
                if self.data_args.neat_packing:
                    packed_attention_masks += [0] * pad_length
                else:
                    packed_attention_masks += [1] * pad_length  # more efficient flash_attn

            if len(packed_input_ids) != self.data_args.cutoff_len + 1:
                raise ValueError("The length of packed example should be identical to the cutoff length.")

            model_inputs["input_ids"].append(packed_input_ids)
            model_inputs["attention_mask"].append(packed_attention_masks)
            if FIXED:
                model_inputs["position_ids"].append(packed_position_ids)
            model_inputs["labels"].append(packed_labels)

        return model_inputs


def prepare_4d_attention_mask(attention_mask_with_indices: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
    """src/llamafactory/data/collator.py"""
    _, seq_len = attention_mask_with_indices.size()
    min_dtype = torch.finfo(dtype).min
    zero_tensor = torch.tensor(0, dtype=dtype)
    # Create a non-padding mask.
    non_padding_mask = (attention_mask_with_indices != 0).unsqueeze(1).unsqueeze(2)
    # Create indices for comparison.
    indices = attention_mask_with_indices.unsqueeze(1).unsqueeze(2)  # [bsz, 1, 1, seq_len]
    indices_t = attention_mask_with_indices.unsqueeze(1).unsqueeze(3)  # [bsz, 1, seq_len, 1]
    # Create a lower triangular mask.
    tril_mask = torch.tril(torch.ones((seq_len, seq_len), dtype=torch.bool))
    attention_mask_4d = (indices == indices_t) & non_padding_mask & tril_mask
    # Invert the attention mask.
    attention_mask_4d = torch.where(attention_mask_4d, zero_tensor, min_dtype)
    return attention_mask_4d


@dataclass
class SFTDataCollatorWith4DAttentionMask:
    """src/llamafactory/data/collator.py (the parent DataCollatorForSeq2Seq padding reduced to stacking:
    every packed row is already cutoff_len + 1 long)"""

    block_diag_attn: bool = False
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = "eager"
    compute_dtype: "torch.dtype" = torch.float32

    def __call__(self, features: Sequence[Dict[str, Any]]) -> Dict[str, "torch.Tensor"]:
        features = {key: torch.tensor([feature[key] for feature in features]) for key in features[0].keys()}
        if self.block_diag_attn and self.attn_implementation != "flash_attention_2":
            features["attention_mask"] = prepare_4d_attention_mask(features["attention_mask"], self.compute_dtype)

        for key, value in features.items():  # cast data dtype for paligemma
            if torch.is_tensor(value) and torch.is_floating_point(value):
                features[key] = value.to(self.compute_dtype)

        return features


def main():
    data_args = DataArguments()
    tokenizer = Tokenizer()
    g = torch.Generator().manual_seed(3)
    examples = {"input_ids": [], "labels": []}
    for prompt_len, resp_len in [(4, 5), (3, 4), (5, 6), (2, 3)]:
        prompt = torch.randint(2, 64, (prompt_len,), generator=g).tolist()
        response = torch.randint(2, 64, (resp_len,), generator=g).tolist() + [tokenizer.eos_token_id]
        examples["input_ids"].append(prompt + response)
        examples["labels"].append([IGNORE_INDEX] * prompt_len + response)

    processor = PackedSupervisedDatasetProcessor(data_args, tokenizer)
    dataset = processor.preprocess_dataset(examples)
    features = [{key: dataset[key][i] for key in dataset} for i in range(len(dataset["input_ids"]))]

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=1, eos_token_id=1, pad_token_id=0)
    model = GPT2LMHeadModel._from_config(config, attn_implementation="eager")
    model.eval()
    collator = SFTDataCollatorWith4DAttentionMask(
        block_diag_attn=data_args.neat_packing, attn_implementation="eager", compute_dtype=torch.float32
    )
    batch = collator(features)
    print("attention_mask:", batch["attention_mask"].shape, "keys:", sorted(batch.keys()))
    with torch.no_grad():
        outputs = model(**batch)
    print("loss: %.6f" % outputs.loss.item())
    print("logits[0, 12, :4]:", outputs.logits[0, 12, :4])


if __name__ == "__main__":
    main()
