"""verl PPO critic: the values and the value loss are masked with the attention mask one column too far left.

Citation: volcengine/verl#1850, commit aa11dd19b ("[ppo critic] fix EOS token value to zero"), the fix for the
misalignment reported in volcengine/verl#1758. Bug state read at aa11dd19b^: verl/workers/critic/dp_critic.py
(DataParallelPPOCritic._forward_micro_batch, compute_values, update_critic), verl/workers/rollout/hf_rollout.py
(HFRollout._generate_minibatch, the part after generate), verl/utils/torch_functional.py (get_response_mask,
masked_mean, masked_var, masked_whiten, clip_by_value), verl/utils/model.py (compute_position_id_with_mask),
verl/trainer/ppo/core_algos.py (compute_gae_advantage_return, compute_value_loss, agg_loss),
verl/trainer/ppo/ray_trainer.py (compute_response_mask) and verl/workers/reward_manager/naive.py.

Bug: a rollout row is [left-padded prompt | right-padded response], the response's attention mask ending at its EOS.
The critic reads the value of response step j at column P - 1 + j (the state before token j), and compute_values
then masked those values with `attention_mask[:, -response_length - 1 : -1]`, the mask of the *state* columns: for a
response that stops before response_length, the value read at its EOS column (step L, one past the last action) is
kept. update_critic built its response_mask the same way, so the value loss also fits that step. With GAE lambda < 1
the value after EOS leaks into the advantages of the steps before it.

Fix: mask with the response columns themselves, `attention_mask[:, -response_length:]`, in both places.

This program: a tiny Qwen2ForTokenClassification critic (num_labels=1, as verl builds it from
AutoModelForTokenClassification), a rollout batch laid out as HFRollout lays it out (the generated sequences are
given, not sampled), a rule score on each response's last token, compute_values, GAE, and one update_critic step
without remove-padding. TensorDict / DataProto / the OmegaConf config are replaced by dicts; FSDP, Ulysses and
dynamic batch size are dropped.
"""
import sys
from typing import List, Union

import torch
from torch import nn, optim
from transformers import Qwen2Config, Qwen2ForTokenClassification

FIXED = "--fixed" in sys.argv

PAD, EOS = 0, 2


class Cfg(dict):
    """Stands in for the OmegaConf DictConfig (attribute access and .get)."""

    __getattr__ = dict.__getitem__


# ---------------------------------------------------------------- verl/utils/torch_functional.py


def clip_by_value(x, tensor_min, tensor_max):
    clipped = torch.max(torch.min(x, tensor_max), tensor_min)
    return clipped


def masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / (mask.sum(axis=axis) + 1e-8)


def masked_var(values, mask, unbiased=True):
    mean = masked_mean(values, mask)
    centered_values = values - mean
    variance = masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("At least one element in the mask has to be 1.")
        if mask_sum == 1:
            raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def masked_whiten(values, mask, shift_mean=True):
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def get_response_mask(response_id: torch.Tensor, eos_token: Union[int, List[int]] = 2, dtype=torch.int64):
    eos_mask = torch.isin(response_id, torch.tensor(eos_token, device=response_id.device)).int()
    return (eos_mask.cumsum(dim=1) - eos_mask).eq(0).to(dtype)


# ---------------------------------------------------------------- verl/utils/model.py


def compute_position_id_with_mask(mask):
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0, max=None)


# ---------------------------------------------------------------- verl/trainer/ppo/core_algos.py


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    with torch.no_grad():
        lastgaelam = 0
        advantages_reversed = []
        gen_len = token_level_rewards.shape[-1]

        for t in reversed(range(gen_len)):
            nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam = delta + gamma * lam * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)

        returns = advantages + values
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def agg_loss(loss_mat, loss_mask, loss_agg_mode):
    if loss_agg_mode == "token-mean":
        loss = masked_mean(loss_mat, loss_mask)
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        loss = torch.mean(seq_losses)
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / torch.sum(loss_mask, dim=-1)
        loss = torch.mean(seq_losses)
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss


