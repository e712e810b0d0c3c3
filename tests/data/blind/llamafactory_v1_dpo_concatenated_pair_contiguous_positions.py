# LLaMA-Factory v1 DPO trainer, hiyouga/LlamaFactory commit 93343b299 ("fix(v1): use block-diagonal attention
# mask and per-document position_ids in DPO", landed with the DPO trainer in hiyouga/LlamaFactory#10544).
#
# v1 renders a preference pair as ONE row [chosen prompt+response | rejected prompt+response] with
# token_type_ids 1 / 2 marking the two documents (core/utils/rendering.py process_samples). Before the fix,
# DPOTrainer.compute_loss / _compute_ref_logps forwarded only input_ids and the 0/1 padding attention_mask, so
# the rejected half ran with positions continuing after the chosen half, under the plain causal mask over the
# whole row: the rejected log-probs were conditioned on the chosen response. The fix builds the model inputs
# with _prepare_model_inputs: attention_mask = token_type_ids and position_ids that restart at each document.
# Trimmed port: tiny Qwen2 (sdpa) policy and reference, sigmoid DPO loss, right-padded batch of two pairs.
import sys

import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv
IGNORE_INDEX = -100
Tensor = torch.Tensor


def compute_sigmoid_dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
                             beta=0.1, label_smoothing=0.0):
    pi_logratios = policy_chosen_logps - policy_rejected_logps
    ref_logratios = ref_chosen_logps - ref_rejected_logps
    logits = pi_logratios - ref_logratios
    return (-F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing)


def render_pair(chosen_prompt, chosen_resp, rejected_prompt, rejected_resp):
    # rendering.py: each side rendered on its own, then concatenated; token_type_ids 1 = chosen, 2 = rejected
    chosen_input = {
        "input_ids": chosen_prompt + chosen_resp,
        "attention_mask": [1] * (len(chosen_prompt) + len(chosen_resp)),
        "labels": [IGNORE_INDEX] * len(chosen_prompt) + chosen_resp,
    }
    rejected_input = {
        "input_ids": rejected_prompt + rejected_resp,
        "attention_mask": [1] * (len(rejected_prompt) + len(rejected_resp)),
        "labels": [IGNORE_INDEX] * len(rejected_prompt) + rejected_resp,
    }
    chosen_input["token_type_ids"] = [1] * len(chosen_input["input_ids"])
    rejected_input["token_type_ids"] = [2] * len(rejected_input["input_ids"])
    return {
        "input_ids": chosen_input["input_ids"] + rejected_input["input_ids"],
        "attention_mask": chosen_input["attention_mask"] + rejected_input["attention_mask"],
        "labels": chosen_input["labels"] + rejected_input["labels"],
        "token_type_ids": chosen_input["token_type_ids"] + rejected_input["token_type_ids"],
    }


def collate(model_inputs, pad_token_id):
    # right padding, as the v1 default collator pads
    max_len = max(len(m["input_ids"]) for m in model_inputs)
    pad_values = {"input_ids": pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX, "token_type_ids": 0}
    batch = {}
    for key, pad in pad_values.items():
        batch[key] = torch.tensor([m[key] + [pad] * (max_len - len(m[key])) for m in model_inputs])
    return batch


