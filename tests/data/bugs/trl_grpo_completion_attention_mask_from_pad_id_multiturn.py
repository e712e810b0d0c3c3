"""TRL GRPO: completion attention mask inferred from `completion_ids != pad_token_id` (huggingface/trl#4970).

Citation: huggingface/trl PR #4970 "Revert change in GRPO from NeMo-Gym Integration" (commit 1bd2a52ec), which
reverts two GRPO changes made by PR #4848 (commit 90b875c57). Read in the upstream git history:
`GRPOTrainer._generate_and_score_completions` and `_get_per_token_logps_and_entropies` in
trl/trainer/grpo_trainer.py at 1bd2a52ec^ and the #4970 diff; the reviewer's reason is quoted from the PR thread.

Bug: for multi-turn rollouts (#4848) the trainer built the logprob forward's mask as
`completion_attention_mask = (completion_ids != self.pad_token_id).long()` ("attend to all non-padding tokens").
The reviewer (#4970): "pad tokens should be masked, but the mask should not be inferred from token values, because
a same id can be used for other tokens (usually EOS)". With pad == EOS, every EOS inside a multi-turn completion
(the end of each assistant turn before a tool result) is masked as a key, so all later completion tokens are
scored without seeing it.

Fix: `attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)` with `completion_mask` the ones-per-real-
token mask built before right padding (the revert also drops the rollout's custom `completion_mask`).

This program: a small GRPOTrainer slice (left-padded prompts, right-padded completions, pad_token_id ==
eos_token_id as in tokenizers whose pad is their EOS), a rollout function returning two-turn completions with an
EOS in the middle, and `_get_per_token_logps_and_entropies` over a small causal LM whose forward turns the 2-D
`attention_mask` into a boolean causal-and-padding mask for `F.scaled_dot_product_attention`. Prints per-row sums
of the completion log-probs; they differ after the first mid-completion EOS.
"""

