# vwxyzjn/lm-human-preference-details commit 76dfe89 ("handle postprocessed query padding"),
# lm_human_preference_details/train_policy_accelerate.py, the PPO rollout's reward pass.
# The queries are left-padded (left_padding_to_right_padding moves every pad to the left); the sampled responses
# are post-processed by replacing every token after the first truncate_token (at or after truncate_after) with
# the pad id. get_reward builds attention_mask = (ids != pad), exclusive-cumsum position_ids, and reads the
# reward at the last position, reward[:, -1]. Before the fix, queries + postprocessed_responses went to get_reward
# as they were, so a truncated response leaves pads at the right end and the score is read at a pad position.
# Fix: postprocessed_query_responses = left_padding_to_right_padding(postprocessed_query_responses, pad_token_id)
# before get_reward, so every pad sits on the left and the last position is the response's last real token.
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv


@dataclass
class PpoHParams:
    local_batch_size: int = 8
    gamma: float = 1
    lam: float = 0.95
    whiten_rewards: bool = True


@dataclass
class TaskHParams:
    # Query params
    query_length: int = 12

    # Response params
    response_length: int = 24

    # Truncate response after the first occurrence of this token at or after index after when sampling.
    truncate_token: int = 13
    truncate_after: int = 16
    penalty_reward_value: int = -1

    # LM params
    temperature: float = 0.7


@dataclass
class Args:
    seed: int = 1
    task: TaskHParams = field(default_factory=TaskHParams)
    ppo: PpoHParams = field(default_factory=PpoHParams)
    kl_coef: float = 0.15


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.normal_(layer.weight, std=std)
    torch.nn.init.constant_(layer.bias, val=bias_const)
    return layer


def whiten(values, shift_mean=True):
    # `unbiased=False` matches TF `tf.nn.moments`'s setting
    mean, var = torch.mean(values), torch.var(values, unbiased=False)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


class AutoModelForCausalLMWithScalarHead(nn.Module):
    def __init__(self, pretrained_model):
        super().__init__()
        self.pretrained_model = pretrained_model
        self.scalar_head = layer_init(nn.Linear(pretrained_model.config.hidden_size, 1), std=0)

    def forward(self, **kwargs):
        output = self.pretrained_model(**kwargs)
        return output, self.scalar_head(output.hidden_states[-1])


class AutoModelForCausalLMWithRewardHead(nn.Module):
    def __init__(self, pretrained_model):
        super().__init__()
        self.pretrained_model = pretrained_model
        self.scalar_head = layer_init(
            nn.Linear(pretrained_model.config.hidden_size, 1), std=1 / np.sqrt(pretrained_model.config.hidden_size + 1)
        )
        self.reward_gain = torch.nn.Parameter(torch.tensor(1.0), requires_grad=True)
        self.reward_bias = torch.nn.Parameter(torch.tensor(0.0), requires_grad=True)


class ToyTokenizer:
    """Stands in for AutoTokenizer.from_pretrained("gpt2", padding_side="right") + add_special_tokens([PAD]):
    the [PAD] id is one past the vocabulary (the embedding is not resized), padding goes on the right."""

    def __init__(self, vocab_size):
        self.pad_token_id = vocab_size
        self.padding_side = "right"

    def pad(self, encoded, padding="max_length", max_length=None, return_tensors="pt", return_attention_mask=True):
        ids = encoded["input_ids"]
        n = max_length - len(ids)
        return {
            "input_ids": torch.tensor(ids + [self.pad_token_id] * n),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * n),
        }


def query_dataset(tokenizer, query_length, n, vocab_size, rng):
    # MyDataset: encode a text, cut it to query_length, pad to max_length (right padding)
    rows = []
    for _ in range(n):
        length = int(rng.integers(5, query_length + 1))
        tokens = rng.integers(1, vocab_size, size=length).tolist()
        rows.append(tokenizer.pad({"input_ids": tokens[:query_length]}, padding="max_length", max_length=query_length))
    return {"input_ids": torch.stack([r["input_ids"] for r in rows]),
            "attention_mask": torch.stack([r["attention_mask"] for r in rows])}


def left_padding_to_right_padding(query, pad_id):
    # got to convert to right padding, otherwise `transformers` has weird issues
    # even with `position_ids`
    return torch.tensor([
        [pad_id]*(row==pad_id).sum() + [x for x in row if x != pad_id]
        for row in query
    ])


def generate(pretrained_model, queries, tokenizer, generation_config):
    """generate in a way that does not affect padding tokens"""
    context_length = queries.shape[1]
    attention_mask = queries != tokenizer.pad_token_id
    input_ids = queries.clone()
    input_ids[~attention_mask] = 0 # set padding tokens to 0
    output = pretrained_model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=generation_config,
        return_dict_in_generate=True,
    )
    # restore padding tokens
    return torch.cat((queries, output.sequences[:, context_length:]), dim=1)


def get_reward(reward_model, query_responses, tokenizer):
    attention_mask = query_responses != tokenizer.pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long() # exclusive cumsum
    input_ids = query_responses.clone()
    input_ids[~attention_mask] = 0
    output = reward_model.pretrained_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        return_dict=True,
        output_hidden_states=True,
    )
    reward = reward_model.scalar_head(output.hidden_states[-1])
    reward = reward_model.reward_gain * reward + reward_model.reward_bias
    # but we only care about the reward of the last token
    reward = reward[:, -1]
    return reward


