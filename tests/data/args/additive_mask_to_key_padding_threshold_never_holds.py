# The bug of NVIDIA/bionemo-framework 2198daf (a 0/1 attention mask turned into a kernel's boolean "masked" mask by
# a comparison that never holds, so the padding is never masked) written another way: a BERT-style sentence encoder
# keeps HF's additive extended mask, (1 - mask) * -10000, and its nn.MultiheadAttention layers (batch_first, a
# bidirectional encoder over right-padded sentences) get key_padding_mask = extended < -10000: the padded keys hold
# exactly -10000, so the mask is False everywhere. The fix compares with < 0.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class EncoderLayer(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.attention = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.norm1 = nn.LayerNorm(hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, 64), nn.GELU(), nn.Linear(64, hidden))
        self.norm2 = nn.LayerNorm(hidden)

    def forward(self, hidden_states, key_padding_mask):
        attended, _ = self.attention(hidden_states, hidden_states, hidden_states, key_padding_mask=key_padding_mask,
                                     need_weights=False)
        hidden_states = self.norm1(hidden_states + attended)
        return self.norm2(hidden_states + self.ffn(hidden_states))


class SentenceEncoder(nn.Module):
    def __init__(self, vocab=100, hidden=32, layers=2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(64, hidden)
        self.layers = nn.ModuleList([EncoderLayer(hidden) for _ in range(layers)])

    def get_extended_attention_mask(self, attention_mask):
        return (1.0 - attention_mask[:, None, None, :].float()) * -10000.0

    def forward(self, input_ids, attention_mask):
        extended = self.get_extended_attention_mask(attention_mask)
        # nn.MultiheadAttention wants (B, S) bools, True = ignore this key
        if FIXED:
            key_padding_mask = extended[:, 0, 0, :] < 0
        else:
            key_padding_mask = extended[:, 0, 0, :] < -10000.0
        positions = torch.arange(input_ids.shape[1])
        hidden_states = self.embeddings(input_ids) + self.positions(positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states, key_padding_mask)
        real = attention_mask[..., None].float()
        return (hidden_states * real).sum(1) / real.sum(1)  # mean pooling over the real tokens


model = SentenceEncoder().eval()
lengths = [9, 4, 6]
S = max(lengths)
input_ids = torch.zeros(len(lengths), S, dtype=torch.long)  # [PAD] = 0, padded on the right
attention_mask = torch.zeros(len(lengths), S, dtype=torch.long)
for i, n in enumerate(lengths):
    input_ids[i, :n] = torch.randint(1, 100, (n,))
    attention_mask[i, :n] = 1
with torch.no_grad():
    batched = model(input_ids, attention_mask)
    alone = torch.cat([model(input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n]) for i, n in enumerate(lengths)])
print(f"max |padded batch - one by one| of the sentence embeddings: {(batched - alone).abs().max().item():.3e}")
