"""A small vision-language model: its config says the language model is causal (is_causal=True); the vision tower
inside it attends over its 6 patches both ways with no mask, as ViTs do, and the text decoder is causal (correct)."""
import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d=16, h=2, causal=False):
        super().__init__()
        self.h = h
        self.causal = causal
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).transpose(1, 2).reshape(b, t, d)


class VisionTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = SelfAttention(causal=False)

    def forward(self, patches):
        return self.attn(patches)


class TinyVLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = {"is_causal": True, "hidden_size": 16}
        self.vision = VisionTower()
        self.embed = nn.Embedding(32, 16)
        self.language = SelfAttention(causal=self.config["is_causal"])

    def forward(self, input_ids, pixel_patches):
        image = self.vision(pixel_patches).mean(1, keepdim=True)
        return self.language(torch.cat([image, self.embed(input_ids)], 1))


def main():
    torch.manual_seed(0)
    with torch.no_grad():
        out = TinyVLM().eval()(torch.randint(0, 32, (1, 5)), torch.randn(1, 6, 16))
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
