# Written for maskcli's tests (the bug of huggingface/transformers#17306 written another way): a RoBERTa-style encoder
# over a left-padded batch (pad id 1) whose activations carry outliers, so q @ kᵀ spans about ±1e5. Its extended
# padding mask is `(attention_mask - 1) * 10000`, added to the scores: -1e4 lowers a padded key less than the scores
# differ, so real tokens still read the pads. Fixed: masked_fill with finfo(dtype).min, which no score outweighs.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(1)
HEADS, WIDTH, PAD = 3, 24, 1


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads = HEADS
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, extended):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, WIDTH // HEADS).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k)  # (no 1/sqrt(d): an exported graph that folded it away)
        if FIXED:
            scores = scores.masked_fill(extended == 0, torch.finfo(scores.dtype).min)
        else:
            scores = scores + extended
        weights = scores.softmax(dim=-1)
        return self.out(torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, WIDTH))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, WIDTH, padding_idx=PAD)
        self.blocks = nn.ModuleList([SelfAttention() for _ in range(2)])

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        if FIXED:
            extended = attention_mask[:, None, None, :]
        else:
            extended = (attention_mask[:, None, None, :].float() - 1.0) * 10000.0
        for block in self.blocks:
            x = x + block(x, extended)
        return x


model = Encoder().eval()
with torch.no_grad():
    model.embed.weight.mul_(30.0)  # outlier features, as converted checkpoints carry them
    for block in model.blocks:
        block.qkv.weight.mul_(6.0)
input_ids = torch.tensor([[PAD, PAD, 7, 8, 9, 10, 11],
                          [PAD, 12, 13, 14, 15, 16, 17],
                          [18, 19, 20, 21, 22, 23, 24]])
attention_mask = (input_ids != PAD).long()
with torch.no_grad():
    out = model(input_ids, attention_mask)
    alone = model(input_ids[:1, 2:], attention_mask[:1, 2:])
print(f"fixed={FIXED} |batched - alone| over row 0's real tokens: {(out[0, 2:] - alone[0]).abs().max().item():.3e}")
