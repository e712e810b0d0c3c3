# wenet (wenet-e2e/wenet#223, commit 1a603a7): ConformerEncoderLayer's ConvolutionModule got no mask_pad,
# so padded frames of a batch leak through the depthwise conv into valid frames (only attention was masked).
import sys, math
from typing import Optional
import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def make_pad_mask(lengths, max_len=0):
    batch_size = lengths.size(0)
    max_len = max_len if max_len > 0 else lengths.max().item()
    seq_range = torch.arange(0, max_len, dtype=torch.int64)
    seq_range_expand = seq_range.unsqueeze(0).expand(batch_size, max_len)
    return seq_range_expand >= lengths.unsqueeze(-1)


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)

    def forward(self, query, key, value, mask):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
        scores = scores.masked_fill(mask, -float('inf'))
        attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        x = torch.matmul(attn, v).transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)


class ConvolutionModule(nn.Module):
    def __init__(self, channels, kernel_size=7):
        super().__init__()
        self.pointwise_conv1 = nn.Conv1d(channels, 2 * channels, 1)
        self.lorder = 0
        padding = (kernel_size - 1) // 2
        self.depthwise_conv = nn.Conv1d(channels, channels, kernel_size, padding=padding, groups=channels)
        self.norm = nn.BatchNorm1d(channels)
        self.activation = nn.SiLU()
        self.pointwise_conv2 = nn.Conv1d(channels, channels, 1)

    def forward(self, x, mask_pad: Optional[torch.Tensor] = None, cache: Optional[torch.Tensor] = None):
        # exchange the temporal dimension and the feature dimension
        x = x.transpose(1, 2)
        # mask batch padding
        if mask_pad is not None:
            x.masked_fill_(~mask_pad, 0.0)
        x = self.pointwise_conv1(x)
        x = nn.functional.glu(x, dim=1)
        x = self.depthwise_conv(x)
        x = self.activation(self.norm(x))
        x = self.pointwise_conv2(x)
        # mask batch padding
        if mask_pad is not None:
            x.masked_fill_(~mask_pad, 0.0)
        return x.transpose(1, 2), cache


class ConformerEncoderLayer(nn.Module):
    def __init__(self, size, self_attn, conv_module):
        super().__init__()
        self.self_attn = self_attn
        self.conv_module = conv_module
        self.norm_mha = nn.LayerNorm(size)
        self.norm_conv = nn.LayerNorm(size)

    def forward(self, x, mask, pos_emb, mask_pad: Optional[torch.Tensor] = None):
        residual = x
        x = self.norm_mha(x)
        x = residual + self.self_attn(x, x, x, mask)
        residual = x
        x = self.norm_conv(x)
        if FIXED:
            x, _ = self.conv_module(x, mask_pad)
        else:
            x, _ = self.conv_module(x)
        x = residual + x
        return x, mask, None


class BaseEncoder(nn.Module):
    def __init__(self, d=32, heads=4, layers=2):
        super().__init__()
        self.encoders = nn.ModuleList([
            ConformerEncoderLayer(d, MultiHeadedAttention(heads, d), ConvolutionModule(d)) for _ in range(layers)])

    def forward(self, xs, xs_lens):
        T = xs.size(1)
        masks = ~make_pad_mask(xs_lens, T).unsqueeze(1)  # (B, 1, T)
        mask_pad = masks
        chunk_masks = masks
        pos_emb = None
        for layer in self.encoders:
            if FIXED:
                xs, chunk_masks, _ = layer(xs, chunk_masks, pos_emb, mask_pad)
            else:
                xs, chunk_masks, _ = layer(xs, chunk_masks, pos_emb)
        return xs, masks


enc = BaseEncoder().eval()
lens = torch.tensor([16, 9, 5])
xs = torch.randn(3, 16, 32)
xs[1, 9:] = 3.0 * torch.randn(7, 32)   # padding frames carry non-zero features (e.g. padded fbank)
xs[2, 5:] = 3.0 * torch.randn(11, 32)
xs2 = xs.clone()
xs2[1, 9:] = torch.randn(7, 32)  # same batch, only the content of the padded frames differs
xs2[2, 5:] = torch.randn(11, 32)
with torch.no_grad():
    out, _ = enc(xs.clone(), lens)
    out2, _ = enc(xs2.clone(), lens)
    diff = 0.0
    for b in range(3):
        L = int(lens[b])
        diff = max(diff, (out[b, :L] - out2[b, :L]).abs().max().item())
print(f"max change of valid frames when only padded frames change: {diff:.6f}")
