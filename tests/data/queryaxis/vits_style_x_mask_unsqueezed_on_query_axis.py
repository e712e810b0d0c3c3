# The query-axis padding bug of NeMo MagpieTTS (NVIDIA-NeMo/Speech#14836), written as VITS / Glow-TTS write their text
# encoder: channels-first (B, C, T) hidden states, a (B, 1, T) `x_mask` handed down from the lengths, a MultiHeadAttention
# module that takes `x_mask` and fills the scores with -1e4, and a left-padded batch. The bug builds the attention mask
# from the query side alone (x_mask.unsqueeze(-1): (B, 1, T, 1)), so real tokens attend the padded frames; the fix
# (VITS's own) is the outer product x_mask.unsqueeze(2) * x_mask.unsqueeze(-1).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MultiHeadAttention(nn.Module):
    def __init__(self, channels, n_heads):
        super().__init__()
        self.n_heads, self.k_channels = n_heads, channels // n_heads
        self.conv_q = nn.Conv1d(channels, channels, 1)
        self.conv_k = nn.Conv1d(channels, channels, 1)
        self.conv_v = nn.Conv1d(channels, channels, 1)
        self.conv_o = nn.Conv1d(channels, channels, 1)

    def forward(self, x, x_mask):
        attn_mask = x_mask.unsqueeze(2) * x_mask.unsqueeze(-1) if FIXED else x_mask.unsqueeze(-1)
        b, d, t = x.shape
        q = self.conv_q(x).view(b, self.n_heads, self.k_channels, t).transpose(2, 3)
        k = self.conv_k(x).view(b, self.n_heads, self.k_channels, t).transpose(2, 3)
        v = self.conv_v(x).view(b, self.n_heads, self.k_channels, t).transpose(2, 3)
        scores = torch.matmul(q / self.k_channels ** 0.5, k.transpose(-2, -1))
        scores = scores.masked_fill(attn_mask == 0, -1e4)
        p_attn = torch.softmax(scores, dim=-1)
        output = torch.matmul(p_attn, v).transpose(2, 3).contiguous().view(b, d, t)
        return self.conv_o(output)


class Encoder(nn.Module):
    def __init__(self, channels=16, n_heads=2, n_layers=2):
        super().__init__()
        self.attn_layers = nn.ModuleList(MultiHeadAttention(channels, n_heads) for _ in range(n_layers))
        self.norms = nn.ModuleList(nn.GroupNorm(1, channels) for _ in range(n_layers))

    def forward(self, x, x_mask):
        x = x * x_mask
        for attn, norm in zip(self.attn_layers, self.norms):
            x = norm(x + attn(x, x_mask))
        return x * x_mask


lengths = torch.tensor([5, 9])
T = 9
x_mask = (torch.arange(T)[None, :] >= T - lengths[:, None]).unsqueeze(1).float()  # (B, 1, T), left-padded, 1 = real
encoder = Encoder().eval()
with torch.no_grad():
    x = torch.randn(2, 16, T)
    batched = encoder(x, x_mask)
    alone = encoder(x[:1, :, T - 5:], x_mask[:1, :, T - 5:])
print(f"short row: max |batched - alone| = {(batched[0, :, T - 5:] - alone[0]).abs().max().item():.6f}")