class DPOTrainer:
    def __init__(self, model, ref_model, pref_beta=0.1):
        self.model = model
        self.ref_model = ref_model
        self.pref_beta = pref_beta
        self.dpo_label_smoothing = 0.0
        self.ld_alpha = None
        self.device = torch.device("cpu")

    def _extract_chosen_rejected_logps(self, logits, labels, token_type_ids):
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        shift_token_type_ids = token_type_ids[..., 1:]

        per_token_logps = -F.cross_entropy(
            shift_logits.view(-1, shift_logits.size(-1)),
            shift_labels.view(-1),
            reduction="none",
            ignore_index=IGNORE_INDEX,
        ).view(shift_labels.size(0), shift_labels.size(1))

        loss_mask = shift_labels != IGNORE_INDEX
        chosen_mask = (shift_token_type_ids == 1) & loss_mask
        rejected_mask = (shift_token_type_ids == 2) & loss_mask

        chosen_valid_len = chosen_mask.sum(dim=-1)
        rejected_valid_len = rejected_mask.sum(dim=-1)

        chosen_logps = (per_token_logps * chosen_mask.float()).sum(dim=-1)
        rejected_logps = (per_token_logps * rejected_mask.float()).sum(dim=-1)

        chosen_logps_avg = chosen_logps / (chosen_valid_len + 1e-6)
        rejected_logps_avg = rejected_logps / (rejected_valid_len + 1e-6)
        return chosen_logps, rejected_logps, chosen_logps_avg, rejected_logps_avg

    def _prepare_model_inputs(self, input_ids: Tensor, token_type_ids: Tensor) -> dict:
        batch_size, seq_len = token_type_ids.shape
        arange = torch.arange(seq_len, device=self.device).unsqueeze(0).expand(batch_size, -1)

        chosen_mask = token_type_ids == 1
        rejected_mask = token_type_ids == 2
        chosen_lens = chosen_mask.sum(dim=1, keepdim=True)

        position_ids = torch.zeros_like(token_type_ids)
        position_ids[chosen_mask] = arange[chosen_mask]
        position_ids[rejected_mask] = (arange - chosen_lens)[rejected_mask]

        return {
            "input_ids": input_ids,
            "attention_mask": token_type_ids,  # block-diagonal doc mask (v5)
            "position_ids": position_ids,
        }

    def _model_inputs(self, batch):
        input_ids = batch["input_ids"].to(self.device, non_blocking=True)
        token_type_ids = batch["token_type_ids"].to(self.device, non_blocking=True)
        if FIXED:
            return self._prepare_model_inputs(input_ids, token_type_ids)
        attention_mask = batch.get("attention_mask")
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device, non_blocking=True)
        model_inputs = {"input_ids": input_ids}
        if attention_mask is not None:
            model_inputs["attention_mask"] = attention_mask
        return model_inputs

    @torch.no_grad()
    def _compute_ref_logps(self, batch):
        labels = batch["labels"].to(self.device, non_blocking=True)
        token_type_ids = batch["token_type_ids"].to(self.device, non_blocking=True)
        model_inputs = self._model_inputs(batch)
        ref_logits = self.ref_model(**model_inputs, use_cache=False, return_dict=True).logits.float()
        return self._extract_chosen_rejected_logps(ref_logits, labels, token_type_ids)

    def compute_loss(self, batch):
        labels = batch["labels"].to(self.device, non_blocking=True)
        token_type_ids = batch["token_type_ids"].to(self.device, non_blocking=True)
        model_inputs = self._model_inputs(batch)

        model_output = self.model(**model_inputs, use_cache=False, return_dict=True)
        logits = model_output.logits.float()

        policy_chosen_logps, policy_rejected_logps, _, _ = self._extract_chosen_rejected_logps(
            logits, labels, token_type_ids
        )
        ref_chosen_logps, ref_rejected_logps, _, _ = self._compute_ref_logps(batch)
        losses = compute_sigmoid_dpo_loss(
            policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
            beta=self.pref_beta, label_smoothing=self.dpo_label_smoothing,
        )
        return losses.mean(), policy_chosen_logps, policy_rejected_logps


def build(seed):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0, pad_token_id=0,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).eval()


def main():
    policy = build(0)
    ref = build(1)
    g = torch.Generator().manual_seed(7)

    def toks(n):
        return torch.randint(3, 96, (n,), generator=g).tolist()

    p0, p1 = toks(6), toks(4)
    samples = [
        render_pair(p0, toks(5), p0, toks(7)),
        render_pair(p1, toks(3), p1, toks(4)),
    ]
    batch = collate(samples, pad_token_id=0)
    trainer = DPOTrainer(policy, ref, pref_beta=0.1)
    with torch.no_grad():
        loss, chosen, rejected = trainer.compute_loss(batch)
    print("chosen logps  ", [round(v, 4) for v in chosen.tolist()])
    print("rejected logps", [round(v, 4) for v in rejected.tolist()])
    print("dpo loss", round(loss.item(), 6))


if __name__ == "__main__":
    main()
