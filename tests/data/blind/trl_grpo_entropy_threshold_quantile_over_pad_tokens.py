# Citation: huggingface/trl#3715 (commit 97085539a, "BUG: Disregard pad token entropies for entropy
#   threshold calculation").
# Upstream: trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss (token_entropy_percentile_threshold > 0),
#   with _get_per_token_logps_and_entropies, selective_log_softmax / entropy_from_logits (trl/trainer/utils.py)
#   and the completion_mask built in _generate_and_score_completions (everything after the first EOS masked).
# Bug: the high-entropy token mask took its quantile threshold over ALL completion positions,
#   `torch.quantile(entropies.flatten(), p)`, so the padding positions after EOS (completion_mask == 0)
#   were counted; with short completions the threshold moves and a different set of real tokens is trained.
# Fix: `_compute_entropy_mask(entropies, completion_mask)`: the quantile is taken over
#   `entropies[completion_mask.bool()]` only, and padding entropies are zeroed before the comparison.
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- trl/trainer/utils.py ------------------------------------------------------------------
def selective_log_softmax(logits, index) -> torch.Tensor:
    if logits.dtype in [torch.float32, torch.float64]:
        selected_logits = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
        per_token_logps = selected_logits - logsumexp_values
    else:
        per_token_logps = []
        for row_logits, row_labels in zip(logits, index):
            row_logps = F.log_softmax(row_logits, dim=-1)
            per_token_logps.append(row_logps.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
        per_token_logps = torch.stack(per_token_logps)
    return per_token_logps


def entropy_from_logits(logits, chunk_size: int = 1) -> torch.Tensor:
    per_token_entropies = []
    for logits_chunk in logits.split(chunk_size, dim=0):
        logps = F.log_softmax(logits_chunk, dim=-1)
        chunk_entropy = -(torch.exp(logps) * logps).sum(-1)
        per_token_entropies.extend(chunk_entropy)
    return torch.stack(per_token_entropies)


# ---- trl/trainer/grpo_trainer.py (the parts of GRPOTrainer on this path) --------------------
class Args:
    delta = None


class GRPOTrainer:
    def __init__(self, model, eos_token_id, pad_token_id):
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.temperature = 1.0
        self.beta = 0.0
        self.epsilon_low = 0.2
        self.epsilon_high = 0.2
        self.loss_type = "bnpo"
        self.token_entropy_percentile_threshold = 0.8
        self.args = Args()
        self._metrics = {"train": defaultdict(list)}

    def completion_mask_from_ids(self, completion_ids):
        # _generate_and_score_completions: mask everything after the first EOS
        device = completion_ids.device
        is_eos = completion_ids == self.eos_token_id
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
        sequence_indices = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1)
        return (sequence_indices <= eos_idx.unsqueeze(1)).int()

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False
    ):
        batch_size = batch_size or input_ids.size(0)
        all_logps = []
        all_entropies = []
        for start in range(0, input_ids.size(0), batch_size):
            input_ids_batch = input_ids[start : start + batch_size]
            attention_mask_batch = attention_mask[start : start + batch_size]
            logits = model(
                input_ids=input_ids_batch,
                attention_mask=attention_mask_batch,
                logits_to_keep=logits_to_keep + 1,
            ).logits
            logits = logits[:, :-1, :]
            logits = logits / self.temperature
            completion_ids = input_ids_batch[:, -logits_to_keep:]
            logps = selective_log_softmax(logits, completion_ids)
            all_logps.append(logps)
            if compute_entropy:
                all_entropies.append(entropy_from_logits(logits))
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        return {"logps": logps, "entropies": entropies}

    def _compute_entropy_mask(self, entropies, completion_mask):
        non_pad_entropies = entropies[completion_mask.bool()]
        entropy_threshold = torch.quantile(non_pad_entropies.float(), self.token_entropy_percentile_threshold)
        entropies = entropies * completion_mask.float()
        entropy_mask = entropies >= entropy_threshold
        return entropy_mask

    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)

        if self.token_entropy_percentile_threshold > 0.0:
            logps_and_entropies = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, compute_entropy=True
            )
            per_token_logps = logps_and_entropies["logps"]
            entropies = logps_and_entropies["entropies"]
            if FIXED:
                entropy_mask = self._compute_entropy_mask(entropies, completion_mask)
            else:
                # compute the entropy threshold across all tokens in the batch
                entropy_threshold = torch.quantile(
                    entropies.flatten().float(), self.token_entropy_percentile_threshold
                )
                entropy_mask = entropies >= entropy_threshold
        else:
            per_token_logps = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep
            )["logps"]
            entropy_mask = None

        advantages = inputs["advantages"]
        old_per_token_logps = (
            per_token_logps.detach() if inputs["old_per_token_logps"] is None else inputs["old_per_token_logps"]
        )
        coef_1 = torch.exp(per_token_logps - old_per_token_logps)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        if self.args.delta is not None:
            coef_1 = torch.clamp(coef_1, max=self.args.delta)

        per_token_loss1 = coef_1 * advantages.unsqueeze(1)
        per_token_loss2 = coef_2 * advantages.unsqueeze(1)
        per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask

        if self.loss_type == "grpo":
            loss = ((per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)).mean()
        elif self.loss_type == "bnpo":
            loss = (per_token_loss * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)
        else:
            raise ValueError(f"Unknown loss type: {self.loss_type}")

        self._metrics["train"]["trained_tokens"].append(
            int((entropy_mask & completion_mask.bool()).sum()) if entropy_mask is not None else 0
        )
        return loss


