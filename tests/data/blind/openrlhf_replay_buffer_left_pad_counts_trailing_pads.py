"""OpenRLHF (then OpenLLaMA2) PPO replay buffer: left padding counted from all the zeros of the attention mask.

Citation: OpenRLHF/OpenRLHF commit 12be89e3 ("fix left_pad"), openllama2/trainer/ppo_utils/replay_buffer.py
remove_padding_in_sequences. Bug state read at 12be89e3^ together with openllama2/models/actor.py (Actor.generate
/ forward), trainer/ppo_utils/experience_maker.py (make_experience), trainer/ppo_trainer.py
(training_step_actor), models/loss.py (PolicyLoss), models/utils.py and examples/train_ppo.py.

Bug: when an experience batch enters the replay buffer, each row's padding is cut off before the rows are
re-padded (on the left) into training batches. The right padding is taken from the action mask's zeros (minus
one for the eos), and the left padding as `(1 - att_mask).sum() - right_pad`, i.e. every zero of the attention
mask not counted on the right is taken to be on the left. A response that stops early leaves one more pad
after its eos than that right count (the last token is not in the action mask), so `left_pad` is one too large
and `seq[left_pad:]` / `att_mask[left_pad:]` cut off the first real prompt token (the BOS) of the row.

Fix: `left_pad` is the index of the first attended position of `att_mask`.

This program: left-padded prompts, Actor.generate (greedy: the example script passes `do_samples=True`, which
the actor ignores) with the mask rebuilt from eos/pad ids, make_experience's log-probs and KL reward, the
replay buffer, and the actor's PPO step on a tiny LlamaForCausalLM built from its config. Critic and reward
model are omitted: values are zero and the score is a fixed number per row.
"""
import sys
from abc import ABC
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv

PAD, BOS, EOS = 0, 1, 2


def log_probs_from_logits(logits, labels):
    log_probs = F.log_softmax(logits, dim=-1)
    return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


def masked_mean(tensor, mask, dim=1):
    tensor = tensor * mask
    return tensor.sum(dim=dim) / (mask.sum(dim=dim) + 1e-8)


def compute_reward(r, kl_coef, log_probs, log_probs_base, action_mask):
    kl = (log_probs - log_probs_base) * action_mask
    kl_reward = -kl_coef * kl
    r = r.clamp(min=-10, max=10)
    last_reward = torch.zeros_like(kl)
    for i in range(last_reward.size(0)):
        for t in reversed(range(last_reward.size(1))):
            if action_mask[i][t] > 0.5:
                last_reward[i][t] = r[i]
                break
    return last_reward + kl_reward, kl


