"""TRL ORPO: the NLL term is taken over labels copied from the right-padded input_ids, pads included.

Citation: huggingface/trl#1625 (commit b8b89783c, "[ORPO] Correct label mask for pad tokens"),
trl/trainer/orpo_trainer.py ``ORPOTrainer.concatenated_forward``. The bug came in with trl commit 57aebe9c
(the NLL loss over the whole chosen sequence, labels = ``concatenated_input_ids.clone()``).

DPODataCollatorWithPadding pads every ``chosen_*`` / ``rejected_*`` row on the right (input_ids with the
tokenizer's pad id, attention_mask with 0, labels with -100); ``concatenated_inputs`` then pads chosen and
rejected to one length with ``pad_to_length`` and stacks them. For a decoder-only model
``concatenated_forward`` built the NLL labels as ``concatenated_batch["concatenated_input_ids"].clone()``
and handed them to ``nn.CrossEntropyLoss()`` (ignore_index -100): every pad column of a shorter chosen row
was a target, so the chosen NLL (and the ORPO loss ``policy_nll_loss - losses.mean()``) averaged in the
model's predictions of the pad id after the sequence had ended.

The fix: ``labels = torch.where(attention_mask == 1, labels, self.label_pad_token_id)`` with
``attention_mask = concatenated_batch["concatenated_attention_mask"]``.

The tokenized features are written as ``ORPOTrainer.tokenize_row`` leaves them (prompt + answer + eos, the
prompt part of the labels set to -100); the model is a tiny LlamaForCausalLM built from its config.
"""

import sys
from typing import Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)

BOS, EOS, PAD = 1, 2, 0  # tokenizer.pad_token_id (a distinct pad token)
LABEL_PAD = -100


def pad_to_length(tensor: torch.Tensor, length: int, pad_value: Union[int, float], dim: int = -1) -> torch.Tensor:
    if tensor.size(dim) >= length:
        return tensor
    else:
        pad_size = list(tensor.shape)
        pad_size[dim] = length - tensor.size(dim)
        return torch.cat(
            [
                tensor,
                pad_value * torch.ones(*pad_size, dtype=tensor.dtype, device=tensor.device),
            ],
            dim=dim,
        )


class DPODataCollatorWithPadding:
    def __init__(self, pad_token_id=0, label_pad_token_id=-100, is_encoder_decoder=False):
        self.pad_token_id = pad_token_id
        self.label_pad_token_id = label_pad_token_id
        self.is_encoder_decoder = is_encoder_decoder

    def __call__(self, features: List[Dict]) -> Dict:
        padded_batch = {}
        for k in features[0].keys():
            if k.endswith("_input_ids") or k.endswith("_attention_mask") or k.endswith("_labels"):
                # adapted from https://stackoverflow.com/questions/73256206
                if "prompt" in k:
                    to_pad = [torch.LongTensor(ex[k][::-1]) for ex in features]
                else:
                    to_pad = [torch.LongTensor(ex[k]) for ex in features]
                if k.endswith("_input_ids"):
                    padding_value = self.pad_token_id
                elif k.endswith("_labels"):
                    padding_value = self.label_pad_token_id
                elif k.endswith("_attention_mask"):
                    padding_value = 0
                else:
                    raise ValueError(f"Unexpected key in batch '{k}'")

                padded_batch[k] = pad_sequence(to_pad, batch_first=True, padding_value=padding_value)
                # for the prompt, flip back so padding is on left side
                if "prompt" in k:
                    padded_batch[k] = padded_batch[k].flip(dims=[1])
            else:
                padded_batch[k] = [ex[k] for ex in features]
        return padded_batch


