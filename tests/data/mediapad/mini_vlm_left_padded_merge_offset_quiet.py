# A correct program of the shape media-padding-shifted reads, which it must stay quiet on: the small LLaVA-style model
# of mini_vlm_right_padded_image_slots_taken_from_row_end_eager.py over a LEFT-padded batch (rows of two and one
# <image>), its merge shifting each row right by the slots its expansion leaves over and writing the image features
# into the free slots after that offset; the padded queries see no key (a finite fill: uniform weights, a note).
from dataclasses import dataclass

import torch
from torch import nn

torch.manual_seed(0)


@dataclass
class MiniVLMConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_heads: int = 4
    patches_per_image: int = 4
    image_token_id: int = 63
    pad_token_id: int = 0


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.o = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        allowed = causal[None, None] & keep[:, None, None, :].bool()
        bias = torch.zeros(b, 1, n, n).masked_fill(~allowed, torch.finfo(x.dtype).min)
        w = (q @ k.transpose(-1, -2) / (d // self.h) ** 0.5 + bias).softmax(-1)
        return x + self.o((w @ v).transpose(1, 2).reshape(b, n, d))


class MiniVLM(nn.Module):
    def __init__(self, cfg: MiniVLMConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.vision = nn.Linear(3 * 8 * 8, cfg.hidden_size)
        self.blocks = nn.ModuleList([Block(cfg), Block(cfg)])
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size)

    def merge(self, input_ids, attention_mask, image_embeds):
        cfg = self.config
        b, length = input_ids.shape
        is_image = input_ids == cfg.image_token_id
        step = torch.where(is_image, cfg.patches_per_image, 1)
        total = length + int(is_image.sum(1).max()) * (cfg.patches_per_image - 1)
        offset = total - step.sum(-1, keepdim=True)  # left padding: each row ends at the last slot
        text_at = step.cumsum(-1) - step + offset  # where each id's first embedding goes
        merged = torch.zeros(b, total, cfg.hidden_size)
        keep = torch.zeros(b, total, dtype=torch.long)
        free = torch.ones(b, total, dtype=torch.bool)
        rows, cols = torch.nonzero(~is_image, as_tuple=True)
        merged[rows, text_at[rows, cols]] = self.embed(input_ids[rows, cols])
        keep[rows, text_at[rows, cols]] = attention_mask[rows, cols]
        free[rows, text_at[rows, cols]] = False
        image_slots = free & (torch.arange(total)[None, :] >= offset)
        merged[image_slots] = image_embeds.reshape(-1, cfg.hidden_size)
        keep = keep | image_slots.long()
        return merged, keep

    def forward(self, input_ids, attention_mask, pixel_values):
        patches = pixel_values.unfold(2, 8, 8).unfold(3, 8, 8).permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)
        x, keep = self.merge(input_ids, attention_mask, self.vision(patches))
        for block in self.blocks:
            x = block(x, keep)
        return self.lm_head(x)


cfg = MiniVLMConfig()
model = MiniVLM(cfg).eval()
I, P = cfg.image_token_id, cfg.pad_token_id
input_ids = torch.tensor([
    [I, 5, 6, 7, 8, I, 9, 10],   # two images
    [P, P, P, P, I, 11, 12, 13],  # one image, left padded
])
attention_mask = (input_ids != P).long()
pixel_values = torch.randn(3, 3, 16, 16)  # three images of 2 x 2 patches
with torch.no_grad():
    logits = model(input_ids, attention_mask, pixel_values)
print("next", logits[:, -1].argmax(-1).tolist())
