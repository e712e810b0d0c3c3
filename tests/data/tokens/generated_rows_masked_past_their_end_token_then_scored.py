"""Sampled continuations scored with a mask cut after each row's end token: what was sampled past the end is no text.

keras-team/keras-hub#1029's fix (tests/data/blind/keras_nlp_gpt2_generate_output_padding_mask_cumsum_over_batch.py)
written another way: a hand-written decoder whose config dataclass states `pad_token_id = 0` and `eos_token_id = 2`
samples a fixed number of tokens for every row of a batch padded to a static width (rows that end keep being
sampled, as a static-shape loop does), then builds the output mask as the prompt's padding mask or-ed with `cumsum(is_end, axis=-1)
exclusive == 0` along each row, and scores the rows under it (SDPA, a boolean causal-and-padding mask). The tokens a
row sampled after its end token are masked on purpose. `--over-batch`: the exclusive cumsum is taken over the
flattened batch, keras-nlp's slip, so rows after an ended one lose real tokens.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

OVER_BATCH = "--over-batch" in sys.argv
PAD = 0


@dataclass
class Config:
    vocab_size: int = 12
    dim: int = 32
    heads: int = 4
    pad_token_id: int = 0
    eos_token_id: int = 2


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.pos = nn.Embedding(32, config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.out = nn.Linear(config.dim, config.vocab_size)

    def forward(self, input_ids, attention_mask):
        b, t = input_ids.shape
        x = self.embed(input_ids) + self.pos(torch.arange(t))
        q, k, v = self.qkv(x).view(b, t, 3, self.config.heads, -1).permute(2, 0, 3, 1, 4)
        keep = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & attention_mask[:, None, None, :].bool()
        keep = keep | torch.eye(t, dtype=torch.bool)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(x + y.transpose(1, 2).reshape(b, t, -1))


def output_mask(tokens, prompt_mask, end_id):
    """1 over the prompt and every token up to and including each row's first end token after the prompt."""
    is_end = (tokens == end_id) & (prompt_mask == 0)
    if OVER_BATCH:
        flat = is_end.reshape(-1).long()
        before = (flat.cumsum(0) - flat).reshape(tokens.shape)
    else:
        before = is_end.long().cumsum(-1) - is_end.long()
    return ((prompt_mask.bool() | (before == 0)) & (tokens != PAD)).long()


@torch.no_grad()
def main():
    torch.manual_seed(0)
    config = Config()
    model = Decoder(config).eval()
    prompts = [[1, 5, 7], [1, 9, 3], [1, 4, 6]]
    length, generated = 12, 10  # (the batch's width, and the columns sampled: the last ones stay padding)
    tokens = torch.full((len(prompts), length), config.pad_token_id)
    prompt_mask = torch.zeros_like(tokens)
    for row, p in enumerate(prompts):
        tokens[row, :len(p)], prompt_mask[row, :len(p)] = torch.tensor(p), 1
    generator = torch.Generator().manual_seed(3)
    for col in range(min(map(len, prompts)), generated):
        logits = model(tokens, (prompt_mask.bool() | (torch.arange(length) < col)).long())[:, col - 1]
        logits[:, config.pad_token_id] = float("-inf")
        sampled = torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
        fill = prompt_mask[:, col] == 0
        tokens[fill, col] = sampled[fill]
    mask = output_mask(tokens, prompt_mask, config.eos_token_id)
    scores = model(tokens, mask).log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    print("kept per row:", mask.sum(-1).tolist(), "scores:", [round(float(s), 3) for s in (scores * mask[:, 1:]).sum(-1)])


if __name__ == "__main__":
    main()
