# OpenRLHF, OpenRLHF/OpenRLHF commit a32a7322 ("fix dpo padding side").
# RewardDataset.collate_fn left-pads chosen/rejected masks for DPO too, so DPOTrainer._get_batch_logps'
# `mask[:source_len] = False` hides the left padding instead of the prompt, and prompt tokens enter the logps.
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


class RewardDataset:
    """openrlhf/datasets/reward_dataset.py, is_dpo=True; items are already tokenized here."""

    def __init__(self, items, is_dpo=True):
        self.items = items
        self.is_dpo = is_dpo

    def __getitem__(self, idx):
        prompt, chosen, reject = self.items[idx]
        chosen_ids = torch.cat([prompt, chosen, torch.tensor([EOS])]).unsqueeze(0)
        reject_ids = torch.cat([prompt, reject, torch.tensor([EOS])]).unsqueeze(0)
        extra = prompt.numel()  # prompt_ids_len
        return chosen_ids, torch.ones_like(chosen_ids), reject_ids, torch.ones_like(reject_ids), extra

    def collate_fn(self, item_list):
        chosen_ids, chosen_masks, reject_ids, rejects_masks, extras = [], [], [], [], []
        for chosen_id, chosen_mask, reject_id, rejects_mask, extra in item_list:
            chosen_ids.append(chosen_id)
            chosen_masks.append(chosen_mask)
            reject_ids.append(reject_id)
            rejects_masks.append(rejects_mask)
            extras.append(extra)

        if FIXED:
            if self.is_dpo:
                padding_side = "right"
            else:
                padding_side = "left"
            chosen_ids = zero_pad_sequences(chosen_ids, side=padding_side, value=PAD)
            chosen_masks = zero_pad_sequences(chosen_masks, side=padding_side)
            reject_ids = zero_pad_sequences(reject_ids, side=padding_side, value=PAD)
            rejects_masks = zero_pad_sequences(rejects_masks, side=padding_side)
        else:
            chosen_ids = zero_pad_sequences(chosen_ids, value=PAD)
            chosen_masks = zero_pad_sequences(chosen_masks)
            reject_ids = zero_pad_sequences(reject_ids, value=PAD)
            rejects_masks = zero_pad_sequences(rejects_masks)
        return chosen_ids, chosen_masks, reject_ids, rejects_masks, extras


class Actor(nn.Module):
    """openrlhf/models/actor.py forward (non-packing path)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, sequences, num_actions=None, attention_mask=None, return_output=False):
        # https://github.com/OpenLLMAI/OpenRLHF/issues/217
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        output = self.model(sequences, attention_mask=attention_mask, position_ids=position_ids)
        return output


class DPOTrainer:
    def __init__(self, model):
        self.model = model

    def concatenated_forward(self, model, chosen_ids, c_mask, reject_ids, r_mask, prompt_id_lens):
        input_ids, att_masks, prompt_id_lens = self.concatenated_inputs(
            chosen_ids, c_mask, reject_ids, r_mask, prompt_id_lens
        )
        output = model(input_ids, attention_mask=att_masks, return_output=True)
        all_logits = output["logits"]
        all_logps = self._get_batch_logps(all_logits, input_ids, att_masks, prompt_id_lens, average_log_prob=False)
        chosen_logps = all_logps[: chosen_ids.shape[0]]
        rejected_logps = all_logps[chosen_ids.shape[0] :]
        return chosen_logps, rejected_logps

    def concatenated_inputs(self, chosen_ids, c_mask, reject_ids, r_mask, prompt_id_lens):
        def pad_to_length(tensor, length, pad_value, dim=-1):
            if tensor.size(dim) >= length:
                return tensor
            pad_size = list(tensor.shape)
            pad_size[dim] = length - tensor.size(dim)
            return torch.cat([tensor, pad_value * torch.ones(*pad_size, dtype=tensor.dtype)], dim=dim)

        max_length = max(chosen_ids.shape[1], reject_ids.shape[1])
        inputs_ids = torch.cat(
            (pad_to_length(chosen_ids, max_length, PAD), pad_to_length(reject_ids, max_length, PAD)), dim=0
        )
        max_length = max(c_mask.shape[1], r_mask.shape[1])
        att_masks = torch.cat((pad_to_length(c_mask, max_length, 0), pad_to_length(r_mask, max_length, 0)), dim=0)
        return inputs_ids, att_masks, prompt_id_lens * 2

    def _get_batch_logps(self, logits, labels, attention_mask, prompt_id_lens, average_log_prob=False):
        assert logits.shape[:-1] == labels.shape
        labels = labels[:, 1:].clone()
        logits = logits[:, :-1, :]

        loss_masks = attention_mask.clone().bool()
        # mask prompts
        for mask, source_len in zip(loss_masks, prompt_id_lens):
            mask[:source_len] = False
        loss_masks = loss_masks[:, 1:]

        # dummy token; we'll ignore the losses on these tokens later
        labels[loss_masks == False] = 0
        per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
        if average_log_prob:
            return (per_token_logps * loss_masks).sum(-1) / loss_masks.sum(-1)
        return (per_token_logps * loss_masks).sum(-1)


cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=PAD, eos_token_id=EOS, attn_implementation="eager")
model = Actor(LlamaForCausalLM(cfg).eval())
trainer = DPOTrainer(model)


def rand(n):
    return torch.randint(3, 64, (n,))


items = [(rand(5), rand(4), rand(7)), (rand(9), rand(3), rand(2)), (rand(3), rand(6), rand(5))]
ds = RewardDataset(items, is_dpo=True)

def fit_step(batch):
    # DPOTrainer.fit: chosen_ids = chosen_ids.squeeze(1) ... for each tensor of the batch
    chosen_ids, c_mask, reject_ids, r_mask, prompt_id_lens = batch
    return chosen_ids.squeeze(1), c_mask.squeeze(1), reject_ids.squeeze(1), r_mask.squeeze(1), prompt_id_lens


with torch.no_grad():
    batch = ds.collate_fn([ds[i] for i in range(len(items))])
    chosen, rejected = trainer.concatenated_forward(model, *fit_step(batch))
    ref_c, ref_r = [], []
    for i in range(len(items)):  # one pair at a time: no padding at all
        c, r = trainer.concatenated_forward(model, *fit_step(ds.collate_fn([ds[i]])))
        ref_c.append(c)
        ref_r.append(r)
    ref_c, ref_r = torch.cat(ref_c), torch.cat(ref_r)

print("chosen_logps batched  :", [round(v, 4) for v in chosen.tolist()])
print("chosen_logps one-by-one:", [round(v, 4) for v in ref_c.tolist()])
diff = max((chosen - ref_c).abs().max().item(), (rejected - ref_r).abs().max().item())
print(f"max |batched - per-example| policy logps: {diff:.6f}")
