# A BART-style decoder layer, forward(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask),
# whose cross-attention is called without the encoder's padding mask (the bug; --fixed passes it). The sources are
# right-padded (lengths 5 and 3) and each target has as many tokens as its source is long (5): the layer's own causal
# `attention_mask` is as wide as the cross-attention's scores too, but is its self-attention's.
import math
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Attention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.size = heads, dim // heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))

    def split(self, x):
        return x.view(x.shape[0], -1, self.heads, self.size).transpose(1, 2)

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        source = hidden_states if key_value_states is None else key_value_states
        q, k, v = self.split(self.q(hidden_states)), self.split(self.k(source)), self.split(self.v(source))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.size)
        if attention_mask is not None:
            scores = scores + attention_mask
        out = torch.softmax(scores, dim=-1) @ v
        return self.o(out.transpose(1, 2).reshape(hidden_states.shape))


class DecoderLayer(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.self_attn, self.encoder_attn = Attention(dim, heads), Attention(dim, heads)

    def forward(self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask):
        hidden_states = hidden_states + self.self_attn(hidden_states, attention_mask=attention_mask)
        crossed = self.encoder_attn(hidden_states, encoder_hidden_states,
                                    attention_mask=encoder_attention_mask if FIXED else None)
        return hidden_states + crossed


dim, heads, length = 16, 2, 5
lengths = torch.tensor([5, 3])
layer = DecoderLayer(dim, heads)
low = torch.finfo(torch.float32).min
causal = torch.full((length, length), low).triu(1)[None, None].expand(2, 1, length, length)
real = (torch.arange(length)[None, :] < lengths[:, None]).float()
encoder_mask = (1.0 - real[:, None, None, :].expand(2, 1, length, length)) * low
with torch.no_grad():
    out = layer(torch.randn(2, length, dim), causal, torch.randn(2, length, dim), encoder_mask)
print(f"decoded {tuple(out.shape)}")
