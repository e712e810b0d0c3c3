"""mlx-lm-lora ORPO: get_logps sums next-token log-probs under the mask of the *input* positions.

Citation: Goekdeniz-Guelmez/mlx-lm-lora#80 ("get_logps applies the token mask with an off-by-one
shift for next-token targets"), fixed by Goekdeniz-Guelmez/mlx-lm-lora#88 ("fix: update get_logps
to exclude right padding in target mask"). Ported to torch from mlx_lm_lora/trainer/orpo_trainer.py
(get_logps, orpo_loss, iterate_orpo_batches) as of 3.1.2; the MLX model is a tiny LlamaForCausalLM.

iterate_orpo_batches right-pads chosen / rejected rows with 0 (to a multiple of 8) and marks each
row's real tokens 1.0 in its mask. get_logps scores targets = tokens[:, 1:] but took mask[:, :-1],
so every shorter row's average log-prob counts the prediction of its first pad token and the
row's first token slot. The fix takes the mask of the targets, mask[:, 1:].
"""
import sys

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv


class MLXStyleLM(torch.nn.Module):
    """Called as mlx-lm models are: model(inputs, cache=None) -> logits."""

    def __init__(self, config):
        super().__init__()
        self.inner = LlamaForCausalLM(config)

    def forward(self, inputs, cache=None):
        return self.inner(input_ids=inputs, use_cache=False).logits


def get_logps(model, tokens, mask, cache=None):
    inputs = tokens[:, :-1]
    targets = tokens[:, 1:]
    logits = model(inputs, cache=cache)
    # Clip log_probs to avoid -inf and NaN stability issues
    log_probs = -F.cross_entropy(
        logits.transpose(1, 2), targets.long(), reduction="none"
    )
    log_probs = torch.clip(log_probs, -1000.0, 0.0)

    if FIXED:
        mask = mask[:, 1:]
    else:
        mask = mask[:, :-1]
    seq_lengths = mask.sum(-1)
    logp_sum = (log_probs * mask).sum(-1)
    safe_seq_lengths = torch.where(seq_lengths > 0, seq_lengths, torch.tensor(1.0))
    logp_seq_avg = torch.where(seq_lengths > 0, logp_sum / safe_seq_lengths, torch.tensor(0.0))
    mask_sum = mask.sum()
    safe_mask_sum = torch.where(mask_sum > 0, mask_sum, torch.tensor(1.0))
    logits_mean = torch.where(mask_sum > 0, logits.sum() / safe_mask_sum, torch.tensor(0.0))
    return logp_seq_avg, logits_mean


def _log1mexp(log_probability):
    """Compute log(1 - exp(x)) stably for log probabilities."""
    log_probability = torch.minimum(log_probability, torch.tensor(-1e-7))
    return torch.where(
        log_probability > -0.6931471805599453,
        torch.log(-torch.expm1(log_probability)),
        torch.log1p(-torch.exp(log_probability)),
    )


def orpo_loss(chosen_logps, chosen_logits_mean, rejected_logps, rejected_logits_mean,
              chosen_masks, rejected_masks, preference_scores, beta: float = 0.1):
    chosen_logps = torch.nan_to_num(chosen_logps, nan=0.0, posinf=0.0, neginf=-1000.0)
    rejected_logps = torch.nan_to_num(rejected_logps, nan=0.0, posinf=0.0, neginf=-1000.0)

    chosen_nll = -chosen_logps
    chosen_logps = chosen_logps * preference_scores
    log_odds = (chosen_logps - rejected_logps) - (
        _log1mexp(chosen_logps) - _log1mexp(rejected_logps)
    )
    ratio = F.logsigmoid(log_odds)
    loss = chosen_nll - beta * ratio

    chosen_reward = beta * chosen_logps
    rejected_reward = beta * rejected_logps
    reward = torch.stack([chosen_reward.mean(), rejected_reward.mean()])
    num_tokens = chosen_masks.sum() + rejected_masks.sum()
    metrics = {
        "accuracies": (chosen_reward > rejected_reward).float().mean(),
        "margins": (chosen_reward - rejected_reward).mean(),
        "policy_chosen_logps": chosen_logps.mean(),
        "policy_rejected_logps": rejected_logps.mean(),
        "chosen_logits_mean": chosen_logits_mean,
        "rejected_logits_mean": rejected_logits_mean,
    }
    return loss.mean(), reward, num_tokens, metrics


