"""A PPO log-prob forward whose attention_mask is `input_ids != pad_id` with pad == EOS: a mid-response EOS is hidden.

Bug: the rollout's responses hold an EOS that ends a tool call before the tool's answer; the trainer keeps a
`response_mask` of ones per real response token (EOS included: its log-prob counts) but builds the forward's
attention_mask from the ids, `input_ids != pad_token_id`, where the pad id is the EOS. Every later token then scores
without seeing that EOS. The model is an eager softmax over an additive mask; prompts are left-padded, responses
right-padded. Fix: attention_mask = cat(prompt_mask, response_mask), from the real tokens.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
EOS = PAD = 2


class Policy(nn.Module):
    def __init__(self, vocab=20, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask):
        b, n = input_ids.shape
        q, k, v = self.qkv(self.embed(input_ids)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        keep = torch.ones(n, n).tril().bool()[None, None] & attention_mask.bool()[:, None, None, :]
        keep = keep | torch.eye(n, dtype=torch.bool)  # (a padding query keeps its own key: no empty row)
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        scores = scores + (~keep).float() * -1e4
        h = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)
        return self.out(h)


def log_probs(model, prompts, responses):
    prompt_ids = torch.full((len(prompts), max(map(len, prompts))), PAD)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, p in enumerate(prompts):
        prompt_ids[i, prompt_ids.shape[1] - len(p):] = torch.tensor(p)
        prompt_mask[i, prompt_ids.shape[1] - len(p):] = 1
    response_ids = torch.full((len(responses), max(map(len, responses))), PAD)
    response_mask = torch.zeros_like(response_ids)
    for i, r in enumerate(responses):
        response_ids[i, :len(r)] = torch.tensor(r)
        response_mask[i, :len(r)] = 1
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1) if FIXED else (input_ids != PAD).long()
    logits = model(input_ids, attention_mask)[:, -response_ids.shape[1] - 1:-1]
    scores = logits.log_softmax(-1).gather(-1, response_ids[..., None])[..., 0]
    return (scores * response_mask).sum(-1)


torch.manual_seed(0)
with torch.no_grad():
    print(log_probs(Policy(), [[5, 6, 7], [8, 9]], [[10, 11, EOS, 12, 13, EOS], [14, EOS, 15, EOS]]).tolist())
