# Written another way (padding-convolved, beside F5-TTS a051a68): a flow-matching decoder's input block runs a
# depthwise Conv1d over the ODE state of a right-padded batch (the padded frames are the noise the sampler starts from),
# then doubles the batch for classifier-free guidance (conditional rows, then the same rows with the condition
# dropped) and masks the padding with an additive float mask (0 / -inf) in scaled_dot_product_attention. The model
# call states the padding as a 0/1 integer `x_mask`; the convolution is never given it. The fix multiplies the state
# by the mask before the convolution.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(1)


class Decoder(nn.Module):
    def __init__(self, channels=8, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(2 * channels, dim)
        self.conv = nn.Conv1d(dim, dim, kernel_size=5, padding=4, dilation=2, groups=dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, channels)

    def embed(self, state, cond, x_mask):
        h = self.proj(torch.cat([state, cond], dim=-1))
        if FIXED:
            h = h * x_mask[..., None].to(h.dtype)
        return h + F.silu(self.conv(h.transpose(1, 2))).transpose(1, 2)

    def forward(self, state, cond, x_mask, guidance=1.5):
        # (B, T, D) each: conditional rows, then the same rows unconditional (2B rows attend)
        h = torch.cat([self.embed(state, cond, x_mask), self.embed(state, torch.zeros_like(cond), x_mask)])
        b, t, d = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        bias = torch.zeros(x_mask.shape, dtype=h.dtype).masked_fill(x_mask == 0, float("-inf"))
        bias = torch.cat([bias, bias])[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, t, d)
        pred, null = self.out(o).chunk(2)
        return null + guidance * (pred - null)


decoder = Decoder().eval()
lengths = torch.tensor([9, 14, 12, 6])
x_mask = (torch.arange(14)[None] < lengths[:, None]).long()
cond = torch.randn(4, 14, 8) * x_mask[..., None]
noise = torch.randn(4, 14, 8)  # the sampler's noise, padded frames too


def sample(state, cond, x_mask):
    for _ in range(3):
        state = state + decoder(state, cond, x_mask) / 3
    return state


with torch.no_grad():
    state = sample(noise, cond, x_mask)
    worst = max((sample(noise[b:b + 1, :n], cond[b:b + 1, :n], x_mask[b:b + 1, :n])[0] - state[b, :n]).abs().max().item()
                for b, n in enumerate(lengths.tolist()))
print(f"fixed={FIXED} largest difference of a row from the row run alone: {worst:.2e}")
