"""Classifier-free guidance over a text-conditioned decoder, the way MusicGen's generate builds its unconditional rows
(transformers' _prepare_text_encoder_kwargs_for_generation: the batch doubled with `torch.zeros_like(last_hidden_state)`
and `torch.zeros_like(attention_mask)`). The null rows' cross-attention sees no key; its eager softmax fills masked
scores with the dtype's lowest value, so those rows spread uniform weights over every key.

Written wrong (default): the null rows get the zero mask but keep the text's states, so the uniform weights read the
real condition into the unconditional branch (guidance compares the condition with itself). `--fixed`: the states are
zeroed as MusicGen zeroes them; under bias-free projections the null rows' keys and values are 0 and their output is 0.
"""

import sys

import torch
import torch.nn as nn

torch.manual_seed(0)
FIXED = "--fixed" in sys.argv
D, H, S, T = 16, 2, 5, 4


class CrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)

    def forward(self, x, memory, memory_mask):
        b = x.shape[0]
        q = self.q_proj(x).view(b, -1, H, D // H).transpose(1, 2)
        k = self.k_proj(memory).view(b, -1, H, D // H).transpose(1, 2)
        v = self.v_proj(memory).view(b, -1, H, D // H).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5
        bias = (1.0 - memory_mask[:, None, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
        weights = torch.softmax(scores + bias, dim=-1)
        return (weights @ v).transpose(1, 2).reshape(b, -1, D)


attn = CrossAttention().eval()
text = torch.randn(2, S, D)
text_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
text = text * text_mask[..., None]
null_states = torch.zeros_like(text) if FIXED else text
states = torch.cat([text, null_states])
mask = torch.cat([text_mask, torch.zeros_like(text_mask)])
x = torch.randn(4, T, D)
with torch.no_grad():
    out = attn(x, states, mask)
print(f"unconditional rows' output max |.|: {out[2:].abs().max().item():.3e}")
