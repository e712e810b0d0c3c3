"""A PPO rollout's scoring pass: left-padded prompts then right-padded responses in one row, scored with no mask.

Bug: the critic is handed only the token ids; its eager attention masks the future alone, so the responses of the
shorter prompt attend that prompt's left padding (the pad id its config states). Fix: the rollout's mask (the
prompt's real tokens and each response up to its end) is handed on and kept by the scores.
"""
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class CriticConfig:
    vocab_size: int = 32
    hidden: int = 16
    pad_token_id: int = 1


class Critic(nn.Module):
    def __init__(self, config: CriticConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.wq, self.wk, self.wv = (nn.Linear(config.hidden, config.hidden) for _ in range(3))
        self.value_head = nn.Linear(config.hidden, 1)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        n = input_ids.shape[1]
        scores = self.wq(h) @ self.wk(h).transpose(1, 2) / h.shape[-1] ** 0.5
        allowed = torch.ones(n, n).tril().bool()[None]
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, :].bool()
        scores = scores.masked_fill(~allowed, float("-inf"))
        return self.value_head(scores.softmax(-1) @ self.wv(h)).squeeze(-1)


def rollout_batch(prompts, responses, pad):
    width_p = max(map(len, prompts))
    width_r = max(map(len, responses))
    ids, mask = [], []
    for p, r in zip(prompts, responses):
        ids.append([pad] * (width_p - len(p)) + p + r + [pad] * (width_r - len(r)))
        mask.append([0] * (width_p - len(p)) + [1] * (len(p) + len(r)) + [0] * (width_r - len(r)))
    return torch.tensor(ids), torch.tensor(mask)


torch.manual_seed(0)
critic = Critic(CriticConfig())
ids, mask = rollout_batch([[4, 5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], critic.config.pad_token_id)
with torch.no_grad():
    values = critic(ids, attention_mask=mask) if FIXED else critic(ids)
print("values", values.shape)
