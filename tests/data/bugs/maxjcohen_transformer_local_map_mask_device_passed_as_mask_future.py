# maxjcohen/transformer ("Transformers for Time Series", tst package), maxjcohen/transformer commit 60df0da:
# MultiHeadAttention called generate_local_map_mask(K, attention_size, self._scores.device), so the device landed
# in the `mask_future` slot (truthy) and the symmetric local window silently became a causal window.
import sys
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def generate_original_PE(length: int, d_model: int) -> torch.Tensor:
    PE = torch.zeros((length, d_model))
    pos = torch.arange(length).unsqueeze(1)
    PE[:, 0::2] = torch.sin(pos / torch.pow(1000, torch.arange(0, d_model, 2, dtype=torch.float32) / d_model))
    PE[:, 1::2] = torch.cos(pos / torch.pow(1000, torch.arange(1, d_model, 2, dtype=torch.float32) / d_model))
    return PE


def generate_local_map_mask(chunk_size: int, attention_size: int, mask_future=False,
                            device: torch.device = 'cpu') -> torch.BoolTensor:
    """Compute attention mask as attention_size wide diagonal."""
    local_map = np.empty((chunk_size, chunk_size))
    i, j = np.indices(local_map.shape)
    if mask_future:
        local_map[i, j] = (i - j > attention_size) ^ (j - i > 0)
    else:
        local_map[i, j] = np.abs(i - j) > attention_size
    return torch.BoolTensor(local_map).to(device)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, q: int, v: int, h: int, attention_size: int = None):
        super().__init__()
        self._h = h
        self._attention_size = attention_size
        self._W_q = nn.Linear(d_model, q * self._h)
        self._W_k = nn.Linear(d_model, q * self._h)
        self._W_v = nn.Linear(d_model, v * self._h)
        self._W_o = nn.Linear(self._h * v, d_model)
        self._scores = None

    def forward(self, query, key, value, mask: Optional[str] = None) -> torch.Tensor:
        K = query.shape[1]
        queries = torch.cat(self._W_q(query).chunk(self._h, dim=-1), dim=0)
        keys = torch.cat(self._W_k(key).chunk(self._h, dim=-1), dim=0)
        values = torch.cat(self._W_v(value).chunk(self._h, dim=-1), dim=0)

        # Scaled Dot Product
        self._scores = torch.bmm(queries, keys.transpose(1, 2)) / np.sqrt(K)

        # Compute local map mask
        if self._attention_size is not None:
            if FIXED:
                attention_mask = generate_local_map_mask(K, self._attention_size, mask_future=False,
                                                         device=self._scores.device)
            else:
                attention_mask = generate_local_map_mask(K, self._attention_size, self._scores.device)
            self._scores = self._scores.masked_fill(attention_mask, float('-inf'))

        # Compute future mask
        if mask == "subsequent":
            future_mask = torch.triu(torch.ones((K, K)), diagonal=1).bool()
            future_mask = future_mask.to(self._scores.device)
            self._scores = self._scores.masked_fill(future_mask, float('-inf'))

        # Apply sotfmax
        self._scores = F.softmax(self._scores, dim=-1)
        attention = torch.bmm(self._scores, values)
        attention_heads = torch.cat(attention.chunk(self._h, dim=0), dim=-1)
        return self._W_o(attention_heads)

    @property
    def attention_map(self) -> torch.Tensor:
        return self._scores


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: Optional[int] = 2048):
        super().__init__()
        self._linear1 = nn.Linear(d_model, d_ff)
        self._linear2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self._linear2(F.relu(self._linear1(x)))


class Encoder(nn.Module):
    def __init__(self, d_model, q, v, h, attention_size=None, dropout=0.3, chunk_mode='chunk'):
        super().__init__()
        MHA = MultiHeadAttention  # chunk_mode=None
        self._selfAttention = MHA(d_model, q, v, h, attention_size=attention_size)
        self._feedForward = PositionwiseFeedForward(d_model)
        self._layerNorm1 = nn.LayerNorm(d_model)
        self._layerNorm2 = nn.LayerNorm(d_model)
        self._dopout = nn.Dropout(p=dropout)

    def forward(self, x):
        residual = x
        x = self._selfAttention(query=x, key=x, value=x)
        x = self._dopout(x)
        x = self._layerNorm1(x + residual)
        residual = x
        x = self._feedForward(x)
        x = self._dopout(x)
        x = self._layerNorm2(x + residual)
        return x

    @property
    def attention_map(self):
        return self._selfAttention.attention_map


