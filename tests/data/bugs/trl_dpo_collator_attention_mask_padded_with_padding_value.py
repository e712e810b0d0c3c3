"""TRL DPOTrainer (decoder-only): attention masks padded with the trainer's `padding_value` (the pad token id).

Citation: huggingface/trl#885 (commit 48b3ef0b7, "distinguish between pad token_id and mask values"), asked
about in huggingface/trl#909. Bug state read at 48b3ef0b7^: trl/trainer/utils.py DPODataCollatorWithPadding.collate,
trl/trainer/dpo_trainer.py concatenated_inputs / concatenated_forward / get_batch_samples.

Bug: for decoder-only models the collator padded every `*_attention_mask` with `self.padding_value`, and
concatenated_inputs padded the chosen/rejected masks with it too. `padding_value` is the value meant for the
input ids (the pad token id, which users pass as `padding_value=tokenizer.pad_token_id`), so with a pad id of 2
the left padding of `prompt_attention_mask` is 2, not 0: the prompt's pad slots are attended during
`generate_during_eval`, and the positions counted from the mask shift.

Fix: attention masks are always padded with 0; `padding_value` (defaulting to tokenizer.pad_token_id) only pads
input ids.

This program: pre-tokenized DPO features (as tokenize_batch_element makes them), the collator, the
concatenated forward with DPO sigmoid loss, and the eval-time sampling from left-padded prompts, on a tiny
LlamaForCausalLM built from its config.
"""
import sys
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv

PAD_TOKEN_ID = 2  # Llama: pad_token = eos_token
EOS_TOKEN_ID = 2
BOS_TOKEN_ID = 1


class Tokenizer:
    pad_token_id = PAD_TOKEN_ID
    eos_token_id = EOS_TOKEN_ID
    bos_token_id = BOS_TOKEN_ID


def pad_to_length(tensor: torch.Tensor, length: int, pad_value, dim: int = -1) -> torch.Tensor:
    if tensor.size(dim) >= length:
        return tensor
    pad_size = list(tensor.shape)
    pad_size[dim] = length - tensor.size(dim)
    return torch.cat(
        [tensor, pad_value * torch.ones(*pad_size, dtype=tensor.dtype, device=tensor.device)],
        dim=dim,
    )


class DPODataCollatorWithPadding:
    def __init__(self, tokenizer, label_pad_token_id: int = -100, padding_value: int = 0,
                 is_encoder_decoder: Optional[bool] = False):
        self.tokenizer = tokenizer
        self.label_pad_token_id = label_pad_token_id
        self.padding_value = padding_value
        self.is_encoder_decoder = is_encoder_decoder

    def collate(self, batch: List[Dict[str, Any]]):
        # first, pad everything to the same length
        padded_batch = {}
        for k in batch[0].keys():
            if k.endswith("_input_ids") or k.endswith("_attention_mask") or k.endswith("_labels"):
                # adapted from https://stackoverflow.com/questions/73256206
                if "prompt" in k:
                    to_pad = [torch.LongTensor(ex[k][::-1]) for ex in batch]
                else:
                    to_pad = [torch.LongTensor(ex[k]) for ex in batch]
                if k.endswith("_input_ids"):
                    padding_value = self.tokenizer.pad_token_id
                elif k.endswith("_labels"):
                    padding_value = self.label_pad_token_id
                elif k.endswith("_attention_mask"):
                    if FIXED:
                        padding_value = 0
                    else:
                        padding_value = self.padding_value
                else:
                    raise ValueError(f"Unexpected key in batch '{k}'")

                padded_batch[k] = pad_sequence(to_pad, batch_first=True, padding_value=padding_value)
                # for the prompt, flip back so padding is on left side
                if "prompt" in k:
                    padded_batch[k] = padded_batch[k].flip(dims=[1])
            else:
                padded_batch[k] = [ex[k] for ex in batch]

        return padded_batch

    def __call__(self, features: List[Dict[str, Any]]) -> Dict[str, Any]:
        return self.collate(features)


def tokenize_batch_element(prompt_ids, chosen_ids, rejected_ids, label_pad_token_id=-100):
    prompt_tokens = {"input_ids": [BOS_TOKEN_ID] + prompt_ids}
    prompt_tokens["attention_mask"] = [1] * len(prompt_tokens["input_ids"])
    chosen_tokens = {"input_ids": chosen_ids + [EOS_TOKEN_ID], "attention_mask": [1] * (len(chosen_ids) + 1)}
    rejected_tokens = {"input_ids": rejected_ids + [EOS_TOKEN_ID], "attention_mask": [1] * (len(rejected_ids) + 1)}

    chosen_sequence_tokens = {k: prompt_tokens[k] + chosen_tokens[k] for k in chosen_tokens}
    rejected_sequence_tokens = {k: prompt_tokens[k] + rejected_tokens[k] for k in rejected_tokens}
    chosen_sequence_tokens["labels"] = chosen_sequence_tokens["input_ids"][:]
    chosen_sequence_tokens["labels"][: len(prompt_tokens["input_ids"])] = [label_pad_token_id] * len(
        prompt_tokens["input_ids"]
    )
    rejected_sequence_tokens["labels"] = rejected_sequence_tokens["input_ids"][:]
    rejected_sequence_tokens["labels"][: len(prompt_tokens["input_ids"])] = [label_pad_token_id] * len(
        prompt_tokens["input_ids"]
    )

    batch = {}
    for k, toks in {"chosen": chosen_sequence_tokens, "rejected": rejected_sequence_tokens, "prompt": prompt_tokens}.items():
        for type_key, tokens in toks.items():
            if type_key == "token_type_ids":
                continue
            batch[f"{k}_{type_key}"] = tokens
    return batch


