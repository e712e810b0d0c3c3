"""A joint (text + image) MM-DiT block written another way: three prompts of 7, 3 and 5 tokens padded to 8, the text
first in the joint sequence, an explicit softmax. The buggy model trims the text of the whole batch to its shortest
prompt (to skip padding) and attends unmasked, so the first and third prompts lose their last tokens; `--fixed` keeps
the padded text and masks each row's padding with -inf."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

WIDTH, HEADS = 16, 2


class JointAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.img_qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.txt_qkv = nn.Linear(WIDTH, 3 * WIDTH)

    def forward(self, image, text, key_keep=None):
        b = image.shape[0]
        joint = torch.cat([self.txt_qkv(text), self.img_qkv(image)], dim=1)
        q, k, v = joint.view(b, joint.shape[1], 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (WIDTH // HEADS) ** 0.5
        if key_keep is not None:
            scores = scores.masked_fill(~key_keep[:, None, None, :], float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, joint.shape[1], WIDTH)
        return out[:, text.shape[1]:], out[:, :text.shape[1]]


class DoubleStreamBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = JointAttention()

    def forward(self, image, text, key_keep=None):
        img, txt = self.attn(image, text, key_keep)
        return image + img, text + txt


class MMDiT(nn.Module):
    def __init__(self):
        super().__init__()
        self.img_in = nn.Linear(4, WIDTH)
        self.txt_in = nn.Linear(10, WIDTH)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock() for _ in range(2))

    def forward(self, img, txt, encoder_attention_mask):
        image, text = self.img_in(img), self.txt_in(txt)
        key_keep = None
        if FIXED:
            image_keep = torch.ones(image.shape[:2], dtype=torch.bool)
            key_keep = torch.cat([encoder_attention_mask.bool(), image_keep], dim=1)
        else:
            shortest = int(encoder_attention_mask.sum(dim=-1).min())
            text = text[:, :shortest]  # every prompt's padding dropped at once
        for block in self.double_blocks:
            image, text = block(image, text, key_keep)
        return image


if __name__ == "__main__":
    lengths = [7, 3, 5]
    mask = torch.zeros(3, 8, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    with torch.no_grad():
        out = MMDiT().eval()(torch.randn(3, 6, 4), torch.randn(3, 8, 10), mask)
    print("fixed" if FIXED else "buggy", tuple(out.shape))
