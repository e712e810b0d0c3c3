# The rope index handed the loss mask instead of the batch's padding (positions-repeated, written another way than
# Pai-Megatron-Patch#448 and Megatron-Bridge#2582): an SFT step of a hand-written Qwen2-VL-style model over a
# LEFT-padded batch of [prompt with an image | answer], the model given the batch's attention_mask (eager softmax).
# The collator computes the 3-row (t, h, w) rope ids from `labels != -100`, so every prompt token (text and image,
# real, attended) is left at the 1 the index fills padding with. Fixed: the ids from the attention_mask.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, VSTART, IMG, IGNORE = 0, 1, 2, -100
D, H, V, MERGE = 24, 2, 32, 2
HD = D // H


def rope_index(input_ids, image_grid_thw, attention_mask):
    """Qwen2-VL's index: the tokens where attention_mask == 1 are counted (text one per token, an image's grid as
    (t, h, w) after the text before it); every other token stays at 1."""
    position_ids = torch.ones(3, *input_ids.shape, dtype=torch.long)
    image = 0
    for i, row in enumerate(input_ids):
        keep = attention_mask[i] == 1
        tokens = row[keep].tolist()
        parts, st = [], 0
        while IMG in tokens[st:]:
            ed = tokens.index(IMG, st)
            t, h, w = image_grid_thw[image].tolist()
            image += 1
            gh, gw = h // MERGE, w // MERGE
            base = parts[-1].max() + 1 if parts else 0
            parts.append(torch.arange(ed - st).expand(3, -1) + base)
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
            parts.append(grid.reshape(3, -1) + ed - st + base)
            st = ed + t * gh * gw
        if st < len(tokens):
            base = parts[-1].max() + 1 if parts else 0
            parts.append(torch.arange(len(tokens) - st).expand(3, -1) + base)
        if parts:
            position_ids[:, i, keep] = torch.cat(parts, dim=1)
    return position_ids


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, angles, attention_mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, HD).permute(2, 0, 3, 1, 4)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        q = q * cos + torch.cat((-q[..., HD // 2:], q[..., :HD // 2]), -1) * sin
        k = k * cos + torch.cat((-k[..., HD // 2:], k[..., :HD // 2]), -1) * sin
        scores = q @ k.transpose(-1, -2) / HD ** 0.5
        hidden = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None] | (attention_mask[:, None, None, :] == 0)
        hidden = hidden & ~torch.eye(n, dtype=torch.bool)  # (a pad's query sees itself: no empty softmax row)
        weights = scores.masked_fill(hidden, torch.finfo(scores.dtype).min).softmax(-1)
        return x + self.out((weights @ v).transpose(1, 2).reshape(b, n, D))


class VisionLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.inv_freq = 1.0 / 10000 ** (torch.arange(0, HD, 2).float() / HD)

    def forward(self, input_ids, attention_mask, position_ids, pixel_embeds):
        x = self.embed(input_ids)
        x = x.masked_scatter((input_ids == IMG)[..., None], pixel_embeds)
        freqs = position_ids[..., None].float() * self.inv_freq  # (3, b, n, HD / 2): t, h, w sections
        sections = freqs.split([2, 2, 2], dim=-1)
        angles = torch.cat([part[i] for i, part in enumerate(sections)], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        for layer in self.layers:
            x = layer(x, angles, attention_mask)
        return x


def collate(samples, length):
    """Left-padded [prompt | answer] rows: input_ids, attention_mask, labels (-100 over the prompt and the pads)."""
    input_ids = torch.full((len(samples), length), PAD)
    attention_mask = torch.zeros(len(samples), length, dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE)
    for i, (prompt, answer) in enumerate(samples):
        row = prompt + answer
        input_ids[i, length - len(row):] = torch.tensor(row)
        attention_mask[i, length - len(row):] = 1
        labels[i, length - len(answer):] = torch.tensor(answer)
    return input_ids, attention_mask, labels


samples = [([5, 6, VSTART] + [IMG] * 4 + [7, 8], [9, 10, 11]),
           ([12, VSTART] + [IMG] * 4 + [13], [14, 15])]
input_ids, attention_mask, labels = collate(samples, 14)
grid = torch.tensor([[1, 4, 4], [1, 4, 4]])
rope_mask = attention_mask if FIXED else (labels != IGNORE).long()
position_ids = rope_index(input_ids, grid, rope_mask)
model = VisionLanguageModel()
with torch.no_grad():
    out = model(input_ids, attention_mask, position_ids, torch.randn(8, D))
print("position_ids[0, 0] =", position_ids[0, 0].tolist())
