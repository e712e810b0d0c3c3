"""A hand-written PaliGemma port whose config is a SimpleNamespace (no class names its family; the model class does,
PaliGemmaForConditionalGeneration): `token_type_ids` marks the image + prompt prefix (0) and the suffix to generate
(1), and the prefix should be seen both ways, but the layer builds `tril` only, so a prompt token never sees the prompt
words after it. Two decoder blocks, an additive mask (0 / the dtype's lowest), right padding. --fixed opens the prefix
(`causal | prefix x prefix`) within each row's real tokens.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, bias):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
        return x + self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


class PaliGemmaForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config.hidden_size, config.num_attention_heads) for _ in range(2))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, attention_mask, token_type_ids):
        n = input_ids.shape[1]
        keep = torch.ones(n, n, dtype=torch.bool).tril()[None]
        if FIXED:
            prefix = token_type_ids == 0
            keep = keep | (prefix[:, :, None] & prefix[:, None, :])
        keep = keep & attention_mask.bool()[:, None, :]
        bias = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)[:, None]
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, bias)
        return self.lm_head(x)


def main():
    config = SimpleNamespace(vocab_size=40, hidden_size=16, num_attention_heads=2)
    model = PaliGemmaForConditionalGeneration(config)
    # [image x3, prompt, suffix], right-padded: row 0 prefix 5 + suffix 3, row 1 prefix 4 + suffix 2 + 2 pads
    input_ids = torch.tensor([[39, 39, 39, 5, 6, 11, 12, 13], [39, 39, 39, 7, 14, 15, 0, 0]])
    attention_mask = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
    token_type_ids = torch.tensor([[0] * 5 + [1] * 3, [0] * 4 + [1] * 2 + [1] * 2])
    with torch.no_grad():
        logits = model(input_ids, attention_mask, token_type_ids)
    print("logits[0, -1, :3]:", [round(v, 4) for v in logits[0, -1, :3].tolist()])


if __name__ == "__main__":
    main()