def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode="token-mean"):
    vpredclipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = agg_loss(loss_mat=clipped_vf_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


# ---------------------------------------------------------------- verl/trainer/ppo/ray_trainer.py


def compute_response_mask(batch):
    responses = batch["responses"]
    response_length = responses.size(1)
    attention_mask = batch["attention_mask"]
    return attention_mask[:, -response_length:]


# ---------------------------------------------------------------- verl/workers/critic/dp_critic.py


class DataParallelPPOCritic:
    def __init__(self, config, critic_module: nn.Module, critic_optimizer: optim.Optimizer):
        self.config = config
        self.critic_module = critic_module
        self.critic_optimizer = critic_optimizer
        self.use_remove_padding = self.config.model.get("use_remove_padding", False)
        self.ulysses_sequence_parallel_size = self.config.get("ulysses_sequence_parallel_size", 1)
        self.device_name = "cpu"

    def _forward_micro_batch(self, micro_batch):
        response_length = micro_batch["responses"].size(-1)
        with torch.autocast(device_type=self.device_name, dtype=torch.bfloat16):
            input_ids = micro_batch["input_ids"]
            attention_mask = micro_batch["attention_mask"]
            position_ids = micro_batch["position_ids"]

            output = self.critic_module(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            )  # prevent model thinks we are generating
            values = output.logits
            values = values[:, -response_length - 1 : -1].squeeze(-1)
            return values

    def _optimizer_step(self):
        grad_norm = torch.nn.utils.clip_grad_norm_(self.critic_module.parameters(), max_norm=self.config.grad_clip)
        if not torch.isfinite(grad_norm):
            print(f"WARN: grad_norm is not finite: {grad_norm}")
            self.critic_optimizer.zero_grad()
        else:
            self.critic_optimizer.step()
        return grad_norm

    def compute_values(self, data, micro_batch_size):
        self.critic_module.eval()
        select_keys = ["responses", "input_ids", "attention_mask", "position_ids"]
        batch = {k: data[k] for k in select_keys}
        micro_batches = split_batch(batch, micro_batch_size)

        values_lst = []
        for micro_batch in micro_batches:
            with torch.no_grad():
                values = self._forward_micro_batch(micro_batch)
            values_lst.append(values)
        values = torch.concat(values_lst, dim=0)

        responses = data["responses"]
        attention_mask = data["attention_mask"]
        response_length = responses.size(1)
        if FIXED:
            response_mask = attention_mask[:, -response_length:]
            values = values * response_mask  # Only action tokens have values
        else:
            values = values * attention_mask[:, -response_length - 1 : -1]
        return values

    def update_critic(self, data):
        self.critic_module.train()
        metrics = {}

        select_keys = ["input_ids", "responses", "attention_mask", "position_ids", "values", "returns"]
        batch = {k: data[k] for k in select_keys}
        dataloader = split_batch(batch, self.config.ppo_mini_batch_size)

        for epoch in range(self.config.ppo_epochs):
            for batch_idx, mini_batch in enumerate(dataloader):
                micro_batches = split_batch(mini_batch, self.config.ppo_micro_batch_size_per_gpu)
                self.gradient_accumulation = self.config.ppo_mini_batch_size // self.config.ppo_micro_batch_size_per_gpu

                self.critic_optimizer.zero_grad()

                for data in micro_batches:
                    responses = data["responses"]
                    attention_mask = data["attention_mask"]
                    values = data["values"]
                    returns = data["returns"]
                    response_length = responses.size(1)

                    if FIXED:
                        response_mask = attention_mask[:, -response_length:]
                    else:
                        response_mask = attention_mask[:, -response_length - 1 : -1]

                    vpreds = self._forward_micro_batch(data)

                    vf_loss, vf_clipfrac = compute_value_loss(
                        vpreds=vpreds,
                        values=values,
                        returns=returns,
                        response_mask=response_mask,
                        cliprange_value=self.config.cliprange_value,
                        loss_agg_mode=self.config.loss_agg_mode,
                    )
                    loss = vf_loss / self.gradient_accumulation
                    loss.backward()

                    metrics.setdefault("critic/vf_loss", []).append(vf_loss.detach().item())
                    metrics.setdefault("critic/vf_clipfrac", []).append(vf_clipfrac.detach().item())
                    metrics.setdefault("critic/vpred_mean", []).append(masked_mean(vpreds, response_mask).detach().item())

                grad_norm = self._optimizer_step()
                metrics.setdefault("critic/grad_norm", []).append(grad_norm.detach().item())
        self.critic_optimizer.zero_grad()
        return metrics


def split_batch(batch, size):
    """TensorDict.split stand-in."""
    n = next(iter(batch.values())).size(0)
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, n, size)]


# ---------------------------------------------------------------- data: RLHFDataset (left padding) + HFRollout layout


