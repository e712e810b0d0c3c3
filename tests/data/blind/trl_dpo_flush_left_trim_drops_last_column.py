"""TRL DPOTrainer.concatenated_forward: after flushing left, the column trim cut one column too many.

Citation: huggingface/trl#2332 (commit 7f2ccbe3a, "fix truncating index in DPOTrainer's
concatenated_forward()"); code read at 7f2ccbe3a^ (trl/trainer/dpo_trainer.py tokenize_row,
concatenated_inputs, concatenated_forward, dpo_loss; PreferenceCollator and pad from
trl/trainer/dpo_trainer.py / trl/trainer/utils.py).

concatenated_forward joins the left-padded prompts and the right-padded chosen/rejected completions,
rolls every row left so its first real token sits in column 0, then trims the columns that are
padding in every row. The bug: the trim used
``first_empty_col = ... if empty_cols.any() else attention_mask.size(1) + 1`` and then sliced
``[:, : first_empty_col - 1]``, so one column that still held real tokens was dropped from
input_ids, attention_mask and loss_mask: the longest row loses its last completion token (its EOS)
and that token's log-prob never enters chosen_logps / rejected_logps.

The fix: ``else attention_mask.size(1)`` and slice ``[:, : first_empty_col]``.

Tiny Qwen2ForCausalLM policy and reference built from a config (random weights, different seeds),
token ids written by hand in place of a tokenizer; pad id = eos id as with Qwen2 tokenizers.
"""

import sys
from typing import Dict, List

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv

EOS_TOKEN_ID = 2
PAD_TOKEN_ID = EOS_TOKEN_ID


def pad(tensors: List[torch.Tensor], padding_value: int = 0, padding_side: str = "right") -> torch.Tensor:
    output_shape = np.max([t.shape for t in tensors], 0).tolist()
    output = torch.full((len(tensors), *output_shape), padding_value, dtype=tensors[0].dtype, device=tensors[0].device)
    for i, t in enumerate(tensors):
        if padding_side == "left":
            seq_slice = slice(output_shape[0] - t.shape[0], output_shape[0])
        elif padding_side == "right":
            seq_slice = slice(0, t.shape[0])
        else:
            raise ValueError("Padding side must be 'left' or 'right'")
        slices = (seq_slice,) + tuple(slice(0, s) for s in t.shape[1:])
        output[i][slices] = t
    return output


def pad_to_length(tensor: torch.Tensor, length: int, pad_value, dim: int = -1) -> torch.Tensor:
    if tensor.size(dim) >= length:
        return tensor
    pad_size = list(tensor.shape)
    pad_size[dim] = length - tensor.size(dim)
    return torch.cat(
        [tensor, pad_value * torch.ones(*pad_size, dtype=tensor.dtype, device=tensor.device)],
        dim=dim,
    )


def tokenize_row(features, max_prompt_length=None, max_completion_length=None):
    # token ids stand in for tokenizer(features[...], add_special_tokens=False)["input_ids"]
    prompt_input_ids = list(features["prompt"])
    chosen_input_ids = list(features["chosen"]) + [EOS_TOKEN_ID]
    rejected_input_ids = list(features["rejected"]) + [EOS_TOKEN_ID]
    if max_prompt_length is not None:
        prompt_input_ids = prompt_input_ids[-max_prompt_length:]
    if max_completion_length is not None:
        chosen_input_ids = chosen_input_ids[:max_completion_length]
        rejected_input_ids = rejected_input_ids[:max_completion_length]
    return {
        "prompt_input_ids": prompt_input_ids,
        "chosen_input_ids": chosen_input_ids,
        "rejected_input_ids": rejected_input_ids,
    }


