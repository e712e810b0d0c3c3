"""SkyRL PPO step over one left-padded block per trajectory: policy, reference and critic forwards with
cumsum position ids, response-level tensors right-aligned, KL-in-reward, GAE, and the masked policy / critic
losses, including a multi-turn trajectory whose tool output is in the sequence but out of the loss (correct
program).

Port, shrunk to toy sizes, of NovaSky-AI/SkyRL @a9564572eb8e91076be43c1bd5e4615e3de17265:
  skyrl/train/dataset/preprocess.py (last changed in 7fee019)  convert_prompts_responses_to_batch_tensors: each
      prompt + response row left-padded to max(prompt_i + response_i) with pad_token_id, attention_mask 1 on the
      trailing prompt_i + response_i positions, response_mask / rewards / loss_masks right-aligned in
      (batch, max_response) with leading zeros
  skyrl/train/trainer.py  postprocess_generator_output (a response-level reward goes on the response's last
      token), convert_to_training_input, apply_reward_kl_penalty (rewards - kl * kl_loss_coef, kl masked by
      loss_mask), compute_advantages_and_returns
  skyrl/backends/skyrl_train/workers/model_wrapper.py  HFModelWrapper.forward, non-packed branch:
      position_ids = attention_mask.cumsum(-1) - 1, masked_fill(attention_mask == 0, 1); model(sequences,
      attention_mask, position_ids); logits / temperature; logprobs_from_logits(logits, roll(sequences, -1));
      chunked entropy with the attention mask; action_log_probs = log_probs[:, -num_actions - 1 : -1].
      _get_critic_model(...).CriticModel.forward: same position ids, base model, value_head,
      values[:, :-1][:, -num_actions:]
  skyrl/backends/skyrl_train/utils/torch_utils.py  chunked_entropy_from_logits, logprobs_from_logits(_v2),
      masked_mean, safe_exp_delta
  skyrl/backends/skyrl_train/utils/ppo_utils.py  compute_approx_kl, masked_var / masked_whiten,
      compute_gae_advantage_return, ppo_policy_loss (regular), reduce_loss, ppo_critic_loss
  skyrl/backends/skyrl_train/workers/worker.py  the policy step (entropy sliced like the log-probs, masked_mean
      over loss_mask, use_kl_loss term) and the critic step.

Every response ends with EOS and is the tail of its row, so `-num_actions - 1 : -1` lines every response token
up with the slot its response_mask marks; for a shorter response the leading slots of that window hold prompt
tokens (response_mask 0, loss_mask 0).  The pad id is its own token.  GAE runs backwards over the right-aligned
slots, so a real slot only sees later (real) slots.  The multi-turn row's observation tokens keep attention 1 (the
policy conditioned on them) and loss_mask 0.

Left out: flash-attn / sample packing (remove_microbatch_padding needs flash_attention_2), sequence parallelism,
VLM inputs, Ray / FSDP workers, off-policy correction (no rollout logprobs), bf16 autocast.  Between the rollout
forwards and the training forward the policy's lm_head gets a small update, standing for earlier mini-batches.

Self-check (reference): every trajectory alone (prompt + response, no padding, no mask, default positions): the
policy / reference log-probs, entropies and critic values of its response tokens, zeros elsewhere; the KL-shaped
rewards, GAE over its own tokens only, whitening over the real loss tokens, the PPO policy loss, entropy, KL loss
and critic loss by loops.
"""
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace
from typing import List, Optional, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model, Qwen2PreTrainedModel

torch.manual_seed(0)

PAD_ID = 0  # <|endoftext|>
EOS_ID = 1  # <|im_end|>
VOCAB = 48


