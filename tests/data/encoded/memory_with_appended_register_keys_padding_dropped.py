"""A captioner whose text encoder (nn.TransformerEncoder, its src_key_padding_mask from the prompts' lengths) hands
its memory to a cross-attention that appends two learned register keys after it; the cross-attention's mask is built
from the memory's embeddings (a zero-vector test) which the encoder never zeroes at its padding, so every query sees
the padded prompt tokens (--fixed: the lengths' mask, widened with the registers' two keys). Checked: the fix's
output for the short prompt matches it run alone."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class RegisterCrossAttention(nn.Module):
    def __init__(self, d=16, registers=2):
        super().__init__()
        self.registers = nn.Parameter(torch.randn(registers, d))
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, 2 * d)

    def forward(self, x, memory, keep):
        b = x.shape[0]
        memory = torch.cat([memory, self.registers.expand(b, -1, -1)], dim=1)
        keep = F.pad(keep, (0, self.registers.shape[0]), value=True)  # (registers: always seen)
        k, v = self.kv(memory).chunk(2, dim=-1)
        return F.scaled_dot_product_attention(self.q(x)[:, None], k[:, None], v[:, None], attn_mask=keep[:, None, None])


class Captioner(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.embed = nn.Embedding(30, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.cross = RegisterCrossAttention(d)

    def forward(self, prompt, lengths, queries):
        pad = torch.arange(prompt.shape[1])[None, :] >= lengths[:, None]
        memory = self.encoder(self.embed(prompt), src_key_padding_mask=pad)
        keep = ~pad if FIXED else memory.abs().sum(-1) != 0  # (the bug: padded memory rows are not zero)
        return self.cross(queries, memory, keep)


torch.manual_seed(0)
model = Captioner().eval()
prompt, lengths, queries = torch.randint(1, 30, (2, 6)), torch.tensor([6, 3]), torch.randn(2, 5, 16)
with torch.no_grad():
    out = model(prompt, lengths, queries)
    alone = model(prompt[1:, :3], lengths[1:], queries[1:])
print("short prompt, query 0:", out[1, 0, 0, :4].numpy().round(3))
if FIXED:
    assert torch.allclose(out[1], alone[0], atol=1e-5)
