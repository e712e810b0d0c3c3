# The wenet#223 / pytorch/audio#4205 bug written another way (NeMo's ConformerLayer style): the layer's SDPA
# self-attention hides the padded frames (a bool keep mask (B, 1, 1, T) made of `pad_mask`, True = padding), but the
# ConformerConvolution's depthwise conv (padding="same", dilation 2) is called without `pad_mask`, so frames made at
# padded positions (attention's and the feed-forward's output there) reach the last real frames of shorter rows.
# The fix hands `pad_mask` on and zeroes the padded frames before the depthwise conv.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(2)


class ConformerConvolution(nn.Module):
    def __init__(self, d_model, kernel_size=5):
        super().__init__()
        self.pointwise_conv1 = nn.Conv1d(d_model, 2 * d_model, kernel_size=1)
        self.depthwise_conv = nn.Conv1d(d_model, d_model, kernel_size, padding="same", dilation=2, groups=d_model)
        self.batch_norm = nn.BatchNorm1d(d_model)
        self.pointwise_conv2 = nn.Conv1d(d_model, d_model, kernel_size=1)

    def forward(self, x, pad_mask=None):
        x = F.glu(self.pointwise_conv1(x.transpose(1, 2)), dim=1)
        if pad_mask is not None:
            x = x.masked_fill(pad_mask.unsqueeze(1), 0.0)
        x = F.silu(self.batch_norm(self.depthwise_conv(x)))
        return self.pointwise_conv2(x).transpose(1, 2)


class ConformerLayer(nn.Module):
    def __init__(self, d_model=16, n_heads=2):
        super().__init__()
        self.n_heads = n_heads
        self.norm_ff = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 32), nn.SiLU(), nn.Linear(32, d_model))
        self.norm_att = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.norm_conv = nn.LayerNorm(d_model)
        self.conv = ConformerConvolution(d_model)

    def forward(self, x, att_mask, pad_mask):
        x = x + 0.5 * self.ff(self.norm_ff(x))
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm_att(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=att_mask).transpose(1, 2).reshape(b, t, d)
        x = x + self.conv(self.norm_conv(x), pad_mask=pad_mask if FIXED else None)
        return x


class ConformerEncoder(nn.Module):
    def __init__(self, n_layers=2):
        super().__init__()
        self.layers = nn.ModuleList(ConformerLayer() for _ in range(n_layers))

    def forward(self, audio_signal, length):
        pad_mask = torch.arange(audio_signal.shape[1])[None, :] >= length[:, None]
        att_mask = ~pad_mask[:, None, None, :]
        for layer in self.layers:
            audio_signal = layer(audio_signal, att_mask, pad_mask)
        return audio_signal, length


encoder = ConformerEncoder().eval()
length = torch.tensor([7, 12, 10, 12])
signal = torch.zeros(4, 12, 16)
for i, n in enumerate(length.tolist()):
    signal[i, :n] = torch.randn(n, 16)
with torch.no_grad():
    out, _ = encoder(signal, length)
    alone, _ = encoder(signal[:1, :7], length[:1])
print(f"row 0, batched vs alone: {(out[0, :7] - alone[0]).abs().max().item():.6f}")
