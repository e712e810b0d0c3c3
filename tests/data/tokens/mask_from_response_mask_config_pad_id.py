"""A reward model scored over prompt + response, its attention_mask taken from the response mask.

Bug: `make_inputs` hands the reward model `response_mask` (1 on the response only) as its attention_mask, so the prompt
tokens, text of many ids, are masked as if they were padding; the batch config the scoring step holds pads with id 3
(left padding). Fix: the attention_mask is `input_ids != cfg.pad_token_id`.
"""
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class BatchConfig:
    max_len: int = 6
    pad_token_id: int = 3


class RewardModel(nn.Module):
    def __init__(self, vocab=32, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.score = nn.Linear(width, 1)

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids)
        n = input_ids.shape[1]
        allowed = torch.ones(n, n).tril().bool()[None] & attention_mask.bool()[:, None, :]
        scores = (self.q(h) @ self.k(h).transpose(1, 2)).masked_fill(~allowed, torch.finfo(h.dtype).min)
        return self.score(scores.softmax(-1) @ self.v(h))[:, -1, 0]


def make_inputs(cfg, prompts, responses):
    ids, response_mask = [], []
    for p, r in zip(prompts, responses):
        pad = cfg.max_len - len(p) - len(r)
        ids.append([cfg.pad_token_id] * pad + p + r)
        response_mask.append([0] * (pad + len(p)) + [1] * len(r))
    ids = torch.tensor(ids)
    mask = (ids != cfg.pad_token_id).long() if FIXED else torch.tensor(response_mask)
    return {"input_ids": ids, "attention_mask": mask}


def score(model, cfg, prompts, responses):
    inputs = make_inputs(cfg, prompts, responses)
    with torch.no_grad():
        return model(**inputs)


torch.manual_seed(0)
print("rewards", score(RewardModel(), BatchConfig(), [[4, 5], [8, 9, 10]], [[6, 7], [11, 12, 13]]).tolist())
