# Written another way (the bug of Gen-Verse/MMaDA#19): a masked-diffusion LM's sampler holds the right-padded batch's
# attention_mask, builds the additive bias from it and hands it to the model, whose blocks compute their scores by
# hand and never add it: every position attends the padding. The fix adds the bias to the scores.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

MASK_ID, PAD = 31, 0


class Block(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, bias):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        if FIXED:
            scores = scores + bias
        weights = scores.softmax(-1)
        return x + self.out((weights @ v).transpose(1, 2).reshape(b, n, d))


class DiffusionLM(nn.Module):
    def __init__(self, vocab=32, dim=16, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, bias):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, bias)
        return self.head(x)


@torch.no_grad()
def sample(model, tokens, attention_mask, steps=2):
    keep = attention_mask.bool()
    bias = torch.zeros(keep.shape, dtype=torch.float).masked_fill(~keep, float("-inf"))[:, None, None, :]
    for _ in range(steps):
        logits = model(tokens, bias)
        confidence, predicted = logits.softmax(-1).max(-1)
        confidence = confidence.masked_fill(tokens != MASK_ID, -1.0)
        where = confidence.argmax(-1)
        rows = torch.arange(tokens.shape[0])
        tokens[rows, where] = predicted[rows, where]
    return logits


lengths = [10, 6]
tokens = torch.full((2, 10), PAD)
attention_mask = torch.zeros(2, 10, dtype=torch.long)
for row, length in enumerate(lengths):
    tokens[row, :length - 4] = torch.randint(1, 30, (length - 4,))  # the prompt, then 4 masked slots to fill
    tokens[row, length - 4:length] = MASK_ID
    attention_mask[row, :length] = 1

model = DiffusionLM().eval()
logits = sample(model, tokens.clone(), attention_mask, steps=1)
with torch.no_grad():
    alone = model(tokens[1:, :6], torch.zeros(1, 1, 1, 6))
print(f"max |padded row - the row alone|: {(logits[1, :6] - alone[0]).abs().max().item():.6f}")
