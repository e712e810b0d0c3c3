"""A packed, left-padded batch for an nn.MultiheadAttention decoder: the collator numbers every packed sample with a
counter over the whole batch and gives each row's left padding the negated number of the row's first sample
(`-first`), so a pad never shares a real sample's id. The counter starts at 0, and -0 is 0: the first row's padding
gets the id of its first sample, the block mask (equal segment ids, causal) joins them, and that sample's real tokens
attend the padding before them (python FILE; --fixed: the counter starts at 1).
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


@dataclass
class DecoderConfig:
    vocab_size: int = 40
    hidden_size: int = 24
    num_heads: int = 4
    pad_token_id: int = 0
    row_length: int = 16


def collate(samples, config):
    """Rows of packed samples, left-padded: segment ids from a counter over the batch, pads at -(row's first)."""
    counter = 1 if FIXED else 0
    ids, segments = [], []
    for row in samples:
        first = counter
        tokens, numbers = [], []
        for sample in row:
            tokens += sample
            numbers += [counter] * len(sample)
            counter += 1
        pad = config.row_length - len(tokens)
        ids.append([config.pad_token_id] * pad + tokens)
        segments.append([-first] * pad + numbers)
    return torch.tensor(ids), torch.tensor(segments)


class PackedDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.attn = nn.MultiheadAttention(config.hidden_size, config.num_heads, batch_first=True)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, segment_ids):
        x = self.embed(input_ids)
        n = input_ids.shape[1]
        apart = segment_ids[:, :, None] != segment_ids[:, None, :]
        blocked = apart | torch.ones(n, n, dtype=torch.bool).triu(1)
        blocked = blocked.repeat_interleave(self.config.num_heads, dim=0)
        y, _ = self.attn(x, x, x, attn_mask=blocked, need_weights=False)
        return self.lm_head(y)


def main():
    torch.manual_seed(0)
    config = DecoderConfig()
    g = torch.Generator().manual_seed(3)
    rows = [[torch.randint(3, 40, (n,), generator=g).tolist() for n in lengths] for lengths in ((4, 6), (5, 3, 5))]
    input_ids, segment_ids = collate(rows, config)
    model = PackedDecoder(config)
    logits = model(input_ids, segment_ids)
    print("logits", tuple(logits.shape), f"{logits.float().abs().mean().item():.4f}")


if __name__ == "__main__":
    main()
