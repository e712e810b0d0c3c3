"""A preference trainer that builds a (B, L, L) attention mask for its left-padded batch and never hands it to the model.

Written for maskcli's tests (checks/held.py, held-mask-ignored), MaxText#4016 written another way: the trainer's own
function `sequence_logps` (not a module) holds `attn_mask`, True = hidden (causal and padding), over a left-padded
batch; the model masks its hand-written softmax with its own causal triangle only, so real tokens attend the left
padding. `--fixed` hands the mask to the model, which fills those cells with -inf.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
PAD = 0


class TinyLM(nn.Module):
    def __init__(self, vocab=40, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, attn_mask=None):
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
        length = input_ids.shape[1]
        hidden = attn_mask if attn_mask is not None else torch.ones(length, length, dtype=torch.bool).triu(1)[None]
        scores = scores.masked_fill(hidden, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return self.head(x + weights @ v)


def sequence_logps(model, input_ids):
    real = input_ids != PAD
    length = input_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    attn_mask = ~(causal[None] & real[:, None, :])  # True = hidden
    logits = model(input_ids, attn_mask=attn_mask) if FIXED else model(input_ids)
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return (logps * real[:, 1:]).sum(-1)


if __name__ == "__main__":
    torch.manual_seed(0)
    input_ids = torch.tensor([[PAD, PAD, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [PAD, 15, 16, 17, 18, 19]])
    with torch.no_grad():
        print("fixed" if FIXED else "buggy", [round(v, 4) for v in sequence_logps(TinyLM().eval(), input_ids).tolist()])