class DPOTrainer:
    def __init__(self, model, ref_model, tokenizer, beta=0.1, label_pad_token_id=-100, padding_value=0, max_length=24):
        self.model = model
        self.ref_model = ref_model
        self.tokenizer = tokenizer
        self.beta = beta
        self.label_pad_token_id = label_pad_token_id
        self.padding_value = padding_value
        self.max_length = max_length
        self.is_encoder_decoder = False
        self.data_collator = DPODataCollatorWithPadding(
            tokenizer, label_pad_token_id=label_pad_token_id, padding_value=padding_value
        )

    def concatenated_inputs(self, batch):
        concatenated_batch = {}
        max_length = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])

        def pad_value_for(k):
            if "labels" in k or self.is_encoder_decoder:
                return self.label_pad_token_id
            if FIXED and k.endswith("_attention_mask"):
                return 0
            return self.padding_value

        for k in batch:
            if k.startswith("chosen") and isinstance(batch[k], torch.Tensor):
                concatenated_key = k.replace("chosen", "concatenated")
                concatenated_batch[concatenated_key] = pad_to_length(batch[k], max_length, pad_value=pad_value_for(k))
        for k in batch:
            if k.startswith("rejected") and isinstance(batch[k], torch.Tensor):
                concatenated_key = k.replace("rejected", "concatenated")
                concatenated_batch[concatenated_key] = torch.cat(
                    (concatenated_batch[concatenated_key], pad_to_length(batch[k], max_length, pad_value=pad_value_for(k))),
                    dim=0,
                )
        return concatenated_batch

    def _get_batch_logps(self, logits, labels, average_log_prob=False):
        labels = labels[:, 1:].clone()
        logits = logits[:, :-1, :]
        loss_mask = labels != self.label_pad_token_id
        labels[labels == self.label_pad_token_id] = 0
        per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
        if average_log_prob:
            return (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
        return (per_token_logps * loss_mask).sum(-1)

    def concatenated_forward(self, model, batch):
        concatenated_batch = self.concatenated_inputs(batch)
        len_chosen = batch["chosen_labels"].shape[0]
        all_logits = model(
            concatenated_batch["concatenated_input_ids"],
            attention_mask=concatenated_batch["concatenated_attention_mask"],
        ).logits.to(torch.float32)
        all_logps = self._get_batch_logps(all_logits, concatenated_batch["concatenated_labels"])
        return all_logps[:len_chosen], all_logps[len_chosen:]

    def dpo_loss(self, pc, pr, rc, rr):
        logits = (pc - pr) - (rc - rr)
        losses = -F.logsigmoid(self.beta * logits)
        return losses, self.beta * (pc - rc).detach(), self.beta * (pr - rr).detach()

    def get_batch_samples(self, model, batch):
        policy_output = model.generate(
            input_ids=batch["prompt_input_ids"],
            attention_mask=batch["prompt_attention_mask"],
            max_length=self.max_length,
            do_sample=True,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        reference_output = self.ref_model.generate(
            input_ids=batch["prompt_input_ids"],
            attention_mask=batch["prompt_attention_mask"],
            max_length=self.max_length,
            do_sample=True,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        policy_output = pad_to_length(policy_output, self.max_length, self.tokenizer.pad_token_id)
        reference_output = pad_to_length(reference_output, self.max_length, self.tokenizer.pad_token_id)
        return policy_output, reference_output


def main():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD_TOKEN_ID, bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID, initializer_range=0.2, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    ref_model = LlamaForCausalLM(config).eval()
    tokenizer = Tokenizer()

    features = [
        tokenize_batch_element([10, 11, 12, 13, 14, 15, 16], [20, 21, 22], [30, 31]),
        tokenize_batch_element([17, 18], [23, 24], [32, 33, 34, 35, 36]),
        tokenize_batch_element([40, 41, 42, 43], [25], [37, 38, 39]),
    ]

    trainer = DPOTrainer(model, ref_model, tokenizer, padding_value=tokenizer.pad_token_id, max_length=18)
    batch = trainer.data_collator(features)
    print("prompt_attention_mask:\n", batch["prompt_attention_mask"])

    with torch.no_grad():
        pc, pr = trainer.concatenated_forward(model, batch)
        rc, rr = trainer.concatenated_forward(ref_model, batch)
        losses, chosen_rewards, rejected_rewards = trainer.dpo_loss(pc, pr, rc, rr)
    print("dpo loss:", losses.mean().item())
    print("chosen rewards:", chosen_rewards.tolist())

    torch.manual_seed(1234)
    with torch.no_grad():
        policy_output, reference_output = trainer.get_batch_samples(model, batch)
    prompt_len = batch["prompt_input_ids"].shape[1]
    print("policy samples:", policy_output[:, prompt_len:].tolist())
    print("reference samples:", reference_output[:, prompt_len:].tolist())


if __name__ == "__main__":
    main()
