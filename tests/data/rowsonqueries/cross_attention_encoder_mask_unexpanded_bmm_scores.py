# Written another way than keras-team/keras#21595 (keras.layers.Attention's [B, Tv] value mask turned into a bias
# without expand_dims(axis=-2)): a single-head copy/pointer attention of a seq2seq decoder over its encoder's states,
# 3-D bmm scores (B, Tq, S), whose (B, S) `encoder_attention_mask` (1 = real source token, right-padded sources) is
# filled in as it is: it broadcasts as (1, B, S) = (Tq, S) where B == Tq, so decoder step q of every sentence is masked
# with sentence q's source padding. The fix lays it on the keys: encoder_attention_mask[:, None, :].
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class PointerAttention(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query = torch.nn.Linear(dim, dim, bias=False)
        self.key = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, decoder_states, encoder_states, encoder_attention_mask):
        scores = torch.bmm(self.query(decoder_states), self.key(encoder_states).transpose(1, 2))  # (B, Tq, S)
        hidden = encoder_attention_mask == 0  # (B, S)
        if FIXED:
            hidden = hidden[:, None, :]  # (B, 1, S): each sentence's own source padding, for every decoder step
        scores = scores.masked_fill(hidden, float("-inf"))
        copy = scores.softmax(dim=-1)  # (B, Tq, S): where each decoder step points in its source
        return torch.bmm(copy, encoder_states), copy


B, TQ, S, D = 3, 3, 7, 16
source_lengths = [7, 4, 5]
encoder_attention_mask = torch.zeros(B, S, dtype=torch.long)
for row, n in enumerate(source_lengths):
    encoder_attention_mask[row, :n] = 1
attention = PointerAttention(D)
encoder_states, decoder_states = torch.randn(B, S, D), torch.randn(B, TQ, D)
with torch.no_grad():
    context, copy = attention(decoder_states, encoder_states, encoder_attention_mask)
on_pads = (copy * (encoder_attention_mask[:, None, :] == 0)).sum(-1).max().item()
print(f"context {tuple(context.shape)}, largest copy weight on a source pad: {on_pads:.6f}")
