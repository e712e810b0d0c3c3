# The bug of sd-scripts 2b07a92c (Flux's int T5 mask joined with float ones, so a float 0/1 mask is added to the
# logits) written another way: an MM-DiT block that puts the image tokens first, a left-padded prompt (a decoder LM's
# tokenizer pads on the left) whose int attention_mask is joined after float ones for the image, and eager attention
# that adds the joint mask to the scores itself. The fix turns it into an additive mask (0 kept, finfo.min hidden).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class JointBlock(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.img_qkv = nn.Linear(dim, 3 * dim)
        self.txt_qkv = nn.Linear(dim, 3 * dim)
        self.img_out = nn.Linear(dim, dim)
        self.txt_out = nn.Linear(dim, dim)

    def split(self, qkv):
        b, n, _ = qkv.shape
        return qkv.view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)

    def forward(self, img, txt, txt_mask):
        iq, ik, iv = self.split(self.img_qkv(img))
        tq, tk, tv = self.split(self.txt_qkv(txt))
        q, k, v = torch.cat([iq, tq], 2), torch.cat([ik, tk], 2), torch.cat([iv, tv], 2)
        joint = torch.cat([torch.ones(img.shape[0], img.shape[1], dtype=q.dtype), txt_mask.to(q.dtype)], dim=1)
        if FIXED:
            joint = (1.0 - joint) * torch.finfo(q.dtype).min
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / q.shape[-1] ** 0.5
        scores = scores + joint[:, None, None, :]
        out = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)
        out = out.transpose(1, 2).reshape(img.shape[0], -1, q.shape[1] * q.shape[-1])
        n = img.shape[1]
        return img + self.img_out(out[:, :n]), txt + self.txt_out(out[:, n:])


class MMDiT(nn.Module):
    def __init__(self, dim=32, depth=2):
        super().__init__()
        self.img_in = nn.Linear(8, dim)
        self.txt_in = nn.Linear(16, dim)
        self.blocks = nn.ModuleList([JointBlock(dim) for _ in range(depth)])
        self.img_outp = nn.Linear(dim, 8)

    def forward(self, latents, prompt_embeds, attention_mask):
        img, txt = self.img_in(latents), self.txt_in(prompt_embeds)
        for block in self.blocks:
            img, txt = block(img, txt, attention_mask)
        return self.img_outp(img)


model = MMDiT().eval()
B, T, N = 3, 8, 9
lengths = torch.tensor([8, 5, 2])
attention_mask = (torch.arange(T)[None, :] >= T - lengths[:, None]).long()  # left-padded, 1 = a real token
with torch.no_grad():
    out = model(torch.randn(B, N, 8), torch.randn(B, T, 16), attention_mask)
print("prediction", tuple(out.shape), f"{out.abs().mean().item():.4f}")