# ---------------------------------------------------------------- torch_utils.py
def chunked_entropy_from_logits(logits, requires_grad: bool = False, attention_mask=None, chunk_size: int = 1024):
    if attention_mask is not None:
        if attention_mask.shape != (logits.shape[0], logits.shape[1]):
            raise ValueError("attention_mask shape does not match logits shape")

    cm = nullcontext() if requires_grad else torch.no_grad()
    with cm:
        # Calculate entropy in chunks to avoid OOM
        num_chunks = (logits.size(1) + chunk_size - 1) // chunk_size
        entropy_tensor = torch.zeros((logits.shape[0], logits.shape[1]), dtype=logits.dtype, device=logits.device)

        for i in range(num_chunks):
            start_idx = i * chunk_size
            end_idx = min((i + 1) * chunk_size, logits.size(1))
            chunk = logits[:, start_idx:end_idx]
            chunk_logprob = F.log_softmax(chunk, dim=-1)

            chunk_probs = chunk_logprob.exp()
            chunk_entropy = -(chunk_probs * chunk_logprob).sum(-1)

            if attention_mask is not None:
                chunk_mask = attention_mask[:, start_idx:end_idx]
                chunk_entropy = chunk_entropy * chunk_mask

            entropy_tensor[:, start_idx:end_idx] = chunk_entropy
    return entropy_tensor


def logprobs_from_logits_v2(logits, labels):
    if logits.dtype in [torch.float32, torch.float64]:
        logits_labels = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
        # loop to reduce peak mem consumption
        logsumexp_values = torch.stack([torch.logsumexp(logit, dim=-1) for logit in logits])
        logprobs_labels = logits_labels - logsumexp_values  # log_softmax(x_i) = x_i - logsumexp(x)
    else:
        logprobs_labels = []
        for row_logits, row_labels in zip(logits, labels):
            row_logprobs = F.log_softmax(row_logits, dim=-1)
            row_logprobs_labels = row_logprobs.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1)
            logprobs_labels.append(row_logprobs_labels)
        logprobs_labels = torch.stack(logprobs_labels)
    return logprobs_labels


def logprobs_from_logits(logits, labels, inplace_backward=True):
    return logprobs_from_logits_v2(logits, labels)  # no flash-attn cross entropy on CPU


def masked_mean(tensor: torch.Tensor, mask: Optional[torch.Tensor], dim: Optional[int] = None) -> torch.Tensor:
    if mask is None:
        return tensor.mean(axis=dim)
    return (tensor * mask).sum(axis=dim) / mask.sum(axis=dim).clamp(min=1.0)


def safe_exp_delta(delta: torch.Tensor, clip: float = 20.0, out_dtype=None) -> torch.Tensor:
    y = torch.clamp(delta.to(torch.float32), -clip, clip).exp()
    return y.to(out_dtype or delta.dtype)


# ---------------------------------------------------------------- ppo_utils.py
def compute_approx_kl(log_probs, log_probs_base, loss_mask=None, kl_estimator_type: str = "k3"):
    if kl_estimator_type == "k1":
        kld = log_probs - log_probs_base
    elif kl_estimator_type == "k3":
        kl = log_probs_base - log_probs
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        kld = torch.clamp(kld, min=-10, max=10)
    else:
        raise ValueError(f"Invalid KL estimator type: {kl_estimator_type}")

    if loss_mask is not None:
        kld = torch.where(loss_mask.bool(), kld * loss_mask, 0.0)
    return kld


def masked_var(values, mask, unbiased=True):
    mean = masked_mean(values, mask)
    centered_values = values - mean
    variance = masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def masked_whiten(values, mask, shift_mean=True):
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma: float, lambd: float, **kwargs):
    with torch.no_grad():
        lastgaelam = 0
        advantages_reversed = []
        gen_len = token_level_rewards.shape[-1]

        for t in reversed(range(gen_len)):
            nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam = delta + gamma * lambd * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)

        returns = advantages + values
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def reduce_loss(loss, loss_mask):
    return (loss * loss_mask).sum() if loss_mask is not None else loss.sum()


def ppo_policy_loss(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
    assert config.policy_loss_type in ["regular", "dual_clip"]

    ratio = safe_exp_delta(log_probs - old_log_probs, clip=20.0, out_dtype=log_probs.dtype)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - config.eps_clip_low, 1 + config.eps_clip_high) * advantages
    loss = -torch.min(surr1, surr2)
    clip_ratio = masked_mean((-surr2 > -surr1).float(), loss_mask).mean().detach().item()
    loss = reduce_loss(loss, loss_mask)
    return loss, {"clip_ratio": clip_ratio}