class Decoder(nn.Module):
    def __init__(self, d_model, q, v, h, attention_size=None, dropout=0.3, chunk_mode='chunk'):
        super().__init__()
        MHA = MultiHeadAttention  # chunk_mode=None
        self._selfAttention = MHA(d_model, q, v, h, attention_size=attention_size)
        self._encoderDecoderAttention = MHA(d_model, q, v, h, attention_size=attention_size)
        self._feedForward = PositionwiseFeedForward(d_model)
        self._layerNorm1 = nn.LayerNorm(d_model)
        self._layerNorm2 = nn.LayerNorm(d_model)
        self._layerNorm3 = nn.LayerNorm(d_model)
        self._dopout = nn.Dropout(p=dropout)

    def forward(self, x, memory):
        residual = x
        x = self._selfAttention(query=x, key=x, value=x, mask="subsequent")
        x = self._dopout(x)
        x = self._layerNorm1(x + residual)
        residual = x
        x = self._selfAttention(query=x, key=memory, value=memory)
        x = self._dopout(x)
        x = self._layerNorm2(x + residual)
        residual = x
        x = self._feedForward(x)
        x = self._dopout(x)
        x = self._layerNorm3(x + residual)
        return x


class Transformer(nn.Module):
    def __init__(self, d_input, d_model, d_output, q, v, h, N, attention_size=None, dropout=0.3,
                 chunk_mode=True, pe=None):
        super().__init__()
        self._d_model = d_model
        self.layers_encoding = nn.ModuleList([Encoder(d_model, q, v, h, attention_size=attention_size,
                                                      dropout=dropout, chunk_mode=chunk_mode) for _ in range(N)])
        self.layers_decoding = nn.ModuleList([Decoder(d_model, q, v, h, attention_size=attention_size,
                                                      dropout=dropout, chunk_mode=chunk_mode) for _ in range(N)])
        self._embedding = nn.Linear(d_input, d_model)
        self._linear = nn.Linear(d_model, d_output)
        self._generate_PE = generate_original_PE if pe == 'original' else None

    def forward(self, x):
        K = x.shape[1]
        encoding = self._embedding(x)
        if self._generate_PE is not None:
            encoding.add_(self._generate_PE(K, self._d_model).to(encoding.device))
        for layer in self.layers_encoding:
            encoding = layer(encoding)
        decoding = encoding
        if self._generate_PE is not None:
            decoding.add_(self._generate_PE(K, self._d_model).to(decoding.device))
        for layer in self.layers_decoding:
            decoding = layer(decoding, encoding)
        output = self._linear(decoding)
        return torch.sigmoid(output)


K, attention_size = 16, 3
net = Transformer(d_input=5, d_model=32, d_output=2, q=8, v=8, h=4, N=2, attention_size=attention_size,
                  dropout=0.0, chunk_mode=None, pe='original')
x = torch.randn(2, K, 5)

# one training step as in the project's training loop (MSE on the sigmoid output)
opt = torch.optim.Adam(net.parameters(), lr=2e-4)
loss = F.mse_loss(net(x), torch.rand(2, K, 2))
opt.zero_grad()
loss.backward()
opt.step()

net.eval()
with torch.no_grad():
    net(x)
    A = net.layers_encoding[0].attention_map            # (batch*h, K, K)
    i, j = torch.meshgrid(torch.arange(K), torch.arange(K), indexing="ij")
    future_in_window = ((j > i) & (j - i <= attention_size)).float()
    mass = (A * future_in_window).sum(-1)[:, : K - 1].mean().item()
print(f"encoder attention mass on the {attention_size} following steps inside the local window: {mass:.4f}")