def forward(policy, query_responses, tokenizer):
    attention_mask = query_responses != tokenizer.pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long() # exclusive cumsum
    input_ids = query_responses.clone()
    input_ids[~attention_mask] = 0
    return policy(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        return_dict=True,
        output_hidden_states=True,
    )


def make_model(vocab_size, seed):
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    return model.eval()


def train(args: Args):
    vocab_size = 16
    tokenizer = ToyTokenizer(vocab_size)
    rng = np.random.default_rng(args.seed)
    reward_model = AutoModelForCausalLMWithRewardHead(make_model(vocab_size, 1)).eval()
    ref_policy = AutoModelForCausalLMWithScalarHead(make_model(vocab_size, 2)).eval()
    policy = AutoModelForCausalLMWithScalarHead(make_model(vocab_size, 2)).eval()
    policy.pretrained_model.generation_config.eos_token_id = None  # disable `pad_token_id` and `eos_token_id` because we just want to
    policy.pretrained_model.generation_config.pad_token_id = None  # generate tokens without truncation / padding
    generation_config = GenerationConfig(
        max_new_tokens=args.task.response_length,
        min_new_tokens=args.task.response_length,
        temperature=args.task.temperature,
        top_k=0,
        top_p=1.0,
        do_sample=True,
        pad_token_id=0,
    )

    data = query_dataset(tokenizer, args.task.query_length, args.ppo.local_batch_size, vocab_size, rng)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        queries = left_padding_to_right_padding(data["input_ids"], tokenizer.pad_token_id)
        query_responses = generate(policy.pretrained_model, queries, tokenizer, generation_config)
        context_length = queries.shape[1]
        responses = query_responses[:, context_length:]

        output, full_values = forward(policy, query_responses, tokenizer)
        values = full_values[:, context_length - 1:-1].squeeze(-1)
        logits = output.logits[:, context_length - 1:-1]
        logits /= args.task.temperature
        all_logprobs = F.log_softmax(logits, dim=-1)
        logprobs = torch.gather(all_logprobs, 2, responses.unsqueeze(-1)).squeeze(-1)

        ref_output, _ = forward(ref_policy, query_responses, tokenizer)
        ref_logits = ref_output.logits[:, context_length - 1:-1]
        ref_logits /= args.task.temperature
        ref_all_logprobs = F.log_softmax(ref_logits, dim=-1)
        ref_logprobs = torch.gather(ref_all_logprobs, 2, responses.unsqueeze(-1)).squeeze(-1)

        # **Response Processing**
        # 1. truncate at the first occurrence of `truncate_token` that appears at or after
        # position truncate_after in the responses
        truncate_token_mask = (responses == args.task.truncate_token)
        truncate_after_or_token_mask = torch.cat([torch.zeros_like(truncate_token_mask)[:, :args.task.truncate_after],
                                                  truncate_token_mask[:, args.task.truncate_after:]], dim=1)
        truncate_mask = (torch.cumsum(truncate_after_or_token_mask, dim=1) - truncate_after_or_token_mask.long()).bool()
        postprocessed_responses = torch.where(truncate_mask, torch.full_like(responses, tokenizer.pad_token_id), responses)

        # 2. run reward model on the truncated responses
        postprocessed_query_responses = torch.cat((queries, postprocessed_responses), 1)
        if FIXED:
            postprocessed_query_responses = left_padding_to_right_padding(postprocessed_query_responses, tokenizer.pad_token_id)
        scores = get_reward(reward_model, postprocessed_query_responses, tokenizer).flatten()

        # 3. filter response. Ensure that the sample contains truncate_token
        # responses not passing that filter will receive a low (fixed) score
        matches_token = (postprocessed_responses[:, args.task.truncate_after:] == args.task.truncate_token)
        filter_mask = torch.any(matches_token, dim=-1)
        scores = torch.where(filter_mask, scores, torch.full_like(scores, args.task.penalty_reward_value))

        # 4. compute rewards
        kl = logprobs - ref_logprobs
        non_score_reward = -args.kl_coef * kl
        rewards = non_score_reward.clone()
        rewards[:, -1] += scores

        # 5. whiten rewards
        if args.ppo.whiten_rewards:
            rewards = whiten(rewards, shift_mean=False)

        # 6. compute advantages and returns
        lastgaelam = 0
        advantages_reversed = []
        gen_length = args.task.response_length
        for t in reversed(range(gen_length)):
            nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
            delta = rewards[:, t] + args.ppo.gamma * nextvalues - values[:, t]
            lastgaelam = delta + args.ppo.gamma * args.ppo.lam * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], axis=1)
        returns = advantages + values
        advantages = whiten(advantages)

    print("truncated rows:", filter_mask.tolist())
    print("scores:", [round(s, 4) for s in scores.tolist()])
    print("advantages[:, 0]:", [round(a, 4) for a in advantages[:, 0].tolist()])
    print("returns mean:", round(returns.mean().item(), 4))


if __name__ == "__main__":
    train(Args())
