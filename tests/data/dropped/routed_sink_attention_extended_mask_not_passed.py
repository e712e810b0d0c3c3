# The same bug as CoLT5-attention 0f34926, written another way: a Hugging Face style routed attention over a
# left-padded batch of three, an eager softmax. The model broadcasts the tokenizer's attention_mask to a bool
# (batch, 1, 1, seq) mask (True = attend); the attention prepends a learned sink key/value and pads the mask with True
# in front for it, then calls its `_attn(query, key, value)` without the mask, so rows 1 and 2 attend to their left
# padding.
# The fix hands `attention_mask=attention_mask` to `_attn`.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class RoutedSinkAttention(nn.Module):
    def __init__(self, hidden_size=24, num_heads=3):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)
        self.sink_k = nn.Parameter(torch.randn(num_heads, 1, self.head_dim))
        self.sink_v = nn.Parameter(torch.randn(num_heads, 1, self.head_dim))

    def _split_heads(self, x):
        bsz, seq, _ = x.shape
        return x.view(bsz, seq, self.num_heads, self.head_dim).transpose(1, 2)

    def _attn(self, query, key, value, attention_mask=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2)) / self.head_dim ** 0.5
        if attention_mask is not None:
            attn_weights = attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value)

    def forward(self, hidden_states, attention_mask=None):
        bsz = hidden_states.shape[0]
        query = self._split_heads(self.q_proj(hidden_states))
        key = self._split_heads(self.k_proj(hidden_states))
        value = self._split_heads(self.v_proj(hidden_states))
        key = torch.cat([self.sink_k.expand(bsz, -1, -1, -1), key], dim=2)
        value = torch.cat([self.sink_v.expand(bsz, -1, -1, -1), value], dim=2)
        if attention_mask is not None:
            attention_mask = nn.functional.pad(attention_mask, (1, 0), value=True)  # the sink is always seen
        if FIXED:
            out = self._attn(query, key, value, attention_mask=attention_mask)
        else:
            out = self._attn(query, key, value)
        out = out.transpose(1, 2).reshape(bsz, -1, self.num_heads * self.head_dim)
        return self.o_proj(out)


class Encoder(nn.Module):
    def __init__(self, vocab=40, hidden_size=24, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden_size)
        self.layers = nn.ModuleList(RoutedSinkAttention(hidden_size) for _ in range(layers))

    def forward(self, input_ids, attention_mask):
        extended = attention_mask[:, None, None, :].bool()
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h, attention_mask=extended)
        return h


model = Encoder().eval()
lengths = [7, 3, 5]
seq = max(lengths)
attention_mask = torch.tensor([[0] * (seq - n) + [1] * n for n in lengths])  # left padding
input_ids = torch.randint(1, 40, (3, seq)) * attention_mask
with torch.no_grad():
    out = model(input_ids, attention_mask)
    alone = model(input_ids[1:2, seq - lengths[1]:], attention_mask[1:2, seq - lengths[1]:])
print("max |row 1 in the padded batch - row 1 alone| over its real tokens: %.6f"
      % (out[1, seq - lengths[1]:] - alone[0]).abs().max().item())
