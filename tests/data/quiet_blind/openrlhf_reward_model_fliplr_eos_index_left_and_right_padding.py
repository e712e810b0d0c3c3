"""OpenRLHF reward model: last-real-token pooling that works for left AND right padding.

Follows OpenRLHF's openrlhf/models/model.py (_get_reward_model -> RewardModel.forward): position_ids are
attention_mask.cumsum(-1) - 1 with padded slots filled with 1, the value head runs on every position, and the
reward is read at `eos_indices = L - 1 - attention_mask.fliplr().argmax(1)`, i.e. the last 1 in the mask, so the
same code serves the right-padded training batches and the left-padded batches of the reward server. Attention is
the eager softmax(q k^T) with an additive causal+padding mask of finfo.min (as the HF backbone builds it), which
keeps rows of padding queries finite. Mask meant: causal over real tokens, padding keys hidden, either side.
"""
import math

import torch
import torch.nn as nn

torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x, attn_bias):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.h) + attn_bias
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class RewardModel(nn.Module):
    def __init__(self, vocab=40, d=32, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(64, d)
        self.layers = nn.ModuleList(Attention(d, heads) for _ in range(layers))
        self.value_head = nn.Linear(d, 1, bias=False)

    def forward(self, input_ids, attention_mask):
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        t = input_ids.shape[1]
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None] & attention_mask.bool()[:, None, :]
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
        x = self.embed(input_ids) + self.pos(position_ids)
        for layer in self.layers:
            x = x + layer(x, bias)
        values = self.value_head(x).squeeze(-1)
        eos_indices = attention_mask.size(1) - 1 - attention_mask.long().fliplr().argmax(dim=1, keepdim=True)
        return values.gather(dim=1, index=eos_indices).squeeze(1)


def main():
    model = RewardModel().eval()
    texts = [[5, 6, 7, 8, 2], [9, 10, 2]]
    L = 6
    right_ids = torch.tensor([s + [0] * (L - len(s)) for s in texts])
    right_mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in texts])
    left_ids = torch.tensor([[0] * (L - len(s)) + s for s in texts])
    left_mask = torch.tensor([[0] * (L - len(s)) + [1] * len(s) for s in texts])
    with torch.no_grad():
        r_right = model(right_ids, right_mask)
        r_left = model(left_ids, left_mask)
        r_single = torch.stack([model(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0] for s in texts])
    # the reward of a sequence does not depend on how the batch was padded
    assert torch.allclose(r_right, r_single, atol=1e-5) and torch.allclose(r_left, r_single, atol=1e-5)
    print("rewards", [round(x, 4) for x in r_single.tolist()])


if __name__ == "__main__":
    main()
