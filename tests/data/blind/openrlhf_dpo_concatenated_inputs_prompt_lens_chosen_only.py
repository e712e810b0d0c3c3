# OpenRLHF, OpenRLHF/OpenRLHF#294 (fixed by commit 6106fb22 "fix dpo loss mask").
# DPOTrainer.concatenated_forward stacks chosen and rejected rows (2B rows) but hands _get_batch_logps the B
# prompt_id_lens of the batch: `zip(loss_masks, prompt_id_lens)` stops after the chosen rows, so the prompt tokens
# of every rejected row stay in its loss mask and their log-probs are summed into rejected_logps.
# Fix: concatenated_inputs takes prompt_id_lens and returns `prompt_id_lens * 2`, one entry per stacked row.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD, EOS = 0, 2


def zero_pad_sequences(sequences, side: str = "left", value=0):
    assert side in ("left", "right")
    max_len = max(seq.size(-1) for seq in sequences)
    padded_sequences = []
    for seq in sequences:
        pad_len = max_len - seq.size(-1)
        padding = (pad_len, 0) if side == "left" else (0, pad_len)
        padded_sequences.append(F.pad(seq, padding, value=value))
    return torch.stack(padded_sequences, dim=0)


class ToyTokenizer:
    """Whitespace tokenizer standing in for the HF tokenizer RewardDataset calls."""

    pad_token_id, eos_token_id, eos_token = PAD, EOS, "</s>"

    def __init__(self):
        self.vocab = {"<pad>": PAD, "<s>": 1, "</s>": EOS}

    def __call__(self, text, max_length=64, padding=False, truncation=True, return_tensors="pt"):
        ids = [1] + [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]
        ids = ids[:max_length]
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}


class RewardDataset:
    """openrlhf/datasets/reward_dataset.py with is_dpo=True (input_template "Human:\\n{}\\nAssistant:\\n")."""

    def __init__(self, dataset, tokenizer, max_length, input_template="Human: {} Assistant:"):
        self.tokenizer, self.max_length = tokenizer, max_length
        self.prompts, self.chosens, self.rejects, self.prompt_ids_lens = [], [], [], []
        for data in dataset:
            prompt = input_template.format(data["prompt"])
            prompt_token = self.tokenizer(prompt, max_length=self.max_length, padding=False, truncation=True)
            prompt_ids_len = prompt_token["attention_mask"].int().sum().item()
            if prompt_ids_len >= self.max_length - 2:
                continue
            self.prompt_ids_lens.append(prompt_ids_len)
            self.prompts.append(prompt)
            self.chosens.append(data["chosen"])
            self.rejects.append(data["rejected"])

    def __len__(self):
        return len(self.chosens)

    def __getitem__(self, idx):
        prompt, chosen, reject = self.prompts[idx], self.chosens[idx], self.rejects[idx]
        extra = self.prompt_ids_lens[idx]
        chosen = prompt + " " + chosen + " " + self.tokenizer.eos_token
        chosen_token = self.tokenizer(chosen, max_length=self.max_length, padding=False, truncation=True)
        reject = prompt + " " + reject + " " + self.tokenizer.eos_token
        reject_token = self.tokenizer(reject, max_length=self.max_length, padding=False, truncation=True)
        chosen_token["input_ids"][0][-1] = self.tokenizer.eos_token_id
        reject_token["input_ids"][0][-1] = self.tokenizer.eos_token_id
        chosen_token["attention_mask"][0][-1] = True
        reject_token["attention_mask"][0][-1] = True
        return (chosen_token["input_ids"], chosen_token["attention_mask"], reject_token["input_ids"],
                reject_token["attention_mask"], extra)

    def collate_fn(self, item_list):
        chosen_ids, chosen_masks, reject_ids, rejects_masks, extras = [], [], [], [], []
        for chosen_id, chosen_mask, reject_id, rejects_mask, extra in item_list:
            chosen_ids.append(chosen_id)
            chosen_masks.append(chosen_mask)
            reject_ids.append(reject_id)
            rejects_masks.append(rejects_mask)
            extras.append(extra)
        chosen_ids = zero_pad_sequences(chosen_ids, value=self.tokenizer.pad_token_id)
        chosen_masks = zero_pad_sequences(chosen_masks)
        reject_ids = zero_pad_sequences(reject_ids, value=self.tokenizer.pad_token_id)
        rejects_masks = zero_pad_sequences(rejects_masks)
        return chosen_ids, chosen_masks, reject_ids, rejects_masks, extras