import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def pad(tensors, padding_value=0, padding_side="right"):
    """trl.trainer.utils.pad for 1-D tensors."""
    max_len = max(t.size(0) for t in tensors)
    output = torch.full((len(tensors), max_len), padding_value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        if padding_side == "left":
            output[i, max_len - t.size(0):] = t
        else:
            output[i, : t.size(0)] = t
    return output


def selective_log_softmax(logits, index):
    return torch.gather(logits.log_softmax(-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


@dataclass
class GRPOConfig:
    per_device_train_batch_size: int = 2
    temperature: float = 1.0
    mask_truncated_completions: bool = False


class TinyCausalLM(nn.Module):
    def __init__(self, vocab_size=40, hidden_size=32, num_heads=4, num_layers=2, max_position=64):
        super().__init__()
        self.num_heads = num_heads
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_positions = nn.Embedding(max_position, hidden_size)
        self.qkv = nn.ModuleList(nn.Linear(hidden_size, 3 * hidden_size) for _ in range(num_layers))
        self.o = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, logits_to_keep=0, use_cache=False):
        b, n = input_ids.shape
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        h = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        for qkv, o in zip(self.qkv, self.o):
            q, k, v = qkv(h).view(b, n, 3, self.num_heads, -1).transpose(1, 3).unbind(2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            h = h + o(out.transpose(1, 2).reshape(b, n, -1))
        logits = self.lm_head(self.norm(h))
        return type("Output", (), {"logits": logits[:, -logits_to_keep:] if logits_to_keep else logits})


def rollout_func(prompts):
    """Multi-turn environment rollout: assistant turn, EOS, tool result, assistant turn, EOS."""
    eos = 1
    completions = [
        [12, 13, 14, eos, 30, 31, 32, 15, 16, eos],
        [17, 18, eos, 33, 34, 19, eos],
    ]
    env_mask = [[1, 1, 1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 1, 1]]
    return completions, {"completion_mask": env_mask}


class GRPOTrainer:
    def __init__(self, model, args, pad_token_id, eos_token_id):
        self.model = model
        self.args = args
        self.temperature = args.temperature
        self.mask_truncated_completions = args.mask_truncated_completions
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.model_kwarg_keys = {"input_ids", "attention_mask", "logits_to_keep", "use_cache"}

    def _generate(self, prompts):
        prompt_ids_list = prompts
        completion_ids_list, extra_fields = rollout_func(prompts)
        return prompt_ids_list, completion_ids_list, extra_fields

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None):
        """Compute log-probs for each token."""
        batch_size = batch_size or input_ids.size(0)
        all_logps = []
        for start in range(0, input_ids.size(0), batch_size):
            input_ids_batch = input_ids[start : start + batch_size]
            attention_mask_batch = attention_mask[start : start + batch_size]
            model_inputs = {"input_ids": input_ids_batch, "attention_mask": attention_mask_batch}
            if "logits_to_keep" in self.model_kwarg_keys:
                # We add 1 to `logits_to_keep` because the last logits of the sequence is later excluded
                model_inputs["logits_to_keep"] = logits_to_keep + 1
            model_inputs["use_cache"] = False
            logits = model(**model_inputs).logits
            logits = logits[:, :-1, :]  # (B, L-1, H)
            logits = logits[:, -logits_to_keep:, :]  # (B, logits_to_keep, H)
            logits = logits / self.temperature
            completion_ids = input_ids_batch[:, -logits_to_keep:]
            all_logps.append(selective_log_softmax(logits, completion_ids))
        return torch.cat(all_logps, dim=0), None

    def _generate_and_score_completions(self, prompts):
        prompt_ids_list, completion_ids_list, extra_fields = self._generate(prompts)

        # Convert lists of token IDs to padded tensors
        prompt_ids = [torch.tensor(ids) for ids in prompt_ids_list]
        prompt_mask = [torch.ones_like(ids, dtype=torch.long) for ids in prompt_ids]
        prompt_ids = pad(prompt_ids, padding_value=self.pad_token_id, padding_side="left")
        prompt_mask = pad(prompt_mask, padding_value=0, padding_side="left")
        completion_ids = [torch.tensor(ids) for ids in completion_ids_list]

        if not FIXED and "completion_mask" in extra_fields:
            # Allow custom completion_mask from rollout_func for multi-turn training
            completion_mask_list = extra_fields.pop("completion_mask")
            completion_mask = [torch.tensor(m, dtype=torch.long) for m in completion_mask_list]
        else:
            completion_mask = [torch.ones_like(ids, dtype=torch.long) for ids in completion_ids]
        completion_ids = pad(completion_ids, padding_value=self.pad_token_id, padding_side="right")
        completion_mask = pad(completion_mask, padding_value=0, padding_side="right")

        # Concatenate prompt_mask with completion_mask for logit computation
        prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P+C)
        if FIXED:
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (B, P+C)
        else:
            # attend to all non-padding tokens, but mask out user/tool result tokens in loss
            completion_attention_mask = (completion_ids != self.pad_token_id).long()
            attention_mask = torch.cat([prompt_mask, completion_attention_mask], dim=1)  # (B, P+C)

        logits_to_keep = completion_ids.size(1)  # we only need the logits for the completion tokens
        batch_size = self.args.per_device_train_batch_size
        with torch.no_grad():
            old_per_token_logps, _ = self._get_per_token_logps_and_entropies(
                self.model, prompt_completion_ids, attention_mask, logits_to_keep, batch_size
            )
        return old_per_token_logps, completion_mask


def main():
    torch.manual_seed(0)
    # The tokenizer's pad token is its EOS token (id 1).
    trainer = GRPOTrainer(TinyCausalLM(), GRPOConfig(), pad_token_id=1, eos_token_id=1)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 9]]
    logps, completion_mask = trainer._generate_and_score_completions(prompts)
    print("completion logp sums:", [round(v, 4) for v in (logps * completion_mask).sum(-1).tolist()])
    print("per-token logps row 0:", [round(v, 3) for v in logps[0].tolist()])


if __name__ == "__main__":
    main()