def ppo_critic_loss(values, old_values, returns, config, loss_mask=None):
    if config.value_clip is not None:
        values_clipped = old_values + (values - old_values).clamp(-config.value_clip, config.value_clip)
        surr1 = (values_clipped - returns) ** 2
        surr2 = (values - returns) ** 2
        loss = torch.max(surr1, surr2)
        clipfrac = masked_mean((surr1 > surr2).float(), loss_mask).mean().detach().item()
    else:
        clipfrac = None
        loss = (values - returns) ** 2

    loss = masked_mean(loss, loss_mask, dim=-1).mean()
    return 0.5 * loss, clipfrac


# ---------------------------------------------------------------- dataset/preprocess.py
def convert_prompts_responses_to_batch_tensors(pad_token_id, prompts, responses, rewards, loss_masks, logprobs=None):
    prompt_token_lens = [len(p) for p in prompts]
    response_token_lens = [len(r) for r in responses]

    max_response = max(response_token_lens)
    # Pad to the tightest bound: max per-sample total.
    max_total = max(p + r for p, r in zip(prompt_token_lens, response_token_lens))
    num_samples = len(prompts)

    prompt_lens = np.asarray(prompt_token_lens, dtype=np.int64)
    response_lens = np.asarray(response_token_lens, dtype=np.int64)
    total_real = prompt_lens + response_lens  # (num_samples,)
    pad_lens = max_total - total_real  # left-pad width per sample

    # Left-pad each prompt+response row.
    sequences_np = np.full((num_samples, max_total), pad_token_id, dtype=np.int64)
    for i in range(num_samples):
        start = int(pad_lens[i])
        p_len = int(prompt_lens[i])
        sequences_np[i, start : start + p_len] = prompts[i]
        sequences_np[i, start + p_len :] = responses[i]

    # Real tokens occupy the trailing total_real positions.
    col_total = np.arange(max_total, dtype=np.int64)
    attention_mask_np = (col_total[None, :] >= pad_lens[:, None]).astype(np.int64)

    # Response tokens occupy the trailing response_len positions.
    col_resp = np.arange(max_response, dtype=np.int64)
    resp_pad = max_response - response_lens
    response_mask_np = (col_resp[None, :] >= resp_pad[:, None]).astype(np.int64)

    sequences = torch.from_numpy(sequences_np)
    attention_mask = torch.from_numpy(attention_mask_np)
    response_mask = torch.from_numpy(response_mask_np)

    ret_loss_masks_np = np.zeros((num_samples, max_response), dtype=np.float32)
    for i, lm in enumerate(loss_masks):
        ret_loss_masks_np[i, max_response - len(lm) :] = lm

    ret_rewards_np = np.zeros((num_samples, max_response), dtype=np.float32)
    for i, custom_reward in enumerate(rewards):
        reward_arr = np.asarray(custom_reward, dtype=np.float32)
        ret_rewards_np[i, max_response - reward_arr.shape[0] :] = reward_arr

    return (
        sequences,
        attention_mask,
        response_mask,
        torch.from_numpy(ret_rewards_np),
        torch.from_numpy(ret_loss_masks_np),
        None,
    )


# ---------------------------------------------------------------- workers/model_wrapper.py
class HFModelWrapper(nn.Module):
    def __init__(self, pretrain_or_model, temperature=1.0, logprobs_chunk_size: int = 1024):
        super().__init__()
        self.temperature = temperature
        self.sequence_parallel_size = 1
        self.remove_microbatch_padding = False
        self.model = pretrain_or_model
        self.logprobs_chunk_size = logprobs_chunk_size
        self.chunked_entropy_from_logits_fn = chunked_entropy_from_logits

    def forward(self, sequences, num_actions: Union[int, List[int]], attention_mask=None, temperature: float = 1.0,
                return_output=False, compute_entropy=False, entropy_requires_grad=True):
        """Returns action log probs"""
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)

        sequences_fwd = sequences
        position_ids_fwd = position_ids
        attention_mask_fwd = attention_mask

        sequences_rolled = torch.roll(sequences_fwd, shifts=-1, dims=1)
        output = self.model(sequences_fwd, attention_mask=attention_mask_fwd, position_ids=position_ids_fwd)

        logits_BSV = output["logits"]
        logits_BSV.div_(temperature)

        # NOTE: this is slightly inaccurate with sample packing because last token from nth seq -> first token of n+1th seq loss is added.
        log_probs = logprobs_from_logits(logits_BSV, sequences_rolled, inplace_backward=True)

        if compute_entropy:
            entropy_mask = None
            if not self.remove_microbatch_padding:
                entropy_mask = attention_mask_fwd
            entropy_BS = self.chunked_entropy_from_logits_fn(
                logits_BSV,
                requires_grad=entropy_requires_grad,
                attention_mask=entropy_mask,
                chunk_size=self.logprobs_chunk_size,
            )
            output["entropy"] = entropy_BS

        if isinstance(num_actions, list):
            if len(num_actions) == 1:
                num_actions = num_actions[0]
            else:
                num_actions = np.array(num_actions)
        action_log_probs = log_probs[:, -num_actions - 1 : -1]

        if return_output:
            return (action_log_probs, output)
        else:
            return action_log_probs