class Actor(nn.Module):
    """openrlhf/models/actor.py: position_ids from the attention mask (issue #217)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, sequences, num_actions=None, attention_mask=None, return_output=False):
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        output = self.model(sequences, attention_mask=attention_mask, position_ids=position_ids)
        return output


class DPOLoss(nn.Module):
    def __init__(self, beta: float, label_smoothing: float = 0.0, ipo: bool = False):
        super().__init__()
        self.beta, self.label_smoothing, self.ipo = beta, label_smoothing, ipo

    def forward(self, policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps):
        pi_logratios = policy_chosen_logps - policy_rejected_logps
        ref_logratios = reference_chosen_logps - reference_rejected_logps
        logits = pi_logratios - ref_logratios
        if self.ipo:
            losses = (logits - 1 / (2 * self.beta)) ** 2
        else:
            losses = (-F.logsigmoid(self.beta * logits) * (1 - self.label_smoothing)
                      - F.logsigmoid(-self.beta * logits) * self.label_smoothing)
        loss = losses.mean()
        chosen_rewards = self.beta * (policy_chosen_logps - reference_chosen_logps).detach()
        rejected_rewards = self.beta * (policy_rejected_logps - reference_rejected_logps).detach()
        return loss, chosen_rewards, rejected_rewards


class DPOTrainer:
    """openrlhf/trainer/dpo_trainer.py (concatenated_forward / concatenated_inputs / _get_batch_logps)."""

    def __init__(self, model, ref_model, tokenizer, beta=0.1):
        self.model, self.ref_model, self.tokenizer = model, ref_model, tokenizer
        self.loss_fn = DPOLoss(beta)

    def concatenated_forward(self, model, chosen_ids, c_mask, reject_ids, r_mask, prompt_id_lens):
        if FIXED:
            input_ids, att_masks, prompt_id_lens = self.concatenated_inputs(
                chosen_ids, c_mask, reject_ids, r_mask, prompt_id_lens
            )
        else:
            input_ids, att_masks = self.concatenated_inputs(chosen_ids, c_mask, reject_ids, r_mask)
        output = model(input_ids, attention_mask=att_masks, return_output=True)
        all_logits = output["logits"]
        all_logps = self._get_batch_logps(all_logits, input_ids, att_masks, prompt_id_lens, average_log_prob=False)
        chosen_logps = all_logps[: chosen_ids.shape[0]]
        rejected_logps = all_logps[chosen_ids.shape[0]:]
        return chosen_logps, rejected_logps, []

    def concatenated_inputs(self, chosen_ids, c_mask, reject_ids, r_mask, prompt_id_lens=None):
        def pad_to_length(tensor, length, pad_value, dim=-1):
            if tensor.size(dim) >= length:
                return tensor
            pad_size = list(tensor.shape)
            pad_size[dim] = length - tensor.size(dim)
            return torch.cat([tensor, pad_value * torch.ones(*pad_size, dtype=tensor.dtype, device=tensor.device)],
                             dim=dim)

        max_length = max(chosen_ids.shape[1], reject_ids.shape[1])
        inputs_ids = torch.cat(
            (pad_to_length(chosen_ids, max_length, self.tokenizer.pad_token_id),
             pad_to_length(reject_ids, max_length, self.tokenizer.pad_token_id)),
            dim=0,
        )
        max_length = max(c_mask.shape[1], r_mask.shape[1])
        att_masks = torch.cat((pad_to_length(c_mask, max_length, 0), pad_to_length(r_mask, max_length, 0)), dim=0)
        if FIXED:
            return inputs_ids, att_masks, prompt_id_lens * 2
        return inputs_ids, att_masks

    def _get_batch_logps(self, logits, labels, attention_mask, prompt_id_lens, average_log_prob=False):
        assert logits.shape[:-1] == labels.shape
        labels = labels[:, 1:].clone()
        logits = logits[:, :-1, :]
        loss_masks = attention_mask.clone().bool()
        # mask prompts
        for mask, source_len in zip(loss_masks, prompt_id_lens):
            mask[:source_len] = False
        loss_masks = loss_masks[:, 1:]
        labels[loss_masks == False] = 0  # noqa: E712
        per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
        if average_log_prob:
            return (per_token_logps * loss_masks).sum(-1) / loss_masks.sum(-1)
        return (per_token_logps * loss_masks).sum(-1)

    def evaluate_batch(self, chosen_ids, c_mask, reject_ids, r_mask, prompt_id_lens):
        chosen_ids, c_mask = chosen_ids.squeeze(1), c_mask.squeeze(1)
        reject_ids, r_mask = reject_ids.squeeze(1), r_mask.squeeze(1)
        with torch.no_grad():
            chosen_logps, rejected_logps, _ = self.concatenated_forward(
                self.model, chosen_ids, c_mask, reject_ids, r_mask, prompt_id_lens)
            ref_chosen_logps, ref_rejected_logps, _ = self.concatenated_forward(
                self.ref_model, chosen_ids, c_mask, reject_ids, r_mask, prompt_id_lens)
        loss, chosen_reward, reject_reward = self.loss_fn(
            chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
        return chosen_logps, rejected_logps, loss, chosen_reward, reject_reward


def main():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS, attn_implementation="sdpa")
    ref = LlamaForCausalLM(cfg).eval()
    policy = LlamaForCausalLM(cfg).eval()
    policy.load_state_dict(ref.state_dict())
    with torch.no_grad():  # the policy after some DPO steps: close to, not equal to, the reference
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))

    tokenizer = ToyTokenizer()
    data = [
        {"prompt": "what is the capital of france", "chosen": "paris is the capital city", "rejected": "no idea sorry"},
        {"prompt": "name a color of the clear sky", "chosen": "the sky is blue", "rejected": "probably green"},
    ]
    dataset = RewardDataset(data, tokenizer, max_length=48)
    batch = dataset.collate_fn([dataset[i] for i in range(len(dataset))])
    trainer = DPOTrainer(Actor(policy), Actor(ref), tokenizer)
    chosen_logps, rejected_logps, loss, chosen_reward, reject_reward = trainer.evaluate_batch(*batch)
    print("prompt_id_lens", batch[4])
    print("chosen_logps", [round(v, 4) for v in chosen_logps.tolist()])
    print("rejected_logps", [round(v, 4) for v in rejected_logps.tolist()])
    print("reject_reward", [round(v, 4) for v in reject_reward.tolist()])
    print("preference_loss", round(loss.item(), 6))
    print("acc", (chosen_reward > reject_reward).float().mean().item())


if __name__ == "__main__":
    main()
