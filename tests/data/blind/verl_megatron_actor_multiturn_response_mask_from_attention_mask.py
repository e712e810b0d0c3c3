# Citation: volcengine/verl#2543, commit 96b730bbed80292a439f0c0057d3920ab8b28d52
#   ("[megatron] fix: wrong response_mask for megatron + sglang mutli-turn"), bug state read at 96b730bbe^.
# Upstream: verl/workers/actor/megatron_actor.py MegatronPPOActor.forward_backward_batch -> loss_func
#   (with verl/trainer/ppo/core_algos.py compute_policy_loss / agg_loss / kl_penalty,
#   verl/utils/model.py compute_position_id_with_mask, the SGLang multi-turn rollout's
#   attention_mask + response_mask (loss mask) layout).
# Bug: the Megatron actor rebuilt the response mask as attention_mask[:, -response_length:]. In
#   SGLang multi-turn rollouts the tool / observation tokens inside the response are attended
#   (attention_mask = 1) but carry response_mask = 0; taking the attention mask's response slice
#   puts those tool tokens into the policy / entropy / KL losses and their token-mean denominators.
# Fix: select "response_mask" from the batch and use data["response_mask"] in loss_func.
import sys

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------- verl/utils/model.py, torch_functional
def compute_position_id_with_mask(mask):
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0, max=None)


def logprobs_from_logits(logits, labels):
    logp = F.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, -1, labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits):
    pd = torch.softmax(logits.float(), dim=-1)
    return torch.logsumexp(logits.float(), dim=-1) - torch.sum(pd * logits.float(), dim=-1)


def masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / (mask.sum(axis=axis) + 1e-8)


# ---------------------------------------------------------------- verl/trainer/ppo/core_algos.py
def agg_loss(loss_mat, loss_mask, loss_agg_mode):
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    elif loss_agg_mode == "seq-mean-token-sum":
        return torch.mean(torch.sum(loss_mat * loss_mask, dim=-1))
    elif loss_agg_mode == "seq-mean-token-mean":
        return torch.mean(torch.sum(loss_mat * loss_mask, dim=-1) / torch.sum(loss_mask, dim=-1))
    raise ValueError(loss_agg_mode)


def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange=None, cliprange_low=None,
                        cliprange_high=None, clip_ratio_c=3.0, loss_agg_mode="token-mean"):
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    if cliprange_low is None:
        cliprange_low = cliprange
    if cliprange_high is None:
        cliprange_high = cliprange
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def kl_penalty(logprob, ref_logprob, kl_penalty):
    if kl_penalty == "low_var_kl":
        kl = ref_logprob - logprob
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    return logprob - ref_logprob


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
    scores = token_level_rewards.sum(dim=-1)
    groups = {}
    for i, idx in enumerate(index):
        groups.setdefault(idx, []).append(i)
    out = scores.clone()
    for idx, members in groups.items():
        s = scores[members]
        out[members] = (s - s.mean()) / (s.std() + epsilon)
    return out.unsqueeze(-1) * response_mask


# ---------------------------------------------------------------- SGLang multi-turn rollout batch
def build_multiturn_batch(vocab, prompt_length, response_length, pad_id=0):
    g = torch.Generator().manual_seed(3)
    # each response: (segment_len, is_model_generated) -- assistant / tool / assistant ...
    convs = [
        (5, [(4, 1), (6, 0), (3, 1)]),
        (3, [(3, 1), (5, 0), (4, 1), (2, 0), (2, 1)]),
        (6, [(7, 1)]),
        (4, [(2, 1), (8, 0), (5, 1)]),
    ]
    prompts, responses, attn, resp_mask = [], [], [], []
    for p_len, segs in convs:
        p = torch.randint(1, vocab, (p_len,), generator=g)
        r = torch.cat([torch.randint(1, vocab, (n,), generator=g) for n, _ in segs])
        lm = torch.cat([torch.full((n,), m) for n, m in segs])
        prompts.append(torch.cat([torch.full((prompt_length - p_len,), pad_id), p]))  # left pad
        responses.append(torch.cat([r, torch.full((response_length - len(r),), pad_id)]))  # right pad
        attn.append(torch.cat([torch.zeros(prompt_length - p_len, dtype=torch.long), torch.ones(p_len, dtype=torch.long),
                               torch.ones(len(r), dtype=torch.long),
                               torch.zeros(response_length - len(r), dtype=torch.long)]))
        resp_mask.append(torch.cat([lm, torch.zeros(response_length - len(r), dtype=torch.long)]))
    prompts, responses = torch.stack(prompts), torch.stack(responses)
    attention_mask = torch.stack(attn)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": torch.stack(resp_mask),
    }