def _get_critic_model(base_pretrained_model, base_llm_model, value_head_prefix="value_head"):
    class CriticModel(base_pretrained_model):
        supports_gradient_checkpointing = True

        def __init__(self, config):
            super().__init__(config)
            setattr(self, self.base_model_prefix, base_llm_model(config))

            self.value_head_prefix = value_head_prefix
            setattr(self, value_head_prefix, nn.Linear(config.hidden_size, 1, bias=False))
            self.sequence_parallel_size = 1
            self.remove_microbatch_padding = False
            self.post_init()

        def forward(self, input_ids=None, num_actions=None, attention_mask=None, return_output=False):
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            input_ids_fwd = input_ids
            position_ids_fwd = position_ids
            attention_mask_fwd = attention_mask

            outputs = getattr(self, self.base_model_prefix)(
                input_ids_fwd, attention_mask=attention_mask_fwd, position_ids=position_ids_fwd
            )
            last_hidden_states_BSH = outputs["last_hidden_state"]
            values_BSH = getattr(self, self.value_head_prefix)(last_hidden_states_BSH)
            values = values_BSH.squeeze(-1)[:, :-1]

            if num_actions is None:
                assert return_output
                return outputs

            action_values = values[:, -num_actions:]

            if return_output:
                return (action_values, outputs)
            else:
                return action_values

    return CriticModel


# ---------------------------------------------------------------- trainer.py (single process)
def postprocess_generator_output(generator_output):
    responses = generator_output["response_ids"]
    rewards = generator_output["rewards"]
    per_token_rewards = []
    for reward, response in zip(rewards, responses):
        per_token_reward = [0.0] * len(response)
        per_token_reward[-1] = float(reward)
        per_token_rewards.append(per_token_reward)
    generator_output["rewards"] = per_token_rewards
    return generator_output


def make_generator_output(rng):
    """Three prompts, two samples each; sample 5 is a two-turn trajectory with a tool observation."""
    def toks(n):
        return [int(x) for x in rng.integers(2, VOCAB, size=n)]

    prompts = [toks(5), toks(11), toks(8)]
    prompt_token_ids, response_ids, loss_masks, rewards, uids = [], [], [], [], []
    spec = [(0, 7), (0, 3), (1, 4), (1, 9), (2, 2), (2, None)]
    for k, (p, n) in enumerate(spec):
        prompt_token_ids.append(prompts[p])
        if n is None:  # assistant turn, tool observation (not trained on), assistant turn
            turn1, obs, turn2 = toks(3) + [EOS_ID], toks(4), toks(2) + [EOS_ID]
            response_ids.append(turn1 + obs + turn2)
            loss_masks.append([1] * len(turn1) + [0] * len(obs) + [1] * len(turn2))
        else:
            response_ids.append(toks(n) + [EOS_ID])
            loss_masks.append([1] * (n + 1))
        rewards.append(float(rng.integers(0, 2)) if k != 5 else 1.0)
        uids.append(f"p{p}")
    return dict(prompt_token_ids=prompt_token_ids, response_ids=response_ids, loss_masks=loss_masks,
                rewards=rewards), uids