def make_prompts(prompt_token_lists, max_prompt_length):
    """RLHFDataset: left-padded prompts, position ids from the mask."""
    rows, masks = [], []
    for toks in prompt_token_lists:
        pad = max_prompt_length - len(toks)
        rows.append([PAD] * pad + toks)
        masks.append([0] * pad + [1] * len(toks))
    input_ids = torch.tensor(rows)
    attention_mask = torch.tensor(masks)
    position_ids = compute_position_id_with_mask(attention_mask)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def hf_rollout_postprocess(prompts, seq, config_response_length, eos_token_id, pad_token_id):
    """HFRollout._generate_minibatch after `self.module.generate(...)`: `seq` is output.sequences."""
    idx = prompts["input_ids"]
    prompt_length = idx.size(1)
    attention_mask = prompts["attention_mask"]
    position_ids = prompts["position_ids"]
    generated_batch_size = seq.size(0)

    sequence_length = prompt_length + config_response_length
    delta_length = sequence_length - seq.shape[1]
    if delta_length > 0:
        delta_tokens = torch.ones(size=(generated_batch_size, delta_length), device=seq.device, dtype=seq.dtype)
        delta_tokens = pad_token_id * delta_tokens
        seq = torch.cat((seq, delta_tokens), dim=1)
    assert seq.shape[1] == sequence_length

    prompt = seq[:, :prompt_length]
    response = seq[:, prompt_length:]

    response_length = response.size(1)
    delta_position_id = torch.arange(1, response_length + 1, device=position_ids.device)
    delta_position_id = delta_position_id.unsqueeze(0).repeat(generated_batch_size, 1)

    response_position_ids = position_ids[:, -1:] + delta_position_id
    position_ids = torch.cat([position_ids, response_position_ids], dim=-1)

    response_attention_mask = get_response_mask(response_id=response, eos_token=eos_token_id, dtype=attention_mask.dtype)
    attention_mask = torch.cat((attention_mask, response_attention_mask), dim=-1)

    return {
        "prompts": prompt,
        "responses": response,
        "input_ids": seq,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }


def naive_reward(batch, compute_score):
    """NaiveRewardManager.__call__: the score goes on the last valid response token."""
    reward_tensor = torch.zeros_like(batch["responses"], dtype=torch.float32)
    prompt_length = batch["prompts"].shape[-1]
    for i in range(batch["responses"].size(0)):
        valid_response_length = batch["attention_mask"][i, prompt_length:].sum()
        valid_response_ids = batch["responses"][i, :valid_response_length]
        reward_tensor[i, valid_response_length - 1] = compute_score(valid_response_ids)
    return reward_tensor


def main():
    torch.manual_seed(0)

    critic_model_config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    critic_model_config.num_labels = 1
    critic_model_config.classifier_dropout = 0.0
    critic_model_config._attn_implementation = "sdpa"
    critic_module = Qwen2ForTokenClassification(critic_model_config)

    config = Cfg(
        model=Cfg(use_remove_padding=False),
        ulysses_sequence_parallel_size=1,
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        ppo_epochs=1,
        grad_clip=1.0,
        cliprange_value=0.5,
        loss_agg_mode="token-mean",
    )
    critic_optimizer = optim.AdamW(critic_module.parameters(), lr=1e-3)
    critic = DataParallelPPOCritic(config, critic_module, critic_optimizer)

    max_prompt_length, response_length = 6, 8
    prompts = make_prompts([[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19]], max_prompt_length)
    # what generate returned: each row stops at its EOS (then pad); row 1 runs to max_new_tokens without one
    generated = [
        [21, 22, 23, EOS, PAD, PAD, PAD, PAD],
        [24, 25, 26, 27, 28, 29, 35, 36],
        [30, EOS, PAD, PAD, PAD, PAD, PAD, PAD],
        [31, 32, 33, 34, EOS, PAD, PAD, PAD],
    ]
    seq = torch.cat([prompts["input_ids"], torch.tensor(generated)], dim=1)
    batch = hf_rollout_postprocess(prompts, seq, response_length, EOS, PAD)

    def compute_score(response_ids):
        return 1.0 if (response_ids == EOS).any() else -1.0

    batch["token_level_scores"] = naive_reward(batch, compute_score)
    batch["token_level_rewards"] = batch["token_level_scores"]  # use_kl_in_reward=False

    batch["values"] = critic.compute_values(batch, micro_batch_size=2)

    batch["response_mask"] = compute_response_mask(batch)
    advantages, returns = compute_gae_advantage_return(
        token_level_rewards=batch["token_level_rewards"],
        values=batch["values"],
        response_mask=batch["response_mask"],
        gamma=1.0,
        lam=0.95,
    )
    batch["advantages"], batch["returns"] = advantages, returns

    metrics = critic.update_critic(batch)

    torch.set_printoptions(precision=4, sci_mode=False, linewidth=140)
    print("response_mask:\n", batch["response_mask"])
    print("values:\n", batch["values"])
    print("advantages (row 0):", advantages[0])
    print("returns (row 2):", returns[2])
    for k, v in metrics.items():
        print(k, [round(x, 5) for x in v])


if __name__ == "__main__":
    main()
