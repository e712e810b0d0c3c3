"""A hand-written PaliGemma port (its own dataclass `PaliGemmaConfig`, no transformers): the prefix-LM mask is built
from `token_type_ids` (0 = image and prompt, 1 = the suffix to generate), but the suffix is un-masked as the prefix
is, so each suffix token sees the suffix tokens after it. --fixed keeps the suffix causal.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class PaliGemmaConfig:
    vocab_size: int = 40
    hidden_size: int = 16
    num_attention_heads: int = 2


class PaliGemmaForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, input_ids, attention_mask, token_type_ids):
        x = self.embed(input_ids)
        b, t, d = x.shape
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None]
        prefix = (token_type_ids == 0)[:, None, :] & (token_type_ids == 0)[:, :, None]
        suffix = (token_type_ids == 1)[:, None, :] & (token_type_ids == 1)[:, :, None]
        allowed = causal | prefix if FIXED else causal | prefix | suffix
        allowed = (allowed & attention_mask.bool()[:, None, :])[:, None]
        q, k, v = self.qkv(x).view(b, t, 3, self.config.num_attention_heads, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def main():
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(PaliGemmaConfig()).eval()
    input_ids = torch.tensor([[30, 30, 5, 6, 7, 8, 9], [30, 30, 4, 11, 12, 13, 14]])
    token_type_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        out = model(input_ids, torch.ones_like(input_ids), token_type_ids)
    print("out", tuple(out.shape))


if __name__ == "__main__":
    main()