class PreferenceCollator:
    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, examples):
        prompt_input_ids = [torch.tensor(example["prompt_input_ids"]) for example in examples]
        prompt_attention_mask = [torch.ones_like(input_ids) for input_ids in prompt_input_ids]
        chosen_input_ids = [torch.tensor(example["chosen_input_ids"]) for example in examples]
        chosen_attention_mask = [torch.ones_like(input_ids) for input_ids in chosen_input_ids]
        rejected_input_ids = [torch.tensor(example["rejected_input_ids"]) for example in examples]
        rejected_attention_mask = [torch.ones_like(input_ids) for input_ids in rejected_input_ids]

        output = {}
        output["prompt_input_ids"] = pad(prompt_input_ids, padding_value=self.pad_token_id, padding_side="left")
        output["prompt_attention_mask"] = pad(prompt_attention_mask, padding_value=0, padding_side="left")
        output["chosen_input_ids"] = pad(chosen_input_ids, padding_value=self.pad_token_id)
        output["chosen_attention_mask"] = pad(chosen_attention_mask, padding_value=0)
        output["rejected_input_ids"] = pad(rejected_input_ids, padding_value=self.pad_token_id)
        output["rejected_attention_mask"] = pad(rejected_attention_mask, padding_value=0)
        return output


class DPOTrainer:
    def __init__(self, model, ref_model, beta=0.1, max_length=None):
        self.model = model
        self.ref_model = ref_model
        self.beta = beta
        self.max_length = max_length
        self.padding_value = PAD_TOKEN_ID

    @staticmethod
    def concatenated_inputs(batch: Dict[str, torch.LongTensor], padding_value: int) -> Dict[str, torch.LongTensor]:
        output = {}
        output["prompt_input_ids"] = torch.cat([batch["prompt_input_ids"], batch["prompt_input_ids"]], dim=0)
        output["prompt_attention_mask"] = torch.cat(
            [batch["prompt_attention_mask"], batch["prompt_attention_mask"]], dim=0
        )
        max_completion_length = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
        output["completion_input_ids"] = torch.cat(
            (
                pad_to_length(batch["chosen_input_ids"], max_completion_length, pad_value=padding_value),
                pad_to_length(batch["rejected_input_ids"], max_completion_length, pad_value=padding_value),
            ),
        )
        output["completion_attention_mask"] = torch.cat(
            (
                pad_to_length(batch["chosen_attention_mask"], max_completion_length, pad_value=0),
                pad_to_length(batch["rejected_attention_mask"], max_completion_length, pad_value=0),
            ),
        )
        return output

    def dpo_loss(self, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps):
        chosen_logratios = chosen_logps - ref_chosen_logps
        rejected_logratios = rejected_logps - ref_rejected_logps
        logits = chosen_logratios - rejected_logratios
        losses = -F.logsigmoid(self.beta * logits)
        chosen_rewards = self.beta * (chosen_logps - ref_chosen_logps).detach()
        rejected_rewards = self.beta * (rejected_logps - ref_rejected_logps).detach()
        return losses, chosen_rewards, rejected_rewards

    def concatenated_forward(self, model, batch):
        num_examples = batch["prompt_input_ids"].shape[0]
        concatenated_batch = self.concatenated_inputs(batch, padding_value=self.padding_value)

        prompt_input_ids = concatenated_batch["prompt_input_ids"]
        prompt_attention_mask = concatenated_batch["prompt_attention_mask"]
        completion_input_ids = concatenated_batch["completion_input_ids"]
        completion_attention_mask = concatenated_batch["completion_attention_mask"]

        # Concatenate the prompt and completion inputs
        input_ids = torch.cat((prompt_input_ids, completion_input_ids), dim=1)
        attention_mask = torch.cat((prompt_attention_mask, completion_attention_mask), dim=1)
        # Mask the prompt but not the completion for the loss
        loss_mask = torch.cat(
            (torch.zeros_like(prompt_attention_mask), completion_attention_mask),
            dim=1,
        )

        # Flush left to reduce the memory usage
        # [[0, 0, x, x, x, x],  ->  [[x, x, x, x],
        #  [0, x, x, x, 0, 0]]       [x, x, x, 0]]
        for i in range(attention_mask.size(0)):
            first_one_idx = torch.nonzero(attention_mask[i])[0].item()
            input_ids[i] = torch.roll(input_ids[i], shifts=-first_one_idx)
            attention_mask[i] = torch.roll(attention_mask[i], shifts=-first_one_idx)
            loss_mask[i] = torch.roll(loss_mask[i], shifts=-first_one_idx)

        # Get the first column idx that is all zeros and remove every column after that
        empty_cols = torch.sum(attention_mask, dim=0) == 0
        if FIXED:
            first_empty_col = torch.nonzero(empty_cols)[0].item() if empty_cols.any() else attention_mask.size(1)
            input_ids = input_ids[:, :first_empty_col]
            attention_mask = attention_mask[:, :first_empty_col]
            loss_mask = loss_mask[:, :first_empty_col]
        else:
            first_empty_col = (
                torch.nonzero(empty_cols)[0].item() if empty_cols.any() else attention_mask.size(1) + 1
            )
            input_ids = input_ids[:, : first_empty_col - 1]
            attention_mask = attention_mask[:, : first_empty_col - 1]
            loss_mask = loss_mask[:, : first_empty_col - 1]

        # Truncate right
        if self.max_length is not None:
            input_ids = input_ids[:, : self.max_length]
            attention_mask = attention_mask[:, : self.max_length]
            loss_mask = loss_mask[:, : self.max_length]

        outputs = model(input_ids=input_ids, attention_mask=attention_mask)

        # Offset the logits by one to align with the labels
        logits = outputs.logits[:, :-1, :]
        labels = input_ids[:, 1:].clone()
        loss_mask = loss_mask[:, 1:].bool()

        # Compute the log probabilities of the labels
        labels[~loss_mask] = 0  # dummy token; we'll ignore the losses on these tokens later
        per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
        per_token_logps[~loss_mask] = 0
        all_logps = per_token_logps.sum(-1)

        output = {}
        output["chosen_logps"] = all_logps[:num_examples]
        output["rejected_logps"] = all_logps[num_examples:]
        output["mean_chosen_logits"] = logits[:num_examples][loss_mask[:num_examples]].mean()
        output["mean_rejected_logits"] = logits[num_examples:][loss_mask[num_examples:]].mean()
        return output

    def get_batch_loss_metrics(self, batch):
        model_output = self.concatenated_forward(self.model, batch)
        with torch.no_grad():
            ref_output = self.concatenated_forward(self.ref_model, batch)
        losses, chosen_rewards, rejected_rewards = self.dpo_loss(
            model_output["chosen_logps"],
            model_output["rejected_logps"],
            ref_output["chosen_logps"],
            ref_output["rejected_logps"],
        )
        metrics = {
            "rewards/chosen": chosen_rewards.mean().item(),
            "rewards/rejected": rejected_rewards.mean().item(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
            "logps/chosen": model_output["chosen_logps"].detach().mean().item(),
            "logps/rejected": model_output["rejected_logps"].detach().mean().item(),
        }
        return losses.mean(), metrics


def build_model(seed):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config)
    model.eval()
    return model


def main():
    rows = [
        {"prompt": [11, 12, 13, 14, 15], "chosen": [21, 22, 23], "rejected": [31, 32]},
        {"prompt": [16, 17, 18], "chosen": [24, 25], "rejected": [33, 34, 35, 36, 37, 38]},
        {"prompt": [19, 20, 40, 41], "chosen": [26, 27, 28, 29], "rejected": [39]},
    ]
    examples = [tokenize_row(r, max_prompt_length=128, max_completion_length=128) for r in rows]
    batch = PreferenceCollator(pad_token_id=PAD_TOKEN_ID)(examples)

    policy = build_model(0)
    ref_model = build_model(1)
    trainer = DPOTrainer(policy, ref_model, beta=0.1)

    loss, metrics = trainer.get_batch_loss_metrics(batch)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in policy.parameters() if p.grad is not None))
    print(f"loss={loss.item():.6f} grad_norm={grad_norm.item():.6f}")
    for k, v in metrics.items():
        print(f"{k}={v:.6f}")


if __name__ == "__main__":
    main()