def main():
    cfg_alg = SimpleNamespace(temperature=0.8, kl_estimator_type="k3", kl_loss_coef=0.05, use_kl_in_reward=True,
                              use_kl_loss=True, gamma=1.0, lambd=0.95, policy_loss_type="regular",
                              eps_clip_low=0.2, eps_clip_high=0.28, value_clip=0.2, entropy_loss_coef=0.01)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=None, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(1)
    policy = HFModelWrapper(Qwen2ForCausalLM(config).eval(), temperature=cfg_alg.temperature)
    torch.manual_seed(2)
    ref = HFModelWrapper(Qwen2ForCausalLM(config).eval(), temperature=cfg_alg.temperature)
    torch.manual_seed(3)
    critic = _get_critic_model(Qwen2PreTrainedModel, Qwen2Model)(config).eval()
    with torch.no_grad():
        critic.value_head.weight.normal_(0, 0.5)

    generator_output, uids = make_generator_output(np.random.default_rng(0))
    generator_output = postprocess_generator_output(generator_output)
    (sequences, attention_mask, response_mask, rewards, loss_mask, _) = convert_prompts_responses_to_batch_tensors(
        PAD_ID, generator_output["prompt_token_ids"], generator_output["response_ids"],
        generator_output["rewards"], generator_output["loss_masks"],
    )
    num_actions = response_mask.shape[1]

    # fwd_logprobs_values_reward
    with torch.no_grad():
        values = critic(sequences, num_actions=num_actions, attention_mask=attention_mask)
        base_action_log_probs = ref(sequences, num_actions, attention_mask=attention_mask, temperature=cfg_alg.temperature)
        action_log_probs = policy(sequences, num_actions, attention_mask=attention_mask, temperature=cfg_alg.temperature)

    # apply_reward_kl_penalty
    kl = compute_approx_kl(action_log_probs, base_action_log_probs, loss_mask=loss_mask,
                           kl_estimator_type=cfg_alg.kl_estimator_type)
    shaped_rewards = rewards - kl * max(0, cfg_alg.kl_loss_coef)

    # compute_advantages_and_returns (GAE with the critic)
    advantages, returns = compute_gae_advantage_return(shaped_rewards, values, response_mask,
                                                       gamma=cfg_alg.gamma, lambd=cfg_alg.lambd)

    # the policy has moved a little since the rollout forwards (earlier mini-batches)
    with torch.no_grad():
        policy.model.lm_head.weight.add_(0.05 * torch.randn_like(policy.model.lm_head.weight))

    # worker: policy step
    new_log_probs, output = policy(sequences, num_actions, attention_mask=attention_mask, temperature=cfg_alg.temperature,
                                   return_output=True, compute_entropy=True, entropy_requires_grad=False)
    policy_loss, _ = ppo_policy_loss(new_log_probs, action_log_probs, advantages, cfg_alg, loss_mask=loss_mask)
    entropy_BS = output["entropy"][:, -num_actions - 1 : -1]
    entropy = masked_mean(entropy_BS, loss_mask)
    kl_loss = masked_mean(compute_approx_kl(new_log_probs, base_action_log_probs, loss_mask=loss_mask,
                                            kl_estimator_type=cfg_alg.kl_estimator_type), loss_mask)
    # worker: critic step
    new_values = critic(sequences, num_actions=num_actions, attention_mask=attention_mask)
    critic_loss, _ = ppo_critic_loss(new_values, values, returns, cfg_alg, loss_mask=loss_mask)

    print("sequences", tuple(sequences.shape), "response slots", num_actions,
          "attention", attention_mask.sum(-1).tolist(), "response", response_mask.sum(-1).tolist())

    # ------------------------------------------------------------ reference: each trajectory alone, no pad, no mask
    T = cfg_alg.temperature
    tol = dict(atol=1e-4, rtol=1e-4)
    B = sequences.shape[0]
    ref_rows = []
    for i in range(B):
        p = generator_output["prompt_token_ids"][i]
        r = generator_output["response_ids"][i]
        lm = torch.tensor(generator_output["loss_masks"][i], dtype=torch.float32)
        ids = torch.tensor([p + r])
        with torch.no_grad():
            pl = policy.model(ids).logits[0] / T  # the policy after its update
            bl = ref.model(ids).logits[0] / T
            h = critic.model(ids).last_hidden_state[0]
            v = critic.value_head(h).squeeze(-1)
        n, P = len(r), len(p)
        off = num_actions - n  # right-aligned
        lp_new = torch.stack([torch.log_softmax(pl[P + j - 1], -1)[r[j]] for j in range(n)])
        lp_ref = torch.stack([torch.log_softmax(bl[P + j - 1], -1)[r[j]] for j in range(n)])
        ent = torch.stack([-(torch.softmax(pl[P + j - 1], -1) * torch.log_softmax(pl[P + j - 1], -1)).sum() for j in range(n)])
        val = torch.stack([v[P + j - 1] for j in range(n)])
        assert torch.allclose(new_log_probs[i, off:], lp_new, **tol), i
        assert torch.allclose(base_action_log_probs[i, off:], lp_ref, **tol), i
        assert torch.allclose(entropy_BS[i, off:], ent, **tol), i
        assert torch.allclose(values[i, off:], val, **tol), i
        assert torch.all(response_mask[i, :off] == 0) and torch.all(response_mask[i, off:] == 1)
        assert torch.all(loss_mask[i, :off] == 0) and torch.equal(loss_mask[i, off:], lm)
        assert torch.all(rewards[i, :off] == 0) and rewards[i, -1] == generator_output["rewards"][i][-1]
        # the rollout log-probs (before the update) of this row alone, from the saved batch values
        old = action_log_probs[i, off:]
        k = lp_ref - old
        k3 = torch.clamp(torch.clamp(k, -20, 20).exp() - torch.clamp(k, -20, 20) - 1, -10, 10) * lm
        rw = torch.tensor(generator_output["rewards"][i]) - cfg_alg.kl_loss_coef * k3
        assert torch.allclose(shaped_rewards[i, off:], rw, **tol), i
        adv, last = [0.0] * n, 0.0
        for t in reversed(range(n)):
            nv = float(val[t + 1]) if t < n - 1 else 0.0
            last = float(rw[t]) + cfg_alg.gamma * nv - float(val[t]) + cfg_alg.gamma * cfg_alg.lambd * last
            adv[t] = last
        adv = torch.tensor(adv)
        ref_rows.append(dict(off=off, n=n, lm=lm, lp_new=lp_new, old=old, lp_ref=lp_ref, ent=ent, val=val, adv=adv,
                             ret=adv + val))
        assert torch.allclose(returns[i, off:], adv + val, **tol), i

    all_adv = torch.cat([row["adv"] for row in ref_rows])
    mean = all_adv.mean()
    var = ((all_adv - mean) ** 2).mean() * len(all_adv) / (len(all_adv) - 1)
    pl_sum, ent_sum, kl_sum, n_tok, crit_rows = 0.0, 0.0, 0.0, 0.0, []
    for i, row in enumerate(ref_rows):
        wadv = (row["adv"] - mean) / torch.sqrt(var + 1e-8)
        assert torch.allclose(advantages[i, row["off"]:], wadv, atol=1e-4), i
        ratio = torch.exp(row["lp_new"] - row["old"])
        surr = torch.minimum(ratio * wadv, ratio.clamp(1 - 0.2, 1 + 0.28) * wadv)
        pl_sum += float((-surr * row["lm"]).sum())
        ent_sum += float((row["ent"] * row["lm"]).sum())
        k = row["lp_ref"] - row["lp_new"]
        kl_sum += float(((k.exp() - k - 1) * row["lm"]).sum())
        n_tok += float(row["lm"].sum())
        vclip = row["val"] + (row["val"] - row["val"]).clamp(-0.2, 0.2)
        closs = torch.maximum((vclip - row["ret"]) ** 2, (row["val"] - row["ret"]) ** 2)
        crit_rows.append(float((closs * row["lm"]).sum() / row["lm"].sum()))
    assert abs(policy_loss.item() - pl_sum) < 1e-4, (policy_loss.item(), pl_sum)
    assert abs(float(entropy) - ent_sum / n_tok) < 1e-4
    assert abs(float(kl_loss) - kl_sum / n_tok) < 1e-5
    assert abs(critic_loss.item() - 0.5 * sum(crit_rows) / B) < 1e-4
    print("policy loss %.5f  entropy %.5f  kl loss %.6f  critic loss %.5f" % (
        policy_loss.item(), float(entropy), float(kl_loss), critic_loss.item()))
    print("OK")


if __name__ == "__main__":
    main()
