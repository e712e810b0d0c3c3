# OpenRLHF, OpenRLHF/OpenRLHF#217 ("`position_ids` related PPO bug"; fixed in the models by the maintainer the same day).
# The experience maker scores left-padded prompt + right-padded response sequences with the actor, the reward model
# and the critic, passing only input_ids and attention_mask, so the base model numbers positions 0..L-1 from column 0:
# a row with k pad tokens on its left sees its first real token at position k. Fix: each forward builds
# position_ids = attention_mask.cumsum(-1) - 1 (pads filled with 1) and passes them to the base model.
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model, GPT2PreTrainedModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD, EOS = 0, 1


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    log_probs = F.log_softmax(logits, dim=-1)
    log_probs_labels = log_probs.gather(dim=-1, index=labels.unsqueeze(-1))
    return log_probs_labels.squeeze(-1)


class Actor(nn.Module):
    """openrlhf/models/actor.py"""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, sequences: torch.LongTensor, num_actions: int = None,
                attention_mask: Optional[torch.Tensor] = None, return_output=False) -> torch.Tensor:
        """Returns action log probs"""
        if FIXED:
            # https://github.com/OpenLLMAI/OpenRLHF/issues/217
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            output = self.model(sequences, attention_mask=attention_mask, position_ids=position_ids)
        else:
            output = self.model(sequences, attention_mask=attention_mask)
        log_probs = log_probs_from_logits(output["logits"][:, :-1, :], sequences[:, 1:])
        if return_output:
            return output if num_actions is None else (log_probs[:, -num_actions:], output)
        return log_probs[:, -num_actions:]


def _get_reward_model(base_pretrained_model, base_llm_model):
    """openrlhf/models/model.py _get_reward_model"""

    class LLMForSequenceRegression(base_pretrained_model):
        supports_gradient_checkpointing = True

        def __init__(self, config):
            super().__init__(config)
            setattr(self, self.base_model_prefix, base_llm_model(config))
            self.value_head = nn.Linear(config.hidden_size, 1, bias=False)
            self.normalize_reward = config.normalize_reward
            self.register_buffer("mean", torch.zeros(1), persistent=False)
            self.register_buffer("std", torch.ones(1), persistent=False)
            self.post_init()

        def forward(self, input_ids: torch.LongTensor = None, attention_mask: Optional[torch.Tensor] = None,
                    return_output=False) -> torch.Tensor:
            if FIXED:
                # https://github.com/OpenLLMAI/OpenRLHF/issues/217
                position_ids = attention_mask.long().cumsum(-1) - 1
                position_ids.masked_fill_(attention_mask == 0, 1)
                outputs = getattr(self, self.base_model_prefix)(
                    input_ids, attention_mask=attention_mask, position_ids=position_ids
                )
            else:
                outputs = getattr(self, self.base_model_prefix)(input_ids, attention_mask=attention_mask)
            last_hidden_states = outputs["last_hidden_state"]
            values = self.value_head(last_hidden_states).squeeze(-1)

            # left padding in training mode
            if self.training:
                reward = values[:, -1]
            else:
                eos_indices = attention_mask.size(1) - 1 - attention_mask.long().fliplr().argmax(dim=1, keepdim=True)
                reward = values.gather(dim=1, index=eos_indices).squeeze(1)
                # normalize reward in eval mode
                if self.normalize_reward:
                    reward = (reward - self.mean) / self.std
            if return_output:
                return reward, outputs
            return reward

    return LLMForSequenceRegression


def _get_critic_model(base_pretrained_model, base_llm_model):
    """openrlhf/models/model.py _get_critic_model"""

    class LLMForSequenceRegression(base_pretrained_model):
        supports_gradient_checkpointing = True

        def __init__(self, config):
            super().__init__(config)
            setattr(self, self.base_model_prefix, base_llm_model(config))
            self.value_head = nn.Linear(config.hidden_size, 1, bias=False)
            self.normalize_reward = config.normalize_reward
            self.post_init()

        def forward(self, input_ids: torch.LongTensor = None, action_mask: Optional[torch.Tensor] = None,
                    attention_mask: Optional[torch.Tensor] = None, return_output=False) -> torch.Tensor:
            if FIXED:
                # https://github.com/OpenLLMAI/OpenRLHF/issues/217
                position_ids = attention_mask.long().cumsum(-1) - 1
                position_ids.masked_fill_(attention_mask == 0, 1)
                outputs = getattr(self, self.base_model_prefix)(
                    input_ids, attention_mask=attention_mask, position_ids=position_ids
                )
            else:
                outputs = getattr(self, self.base_model_prefix)(input_ids, attention_mask=attention_mask)
            last_hidden_states = outputs["last_hidden_state"]
            values = self.value_head(last_hidden_states).squeeze(-1)[:, :-1]
            num_actions = action_mask.size(1)
            return values[:, -num_actions:]

    return LLMForSequenceRegression


