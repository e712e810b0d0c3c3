"""The joint-attention padding bug of diffusers#10033 (Mochi) written another way: an SD3-style MM-DiT whose joint
sequence puts the text first, three prompts of an LLM text encoder left-padded to 8 tokens (5, 8 and 3 real), and an
explicit softmax. Each block is handed the prompt's `encoder_attention_mask` but never builds the joint mask from it,
so every image token attends to the prompt padding; `--fixed` builds [prompt mask, ones] and fills the padded keys
with -inf per row."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

WIDTH, HEADS = 24, 3


def joint_attention(q, k, v, keep=None):
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / (q.shape[-1] ** 0.5)
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(dim=-1), v)


class JointBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_x = nn.LayerNorm(WIDTH)
        self.norm_c = nn.LayerNorm(WIDTH)
        self.qkv_x = nn.Linear(WIDTH, 3 * WIDTH)
        self.qkv_c = nn.Linear(WIDTH, 3 * WIDTH)
        self.out_x = nn.Linear(WIDTH, WIDTH)
        self.out_c = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, context, encoder_attention_mask):
        b, n, _ = x.shape
        t = context.shape[1]
        joint = torch.cat([self.qkv_c(self.norm_c(context)), self.qkv_x(self.norm_x(x))], dim=1)
        q, k, v = joint.reshape(b, t + n, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        keep = None
        if FIXED:  # [text, image]: the prompt's padding hidden, every image token kept
            keep = torch.cat([encoder_attention_mask.bool(), torch.ones(b, n, dtype=torch.bool)], dim=1)
        out = joint_attention(q, k, v, keep).transpose(1, 2).reshape(b, t + n, WIDTH)
        return x + self.out_x(out[:, t:]), context + self.out_c(out[:, :t])


class TinyMMDiT(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.patch = nn.Linear(4, WIDTH)
        self.text_proj = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList([JointBlock() for _ in range(depth)])
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, latents, encoder_hidden_states, encoder_attention_mask):
        x, context = self.patch(latents), self.text_proj(encoder_hidden_states)
        for block in self.blocks:
            x, context = block(x, context, encoder_attention_mask)
        return self.head(x)


model = TinyMMDiT().eval()
lengths = [5, 8, 3]
B, N, T = len(lengths), 9, 8
latents = torch.randn(B, N, 4)
prompts = torch.randn(B, T, 16)
prompt_mask = torch.zeros(B, T, dtype=torch.long)
for i, n in enumerate(lengths):
    prompt_mask[i, T - n:] = 1  # the text encoder pads on the left
with torch.no_grad():
    out = model(latents, prompts, prompt_mask)
    alone = [model(latents[i:i + 1], prompts[i:i + 1, T - n:], torch.ones(1, n, dtype=torch.long))
             for i, n in enumerate(lengths)]
print("max |batched - one prompt alone| =", max((out[i] - a[0]).abs().max().item() for i, a in enumerate(alone)))