class Actor(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    @torch.no_grad()
    def generate(self, input_ids, **kwargs):
        generate_args = {
            "input_ids": input_ids,
            "do_sample": kwargs.get("do_sample", False),
            "use_cache": True,
            "num_beams": kwargs.get("num_beams", 1),
            "attention_mask": kwargs.get("attention_mask"),
            "eos_token_id": kwargs.get("eos_token_id"),
            "pad_token_id": kwargs.get("pad_token_id"),
            "min_new_tokens": kwargs.get("min_new_tokens ", 1),
        }
        if kwargs.get("max_new_tokens", None):
            generate_args["max_new_tokens"] = kwargs.get("max_new_tokens")
        sequences = self.model.generate(**generate_args)

        eos_token_id = generate_args["eos_token_id"]
        pad_token_id = generate_args["pad_token_id"]
        attention_mask = (sequences.ne(eos_token_id) & sequences.ne(pad_token_id)).to(dtype=torch.long)
        seq_length = attention_mask.size(1)
        for i in range(attention_mask.size(0)):
            for t in reversed(range(seq_length)):
                if attention_mask[i][t] > 0.5:
                    attention_mask[i][min(t + 1, seq_length - 1)] = True
                    sequences[i][min(t + 1, seq_length - 1)] = eos_token_id
                    break

        input_len = input_ids.size(1)
        action_seq = sequences[:, input_len:-1]
        action_mask = action_seq.ne(eos_token_id) & action_seq.ne(pad_token_id)
        return sequences, attention_mask, action_mask

    def forward(self, sequences, num_actions=None, attention_mask=None):
        output = self.model(sequences, attention_mask=attention_mask)
        log_probs = log_probs_from_logits(output["logits"][:, :-1, :], sequences[:, 1:])
        return log_probs[:, -num_actions:]


@dataclass
class Experience:
    sequences: torch.Tensor
    action_log_probs: torch.Tensor
    values: torch.Tensor
    returns: Optional[torch.Tensor]
    advantages: Optional[torch.Tensor]
    attention_mask: Optional[torch.LongTensor]
    action_mask: Optional[torch.BoolTensor]


def get_advantages_and_returns(values, rewards, action_mask, gamma, lambd):
    lastgaelam = 0
    advantages_reversed = []
    response_length = rewards.size(1)
    values = action_mask * values
    rewards = action_mask * rewards
    for t in reversed(range(response_length)):
        nextvalues = values[:, t + 1] if t < response_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lambd * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return advantages.detach(), returns


@torch.no_grad()
def make_experience(actor, initial_model, input_ids, scores, kl_coef=0.02, **generate_kwargs):
    actor.eval()
    sequences, attention_mask, action_mask = actor.generate(input_ids, **generate_kwargs)
    num_actions = action_mask.size(1)
    action_log_probs = actor(sequences, num_actions, attention_mask)
    base_action_log_probs = initial_model(sequences, num_actions, attention_mask)
    value = torch.zeros_like(action_log_probs)  # critic omitted
    reward, kl = compute_reward(scores, kl_coef, action_log_probs, base_action_log_probs, action_mask=action_mask)
    advantage, returns = get_advantages_and_returns(
        value, reward, action_mask, generate_kwargs["gamma"], generate_kwargs["lambd"]
    )
    return Experience(sequences, action_log_probs, value, returns, advantage, attention_mask, action_mask)


@dataclass
class BufferItem:
    sequences: torch.Tensor
    action_log_probs: torch.Tensor
    values: torch.Tensor
    returns: torch.Tensor
    advantages: torch.Tensor
    attention_mask: Optional[torch.LongTensor]
    action_mask: Optional[torch.BoolTensor]


KEYS = ("sequences", "action_log_probs", "values", "returns", "advantages", "attention_mask", "action_mask")


def split_experience_batch(experience: Experience) -> List[BufferItem]:
    batch_size = experience.sequences.size(0)
    batch_kwargs = [{} for _ in range(batch_size)]
    for key in KEYS:
        vals = torch.unbind(getattr(experience, key))
        for i, v in enumerate(vals):
            batch_kwargs[i][key] = v
    return [BufferItem(**kwargs) for kwargs in batch_kwargs]


def zero_pad_sequences(sequences: List[torch.Tensor], side: str = "left") -> torch.Tensor:
    max_len = max(seq.size(0) for seq in sequences)
    padded_sequences = []
    for seq in sequences:
        pad_len = max_len - seq.size(0)
        padding = (pad_len, 0) if side == "left" else (0, pad_len)
        padded_sequences.append(F.pad(seq, padding))
    return torch.stack(padded_sequences, dim=0)


def make_experience_batch(items: List[BufferItem]) -> Experience:
    kwargs = {}
    for key in KEYS:
        kwargs[key] = zero_pad_sequences([getattr(item, key) for item in items], "left")
    return Experience(**kwargs)


def remove_padding_in_sequences(items):
    for item in items:
        seq, act_log_prob, value, ret, adv, att_mask, act_mask = (
            item.sequences,
            item.action_log_probs,
            item.values,
            item.returns,
            item.advantages,
            item.attention_mask,
            item.action_mask,
        )
        right_pad = (1 - act_mask.int()).sum()
        # - 1 to ignore the pad of eos_token
        if right_pad > 0:
            right_pad -= 1

        if FIXED:
            right_pad = None if right_pad == 0 else -right_pad
            # left_pad for seq and att_mask
            left_pad = 0
            for i in range(len(att_mask)):
                if att_mask[i] > 0.5:
                    left_pad = i
                    break
        else:
            left_pad = (1 - att_mask.int()).sum() - right_pad
            right_pad = None if right_pad == 0 else -right_pad
        (
            item.sequences,
            item.action_log_probs,
            item.values,
            item.returns,
            item.advantages,
            item.attention_mask,
            item.action_mask,
        ) = (
            seq[left_pad:right_pad],
            act_log_prob[:right_pad],
            value[:right_pad],
            ret[:right_pad],
            adv[:right_pad],
            att_mask[left_pad:right_pad],
            act_mask[:right_pad],
        )
    return items


class NaiveReplayBuffer(ABC):
    def __init__(self, sample_batch_size: int):
        self.sample_batch_size = sample_batch_size
        self.items: List[BufferItem] = []

    @torch.no_grad()
    def append(self, experience: Experience) -> None:
        items = split_experience_batch(experience)
        items = remove_padding_in_sequences(items)
        self.items.extend(items)

    def collate_fn(self, batch) -> Experience:
        return make_experience_batch(batch)


class PolicyLoss(nn.Module):
    def __init__(self, clip_eps: float = 0.2) -> None:
        super().__init__()
        self.clip_eps = clip_eps

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None):
        ratio = (log_probs - old_log_probs).exp()
        surr1 = ratio * advantages
        surr2 = ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps) * advantages
        loss = -torch.min(surr1, surr2)
        loss = masked_mean(loss, action_mask)
        return loss.mean()


def training_step_actor(actor, actor_loss_fn, experience: Experience):
    actor.train()
    num_actions = experience.action_mask.size(1)
    action_log_probs = actor(experience.sequences, num_actions, attention_mask=experience.attention_mask)
    actor_loss = actor_loss_fn(
        action_log_probs, experience.action_log_probs, experience.advantages, action_mask=experience.action_mask
    )
    ratio = (action_log_probs - experience.action_log_probs).exp() * experience.action_mask
    return actor_loss, ratio


def main():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.3,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 4.0  # make some greedy responses stop early
    actor = Actor(model)
    initial_model = Actor(LlamaForCausalLM(config).eval())

    # prompts tokenized with padding_side="left"
    prompts = [[BOS, 5, 6, 7, 8, 9], [BOS, 10, 11], [BOS, 12, 13, 14, 15], [BOS, 16, 17, 18, 19, 20]]
    max_len = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD] * (max_len - len(p)) + p for p in prompts])
    attention_mask = (input_ids != PAD).long()
    scores = torch.tensor([1.0, -0.5, 0.3, 0.8])

    experience = make_experience(
        actor, initial_model, input_ids, scores, attention_mask=attention_mask, do_samples=True,
        max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD, gamma=1.0, lambd=0.95,
    )
    print("generated sequences:\n", experience.sequences)
    print("attention_mask:\n", experience.attention_mask)

    replay_buffer = NaiveReplayBuffer(sample_batch_size=4)
    replay_buffer.append(experience)
    batch = replay_buffer.collate_fn(replay_buffer.items)
    print("training sequences:\n", batch.sequences)
    print("training attention_mask:\n", batch.attention_mask)

    actor_loss, ratio = training_step_actor(actor, PolicyLoss(0.2), batch)
    actor_loss.backward()
    print("policy loss:", actor_loss.item())
    print("importance ratio (masked):\n", ratio.detach())


if __name__ == "__main__":
    main()