class ActorConfig:
    clip_ratio = 0.2
    clip_ratio_low = None
    clip_ratio_high = None
    clip_ratio_c = 3.0
    entropy_coeff = 0.001
    loss_agg_mode = "token-mean"
    use_kl_loss = True
    kl_loss_type = "low_var_kl"
    kl_loss_coef = 0.001


def forward_step(model, data):
    out = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"],
                position_ids=data["position_ids"])
    logits = out.logits
    # log prob of token t+1 at position t (megatron vocab-parallel output, right-aligned like upstream)
    log_probs = logprobs_from_logits(logits[:, :-1], data["input_ids"][:, 1:])
    log_probs = F.pad(log_probs, (0, 1))
    entropy = F.pad(entropy_from_logits(logits[:, :-1]), (0, 1))
    return {"log_probs": log_probs, "entropy": entropy}


def loss_func(config, output, data, meta_info):
    responses = data["responses"]
    response_length = responses.size(1)
    if FIXED:
        response_mask = data["response_mask"].to(bool)
    else:
        attention_mask = data["attention_mask"].to(bool)
        response_mask = attention_mask[:, -response_length:]
    loss_agg_mode = config.loss_agg_mode

    log_prob = output["log_probs"][:, -response_length - 1: -1].contiguous()
    pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = compute_policy_loss(
        old_log_prob=data["old_log_probs"], log_prob=log_prob, advantages=data["advantages"],
        response_mask=response_mask, cliprange=config.clip_ratio, cliprange_low=config.clip_ratio_low,
        cliprange_high=config.clip_ratio_high, clip_ratio_c=config.clip_ratio_c, loss_agg_mode=loss_agg_mode,
    )
    entropy = output["entropy"][:, -response_length - 1: -1].contiguous()
    entropy_loss = agg_loss(loss_mat=entropy, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)
    policy_loss = pg_loss - meta_info["entropy_coeff"] * entropy_loss
    kld = kl_penalty(logprob=log_prob, ref_logprob=data["ref_log_prob"], kl_penalty=config.kl_loss_type)
    kl_loss = agg_loss(loss_mat=kld, loss_mask=response_mask, loss_agg_mode=config.loss_agg_mode)
    policy_loss = policy_loss + kl_loss * config.kl_loss_coef
    stats = {"actor/pg_loss": pg_loss.item(), "actor/entropy": entropy_loss.item(), "actor/kl_loss": kl_loss.item(),
             "actor/ppo_kl": ppo_kl.item(), "actor/pg_clipfrac": pg_clipfrac.item()}
    return policy_loss, stats


def main():
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    actor = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(1)
    ref = LlamaForCausalLM(cfg).eval()
    prompt_length, response_length = 8, 20
    data = build_multiturn_batch(cfg.vocab_size, prompt_length, response_length)

    with torch.no_grad():
        # rollout-time log probs (old policy = slightly perturbed actor), reference log probs
        old = forward_step(actor, data)["log_probs"][:, -response_length - 1: -1]
        data["old_log_probs"] = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5))
        data["ref_log_prob"] = forward_step(ref, data)["log_probs"][:, -response_length - 1: -1]
        rewards = torch.zeros(4, response_length)
        rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
        data["advantages"] = compute_grpo_outcome_advantage(rewards, data["response_mask"].float(), index=[0, 0, 1, 1])

    output = forward_step(actor, data)
    loss, stats = loss_func(ActorConfig(), output, data, {"entropy_coeff": ActorConfig.entropy_coeff})
    loss.backward()
    gnorm = torch.sqrt(sum(p.grad.pow(2).sum() for p in actor.parameters() if p.grad is not None))
    print("attention_mask response tokens:", data["attention_mask"][:, -response_length:].sum(1).tolist())
    print("response_mask tokens:          ", data["response_mask"].sum(1).tolist())
    for k, v in stats.items():
        print(f"{k}: {v:.6f}")
    print(f"policy_loss: {loss.item():.6f}  grad_norm: {gnorm.item():.6f}")


if __name__ == "__main__":
    main()