def iterate_orpo_batches(dataset, batch_size, max_seq_length, train=False):
    """Batch iterator for ORPO with preference scores"""
    idx = sorted(range(len(dataset)), key=lambda idx: len(dataset[idx]["chosen"]))
    step = 1  # mx.distributed.init().size() on one device
    batch_idx = [
        idx[i : i + batch_size : step]
        for i in range(0, len(idx) - batch_size + 1, batch_size)
    ]
    for i in range(len(batch_idx)):
        batch = [dataset[j] for j in batch_idx[i]]
        chosen_lengths = [len(x["chosen"]) for x in batch]
        rejected_lengths = [len(x["rejected"]) for x in batch]
        max_length = min(max(max(chosen_lengths), max(rejected_lengths)), max_seq_length)
        pad_to = 8
        max_length_in_batch = pad_to * ((max_length + pad_to - 1) // pad_to)

        batch_size_per_device = batch_size // step
        chosen_arr = np.zeros((batch_size_per_device, max_length_in_batch), np.int32)
        rejected_arr = np.zeros((batch_size_per_device, max_length_in_batch), np.int32)
        chosen_masks = np.zeros((batch_size_per_device, max_length_in_batch), np.float32)
        rejected_masks = np.zeros((batch_size_per_device, max_length_in_batch), np.float32)
        preference_scores = np.array([x.get("preference_score", 1.0) for x in batch], np.float32)

        for j in range(batch_size_per_device):
            chosen_length = min(chosen_lengths[j], max_length_in_batch)
            rejected_length = min(rejected_lengths[j], max_length_in_batch)
            chosen_arr[j, :chosen_length] = batch[j]["chosen"][:chosen_length]
            chosen_masks[j, :chosen_length] = 1.0
            rejected_arr[j, :rejected_length] = batch[j]["rejected"][:rejected_length]
            rejected_masks[j, :rejected_length] = 1.0

        yield (
            torch.from_numpy(chosen_arr),
            torch.from_numpy(rejected_arr),
            torch.from_numpy(chosen_masks),
            torch.from_numpy(rejected_masks),
            torch.from_numpy(preference_scores),
        )


def main():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = MLXStyleLM(config).eval()

    g = torch.Generator().manual_seed(1)

    def toks(n):
        return [1] + torch.randint(3, 64, (n - 2,), generator=g).tolist() + [2]

    dataset = [
        {"chosen": toks(6), "rejected": toks(9)},
        {"chosen": toks(11), "rejected": toks(5)},
        {"chosen": toks(7), "rejected": toks(13), "preference_score": 0.8},
        {"chosen": toks(14), "rejected": toks(8)},
    ]

    total, ntok = 0.0, 0.0
    with torch.no_grad():
        for chosen, rejected, chosen_masks, rejected_masks, scores in iterate_orpo_batches(
            dataset, batch_size=2, max_seq_length=32
        ):
            chosen_logps, chosen_logits_mean = get_logps(model, chosen, chosen_masks)
            rejected_logps, rejected_logits_mean = get_logps(model, rejected, rejected_masks)
            lvalue, reward, toks_, metrics = orpo_loss(
                chosen_logps, chosen_logits_mean, rejected_logps, rejected_logits_mean,
                chosen_masks=chosen_masks, rejected_masks=rejected_masks,
                preference_scores=scores, beta=0.1,
            )
            print("chosen_logps", [round(v, 4) for v in chosen_logps.tolist()],
                  "rejected_logps", [round(v, 4) for v in rejected_logps.tolist()])
            total += float(lvalue) * float(toks_)
            ntok += float(toks_)
    print(f"val loss {total / ntok:.6f}")


if __name__ == "__main__":
    main()
