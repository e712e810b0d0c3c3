"""A DiT's text cross-attention written another way: the captions are a right-padded batch (lengths 4 and 7), their
real tokens gathered end to end with `text_mask.bool()` as Sana and PixArt do, the image tokens of both samples one
sequence, and an explicit softmax over scores filled with -inf. The buggy build keys the mask on the captions' padding
alone, which the gather already removed, so every image attends both captions; `--fixed` numbers each caption token by
its sample (`repeat_interleave`) and keeps each image on its own."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

WIDTH, HEADS = 24, 3


class TextCrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(WIDTH, WIDTH)
        self.to_kv = nn.Linear(WIDTH, 2 * WIDTH)
        self.to_out = nn.Linear(WIDTH, WIDTH)

    def forward(self, image, text, text_lens):
        batch, tokens, _ = image.shape
        q = self.to_q(image).reshape(1, batch * tokens, HEADS, -1).transpose(1, 2)
        k, v = self.to_kv(text).reshape(1, -1, 2, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        if FIXED:
            owner = torch.repeat_interleave(torch.arange(batch), torch.tensor(text_lens))
            allowed = torch.arange(batch).repeat_interleave(tokens)[:, None] == owner[None, :]
        else:
            allowed = torch.ones(batch * tokens, sum(text_lens), dtype=torch.bool)  # the padding is gone already
        scores = q @ k.transpose(-1, -2) * (WIDTH // HEADS) ** -0.5
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(batch, tokens, WIDTH)
        return self.to_out(out)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.cross = TextCrossAttention()

    def forward(self, image, text, text_lens):
        return image + self.cross(self.norm(image), text, text_lens)


class CaptionDiT(nn.Module):
    def __init__(self):
        super().__init__()
        self.patches = nn.Linear(8, WIDTH)
        self.caption = nn.Linear(12, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, latents, caption_embeds, text_mask):
        image = self.patches(latents)
        text = self.caption(caption_embeds)[text_mask.bool()].unsqueeze(0)  # real tokens end to end
        text_lens = text_mask.sum(dim=1).tolist()
        for block in self.blocks:
            image = block(image, text, text_lens)
        return image


if __name__ == "__main__":
    text_mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    model = CaptionDiT().eval()
    with torch.no_grad():
        out = model(torch.randn(2, 9, 8), torch.randn(2, 7, 12), text_mask)
    print("fixed" if FIXED else "buggy", tuple(out.shape))