# ---- a tiny policy and one GRPO step ----------------------------------------------------------
VOCAB, PAD, EOS = 64, 0, 1
config = LlamaConfig(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2,
)
config._attn_implementation = "eager"
model = LlamaForCausalLM(config).float()
old_model = LlamaForCausalLM(config).float()
old_model.load_state_dict(model.state_dict())
with torch.no_grad():  # the policy that sampled the rollouts is one optimizer step behind
    for p in old_model.parameters():
        p.add_(0.02 * torch.randn_like(p))

trainer = GRPOTrainer(model, eos_token_id=EOS, pad_token_id=PAD)

# 4 completions of 2 prompts (num_generations = 2); prompts left-padded, completions padded after EOS
prompt_lens = [5, 5, 3, 3]
completion_lens = [3, 12, 2, 5]  # EOS included
P, C = max(prompt_lens), 12
prompt_ids = torch.full((4, P), PAD, dtype=torch.long)
prompt_mask = torch.zeros((4, P), dtype=torch.long)
completion_ids = torch.full((4, C), PAD, dtype=torch.long)
for i, (pl, cl) in enumerate(zip(prompt_lens, completion_lens)):
    prompt_ids[i, P - pl :] = torch.randint(3, VOCAB, (pl,))
    prompt_mask[i, P - pl :] = 1
    completion_ids[i, : cl - 1] = torch.randint(3, VOCAB, (cl - 1,))
    if cl < C or i != 1:
        completion_ids[i, cl - 1] = EOS
completion_mask = trainer.completion_mask_from_ids(completion_ids)

rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
mean_grouped = rewards.view(-1, 2).mean(dim=1).repeat_interleave(2)
std_grouped = rewards.view(-1, 2).std(dim=1).repeat_interleave(2)
advantages = (rewards - mean_grouped) / (std_grouped + 1e-4)

with torch.no_grad():
    old_per_token_logps = trainer._get_per_token_logps_and_entropies(
        old_model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
        C,
    )["logps"]

inputs = {
    "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
    "completion_ids": completion_ids, "completion_mask": completion_mask,
    "advantages": advantages, "old_per_token_logps": old_per_token_logps,
}

optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
model.train()
loss = trainer._compute_loss(model, inputs)
loss.backward()
grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
optimizer.step()
optimizer.zero_grad()

with torch.no_grad():
    new_logps = trainer._get_per_token_logps_and_entropies(
        model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), C
    )["logps"]
seq_logps = (new_logps * completion_mask).sum(-1)

print("completion tokens:", int(completion_mask.sum()), "of", completion_mask.numel())
print("tokens kept by the entropy mask:", trainer._metrics["train"]["trained_tokens"][-1])
print(f"loss: {loss.item():.6f}  grad norm: {grad_norm.item():.6f}")
print("sequence log-probs after the step:", [round(v, 4) for v in seq_logps.tolist()])
