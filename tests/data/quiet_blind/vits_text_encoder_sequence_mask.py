# Follows jaywalnut310/vits attentions.py (Encoder.forward, MultiHeadAttention.attention) and commons.sequence_mask:
# x_mask = sequence_mask(x_lengths) [b,1,t]; attn_mask = x_mask.unsqueeze(2) * x_mask.unsqueeze(-1) (0 = masked, filled -1e4);
# padded frames compute garbage rows that are zeroed by "* x_mask" before every conv, so a padded batch equals each text alone.
import math
import torch
from torch import nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def sequence_mask(length, max_length=None):
    if max_length is None:
        max_length = length.max()
    x = torch.arange(max_length, dtype=length.dtype, device=length.device)
    return x.unsqueeze(0) < length.unsqueeze(1)


class LayerNorm(nn.Module):  # channels-first layer norm as in vits modules.LayerNorm
    def __init__(self, c):
        super().__init__()
        self.ln = nn.LayerNorm(c)

    def forward(self, x):
        return self.ln(x.transpose(1, -1)).transpose(1, -1)


class MultiHeadAttention(nn.Module):
    def __init__(self, channels, n_heads):
        super().__init__()
        self.n_heads, self.k_channels = n_heads, channels // n_heads
        self.conv_q = nn.Conv1d(channels, channels, 1)
        self.conv_k = nn.Conv1d(channels, channels, 1)
        self.conv_v = nn.Conv1d(channels, channels, 1)
        self.conv_o = nn.Conv1d(channels, channels, 1)

    def forward(self, x, c, attn_mask=None):
        q, k, v = self.conv_q(x), self.conv_k(c), self.conv_v(c)
        b, d, t_s, t_t = (*k.size(), q.size(2))
        query = q.view(b, self.n_heads, self.k_channels, t_t).transpose(2, 3)
        key = k.view(b, self.n_heads, self.k_channels, t_s).transpose(2, 3)
        value = v.view(b, self.n_heads, self.k_channels, t_s).transpose(2, 3)
        scores = torch.matmul(query / math.sqrt(self.k_channels), key.transpose(-2, -1))
        if attn_mask is not None:
            scores = scores.masked_fill(attn_mask == 0, -1e4)
        p_attn = torch.softmax(scores, dim=-1)
        output = torch.matmul(p_attn, value).transpose(2, 3).contiguous().view(b, d, t_t)
        return self.conv_o(output)


class FFN(nn.Module):
    def __init__(self, c, h, k=3):
        super().__init__()
        self.conv_1 = nn.Conv1d(c, h, k, padding=k // 2)
        self.conv_2 = nn.Conv1d(h, c, k, padding=k // 2)

    def forward(self, x, x_mask):
        x = torch.relu(self.conv_1(x * x_mask))
        return self.conv_2(x * x_mask) * x_mask


class Encoder(nn.Module):
    def __init__(self, c=32, heads=4, layers=2):
        super().__init__()
        self.attn = nn.ModuleList([MultiHeadAttention(c, heads) for _ in range(layers)])
        self.n1 = nn.ModuleList([LayerNorm(c) for _ in range(layers)])
        self.ffn = nn.ModuleList([FFN(c, 48) for _ in range(layers)])
        self.n2 = nn.ModuleList([LayerNorm(c) for _ in range(layers)])

    def forward(self, x, x_mask):
        attn_mask = x_mask.unsqueeze(2) * x_mask.unsqueeze(-1)
        x = x * x_mask
        for a, n1, f, n2 in zip(self.attn, self.n1, self.ffn, self.n2):
            x = n1(x + a(x, x, attn_mask))
            x = n2(x + f(x, x_mask))
        return x * x_mask


enc = Encoder().eval()
emb = nn.Embedding(40, 32)
x_lengths = torch.tensor([11, 4, 7, 1])
T = int(x_lengths.max())
tokens = torch.randint(1, 40, (4, T))
x_mask = sequence_mask(x_lengths, T).unsqueeze(1).to(torch.get_default_dtype())  # [b,1,t]
x = emb(tokens).transpose(1, 2) * math.sqrt(32)
with torch.no_grad():
    out = enc(x, x_mask)
    diff = 0.0
    for b in range(4):
        L = int(x_lengths[b])
        alone = enc(x[b:b + 1, :, :L], torch.ones(1, 1, L))
        diff = max(diff, (out[b:b + 1, :, :L] - alone).abs().max().item())
        assert out[b, :, L:].abs().max().item() == 0.0 if L < T else True
print("max |padded batch - each text alone| =", diff)
assert diff < 1e-10
