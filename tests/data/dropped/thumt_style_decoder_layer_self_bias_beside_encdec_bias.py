"""A THUMT-style (tensor2tensor naming) decoder layer handed both of its biases: the causal self-attention bias and the source's
encoder-decoder bias (quiet).

`DecoderLayer.forward(x, attn_bias, encdec_bias, memory)` hands the first to its
self-attention and the second to its attention over the encoder's memory. The source here is as long as the target and
unpadded, so the cross-attention masks nothing, while the causal bias beside it in the layer's frame is (T, T) too:
that bias is the self-attention's, not one the cross-attention dropped. Self-check: each target position's output
matches the layer run over the target's prefix up to it.
"""
import torch
from torch import nn

torch.manual_seed(0)
D, H, T = 16, 2, 5


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)

    def forward(self, x, bias, memory=None):
        source = x if memory is None else memory
        b, t, _ = x.shape
        q = self.q(x).view(b, t, H, -1).transpose(1, 2)
        k, v = self.kv(source).view(b, source.shape[1], 2, H, -1).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-1, -2) / (D // H) ** 0.5 + bias, dim=-1)
        return self.o((weights @ v).transpose(1, 2).reshape(b, t, D))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attention, self.encdec_attention = Attention(), Attention()

    def forward(self, x, attn_bias, encdec_bias, memory):
        x = x + self.self_attention(x, attn_bias)
        return x + self.encdec_attention(x, encdec_bias, memory)


layer = DecoderLayer().eval()
memory, target = torch.randn(1, T, D), torch.randn(1, T, D)
causal = torch.full((T, T), -1e9).triu(1)[None, None]
source_bias = torch.zeros(1, 1, 1, T)  # (the source is unpadded)
with torch.no_grad():
    out = layer(target, causal, source_bias, memory)
    for t in range(1, T + 1):
        prefix = layer(target[:, :t], causal[..., :t, :t], source_bias, memory)
        assert torch.allclose(out[:, t - 1], prefix[:, -1], atol=1e-5)
print("each position matches its prefix run alone")