class ORPOTrainer:
    def __init__(self, model, beta=0.1, padding_value=PAD, label_pad_token_id=LABEL_PAD):
        self.model = model
        self.beta = beta
        self.padding_value = padding_value
        self.label_pad_token_id = label_pad_token_id
        self.is_encoder_decoder = False
        self.device = torch.device("cpu")

    @staticmethod
    def concatenated_inputs(
        batch: Dict[str, Union[List, torch.LongTensor]],
        is_encoder_decoder: bool = False,
        label_pad_token_id: int = -100,
        padding_value: int = 0,
        device: Optional[torch.device] = None,
    ) -> Dict[str, torch.LongTensor]:
        concatenated_batch = {}

        if is_encoder_decoder:
            max_length = max(batch["chosen_labels"].shape[1], batch["rejected_labels"].shape[1])
        else:
            max_length = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])

        for k in batch:
            if k.startswith("chosen") and isinstance(batch[k], torch.Tensor):
                if "labels" in k or is_encoder_decoder:
                    pad_value = label_pad_token_id
                elif k.endswith("_input_ids"):
                    pad_value = padding_value
                elif k.endswith("_attention_mask"):
                    pad_value = 0
                concatenated_key = k.replace("chosen", "concatenated")
                concatenated_batch[concatenated_key] = pad_to_length(batch[k], max_length, pad_value=pad_value)
        for k in batch:
            if k.startswith("rejected") and isinstance(batch[k], torch.Tensor):
                if "labels" in k or is_encoder_decoder:
                    pad_value = label_pad_token_id
                elif k.endswith("_input_ids"):
                    pad_value = padding_value
                elif k.endswith("_attention_mask"):
                    pad_value = 0
                concatenated_key = k.replace("rejected", "concatenated")
                concatenated_batch[concatenated_key] = torch.cat(
                    (
                        concatenated_batch[concatenated_key],
                        pad_to_length(batch[k], max_length, pad_value=pad_value),
                    ),
                    dim=0,
                ).to(device=device)

        return concatenated_batch

    def odds_ratio_loss(self, policy_chosen_logps, policy_rejected_logps):
        # Derived from Eqs. (4) and (7) from https://arxiv.org/abs/2403.07691
        log_odds = (policy_chosen_logps - policy_rejected_logps) - (
            torch.log1p(-torch.exp(policy_chosen_logps)) - torch.log1p(-torch.exp(policy_rejected_logps))
        )
        sig_ratio = F.sigmoid(log_odds)
        ratio = torch.log(sig_ratio)
        losses = self.beta * ratio

        chosen_rewards = self.beta * (policy_chosen_logps.to(self.device)).detach()
        rejected_rewards = self.beta * (policy_rejected_logps.to(self.device)).detach()

        return losses, chosen_rewards, rejected_rewards, torch.mean(ratio).item(), torch.mean(log_odds).item()

    @staticmethod
    def get_batch_logps(logits, labels, average_log_prob=False, label_pad_token_id=-100, is_encoder_decoder=False):
        if logits.shape[:-1] != labels.shape:
            raise ValueError("Logits (batch and sequence length dim) and labels must have the same shape.")

        if not is_encoder_decoder:
            labels = labels[:, 1:].clone()
            logits = logits[:, :-1, :]
        loss_mask = labels != label_pad_token_id

        # dummy token; we'll ignore the losses on these tokens later
        labels[labels == label_pad_token_id] = 0

        per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)

        if average_log_prob:
            return (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
        else:
            return (per_token_logps * loss_mask).sum(-1)

    def concatenated_forward(self, model, batch):
        concatenated_batch = self.concatenated_inputs(
            batch,
            is_encoder_decoder=self.is_encoder_decoder,
            label_pad_token_id=self.label_pad_token_id,
            padding_value=self.padding_value,
            device=self.device,
        )
        len_chosen = batch["chosen_labels"].shape[0]

        model_kwargs = {}

        outputs = model(
            concatenated_batch["concatenated_input_ids"],
            attention_mask=concatenated_batch["concatenated_attention_mask"],
            use_cache=False,
            **model_kwargs,
        )
        all_logits = outputs.logits

        def cross_entropy_loss(logits, labels):
            if not self.is_encoder_decoder:
                # Shift so that tokens < n predict n
                logits = logits[..., :-1, :].contiguous()
                labels = labels[..., 1:].contiguous()
            # Flatten the tokens
            loss_fct = nn.CrossEntropyLoss()
            logits = logits.view(-1, logits.shape[-1])
            labels = labels.view(-1)
            # Enable model parallelism
            labels = labels.to(logits.device)
            loss = loss_fct(logits, labels)
            return loss

        if self.is_encoder_decoder:
            labels = concatenated_batch["concatenated_labels"].clone()
        else:
            labels = concatenated_batch["concatenated_input_ids"].clone()
            if FIXED:
                attention_mask = concatenated_batch["concatenated_attention_mask"]
                labels = torch.where(attention_mask == 1, labels, self.label_pad_token_id)

        chosen_nll_loss = cross_entropy_loss(all_logits[:len_chosen], labels[:len_chosen])

        all_logps = self.get_batch_logps(
            all_logits,
            concatenated_batch["concatenated_labels"],
            average_log_prob=True,
            is_encoder_decoder=self.is_encoder_decoder,
            label_pad_token_id=self.label_pad_token_id,
        )

        chosen_logps = all_logps[:len_chosen]
        rejected_logps = all_logps[len_chosen:]

        chosen_logits = all_logits[:len_chosen]
        rejected_logits = all_logits[len_chosen:]

        return (chosen_logps, rejected_logps, chosen_logits, rejected_logits, chosen_nll_loss)

    def get_batch_loss_metrics(self, model, batch):
        metrics = {}
        (
            policy_chosen_logps,
            policy_rejected_logps,
            policy_chosen_logits,
            policy_rejected_logits,
            policy_nll_loss,
        ) = self.concatenated_forward(model, batch)

        losses, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen = self.odds_ratio_loss(
            policy_chosen_logps, policy_rejected_logps
        )
        # full ORPO loss
        loss = policy_nll_loss - losses.mean()

        metrics["rewards/chosen"] = chosen_rewards.mean()
        metrics["rewards/rejected"] = rejected_rewards.mean()
        metrics["logps/chosen"] = policy_chosen_logps.detach().mean()
        metrics["logps/rejected"] = policy_rejected_logps.detach().mean()
        metrics["nll_loss"] = policy_nll_loss.detach().mean()
        metrics["log_odds_ratio"] = log_odds_ratio
        return loss, metrics


def tokenize_row(prompt_tokens, chosen_tokens, rejected_tokens):
    """What ORPOTrainer.tokenize_row returns for a decoder-only model: bos + prompt, answer + eos."""
    prompt_ids = [BOS] + prompt_tokens
    row = {
        "prompt_input_ids": prompt_ids,
        "prompt_attention_mask": [1] * len(prompt_ids),
    }
    for name, answer in (("chosen", chosen_tokens), ("rejected", rejected_tokens)):
        ids = prompt_ids + answer + [EOS]
        row[f"{name}_input_ids"] = ids
        row[f"{name}_attention_mask"] = [1] * len(ids)
        row[f"{name}_labels"] = [LABEL_PAD] * len(prompt_ids) + answer + [EOS]
    return row


def main():
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()

    g = torch.Generator().manual_seed(1)

    def toks(n):
        return torch.randint(3, 64, (n,), generator=g).tolist()

    features = [
        tokenize_row(toks(5), toks(9), toks(4)),
        tokenize_row(toks(3), toks(2), toks(7)),
        tokenize_row(toks(6), toks(3), toks(3)),
    ]
    batch = DPODataCollatorWithPadding(pad_token_id=PAD, label_pad_token_id=LABEL_PAD)(features)

    trainer = ORPOTrainer(model, beta=0.1)
    with torch.no_grad():
        loss, metrics = trainer.get_batch_loss_metrics(model, batch)

    print("fixed" if FIXED else "buggy", "ORPO loss:", round(loss.item(), 6))
    for k, v in metrics.items():
        print(f"  {k}: {float(v):.6f}")


if __name__ == "__main__":
    main()