def process_sequences(sequences: torch.Tensor, input_len, eos_token_id, pad_token_id):
    """openrlhf/models/actor.py Actor.process_sequences"""
    attention_mask = (sequences.ne(eos_token_id) & sequences.ne(pad_token_id)).to(dtype=torch.long)
    seq_length = attention_mask.size(1)
    # The following code is equivalent to:
    # for i in range(attention_mask.size(0)):
    #     for t in reversed(range(seq_length)):
    #         if attention_mask[i][t] > 0.5:
    #             attention_mask[i][min(t + 1, seq_length - 1)] = True
    #             sequences[i][min(t + 1, seq_length - 1)] = eos_token_id
    #             break
    eos_indices = seq_length - attention_mask.long().fliplr().argmax(dim=1, keepdim=True).clamp(min=1)
    attention_mask.scatter_(dim=1, index=eos_indices, value=1)
    sequences.scatter_(dim=1, index=eos_indices, value=eos_token_id)
    # in RL, state_i (current token) + action_i (next token) -> state_i+1 (next token)
    state_seq = sequences[:, input_len - 1 : -1]
    action_mask = state_seq.ne(eos_token_id) & state_seq.ne(pad_token_id)
    return sequences, attention_mask, action_mask


def masked_mean(tensor, mask, dim=None):
    return (tensor * mask).sum(axis=dim) / mask.sum(axis=dim)


class NaiveExperienceMaker:
    """openrlhf/trainer/ppo_utils/experience_maker.py (generation replaced by fixed sampled answers)"""

    def __init__(self, actor, critic, reward_model, initial_model):
        self.actor, self.critic, self.reward_model, self.initial_model = actor, critic, reward_model, initial_model

    @torch.no_grad()
    def make_experience(self, input_ids, answers):
        self.actor.eval(); self.critic.eval(); self.initial_model.eval(); self.reward_model.eval()
        sequences = torch.cat([input_ids, answers], dim=1)
        sequences, attention_mask, action_mask = process_sequences(sequences, input_ids.size(1), EOS, PAD)
        num_actions = action_mask.size(1)
        action_log_probs = self.actor(sequences, num_actions, attention_mask)
        base_action_log_probs = self.initial_model(sequences, num_actions, attention_mask)
        value = self.critic(sequences, action_mask, attention_mask)
        r = self.reward_model(sequences, attention_mask)
        kl = action_log_probs - base_action_log_probs
        return dict(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                    action_log_probs=action_log_probs, value=value, reward=r,
                    kl=masked_mean(kl, action_mask, dim=-1))


def main():
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)
    config.normalize_reward = False
    actor = Actor(GPT2LMHeadModel(config))
    torch.manual_seed(1)
    initial_model = Actor(GPT2LMHeadModel(config))
    RewardModel = _get_reward_model(GPT2PreTrainedModel, GPT2Model)
    CriticModel = _get_critic_model(GPT2PreTrainedModel, GPT2Model)
    torch.manual_seed(2)
    reward_model = RewardModel(config)
    critic = CriticModel(config)

    # tokenizer(padding_side="left") prompts; vLLM/generate answers right-padded with pad after eos
    input_ids = torch.tensor([
        [5, 9, 13, 7, 21, 30, 11, 4],
        [PAD, PAD, PAD, PAD, 17, 8, 26, 3],
        [PAD, PAD, 40, 12, 6, 33, 19, 2 + 20],
    ])
    answers = torch.tensor([
        [14, 27, 35, 8, 50, EOS],
        [44, 9, 23, EOS, PAD, PAD],
        [31, 18, 7, 61, EOS, PAD],
    ])
    maker = NaiveExperienceMaker(actor, critic, reward_model, initial_model)
    exp = maker.make_experience(input_ids, answers)
    torch.set_printoptions(precision=4, sci_mode=False)
    print("reward:", exp["reward"])
    print("kl:", exp["kl"])
    print("value:", exp["value"][1])
    print("action_log_probs:", exp["action_log_probs"][1])


if __name__ == "__main__":
    main()
