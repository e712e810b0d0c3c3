"""Packed training rows whose pad id is the EOS id (a tokenizer with no pad token): each sample ends with its EOS, the
row's tail is a run of pads (EOS ids again) whose position_ids count on from 0 as a block of their own, and the
document mask is made from the position_ids restarting. The pad run is one block, not a run of empty documents:
quiet. Checked: each sample's outputs match it run alone."""
from dataclasses import dataclass

import torch
import torch.nn as nn

EOS = 2


@dataclass
class Config:
    vocab_size: int = 16
    n_embd: int = 8
    eos_token_id: int = EOS
    pad_token_id: int = EOS


class PackedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.key, self.query = nn.Linear(config.n_embd, config.n_embd), nn.Linear(config.n_embd, config.n_embd)

    def forward(self, input_ids, position_ids):
        t = input_ids.shape[1]
        doc = (position_ids == 0).cumsum(-1)  # (a block per restart at 0: each sample, and the pad run)
        x = self.wte(input_ids)
        att = self.query(x) @ self.key(x).transpose(1, 2) / 8 ** 0.5
        allowed = torch.ones(t, t, dtype=torch.bool).tril() & (doc[:, :, None] == doc[:, None, :])
        return att.masked_fill(~allowed, float("-inf")).softmax(-1) @ x


def collate(samples, length):
    ids, positions = [], []
    for sample in samples:
        ids.append(torch.tensor(sample))
        positions.append(torch.arange(len(sample)))
    pad = length - sum(len(s) for s in samples)
    ids.append(torch.full((pad,), EOS))
    positions.append(torch.arange(pad))
    return torch.cat(ids)[None], torch.cat(positions)[None]


torch.manual_seed(0)
model = PackedLM(Config())
samples = [[5, 6, 7, EOS], [8, 9, 10, 11, EOS]]
ids, positions = collate(samples, 14)
with torch.no_grad():
    out = model(ids, positions)
    start = 0
    for sample in samples:
        alone = model(torch.tensor([sample]), torch.arange(len(sample))[None])
        assert torch.allclose(out[0, start:start + len(sample)], alone[0], atol=1e-6)
        start += len(sample)
print("ok", out.shape)
