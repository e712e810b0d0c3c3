# A T5X-style decoder-only LM ported to torch (flax's `decoder_segment_ids` / `decoder_positions` for packed
# examples, 0 = padding): its attention builds the causal mask only and never combines it with the segment mask,
# so each packed example attends to the ones packed before it in its row. Fixed: causal & same segment (and the
# padding segment 0 masked as a key), as flax.linen's make_attention_mask(segment_ids, segment_ids, jnp.equal).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def make_causal_mask(length):
    return torch.ones(length, length, dtype=torch.bool).tril()[None, None]


def make_segment_mask(segment_ids):
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & (segment_ids[:, None, :] > 0))[:, None]


class SelfAttention(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.dh).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / self.dh ** 0.5
        scores = scores.masked_fill(~mask, -1e10)
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class DecoderOnly(nn.Module):
    def __init__(self, vocab=50, d=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(32, d)
        self.layers = nn.ModuleList(SelfAttention(d) for _ in range(layers))
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, decoder_input_tokens, decoder_segment_ids=None, decoder_positions=None):
        x = self.embed(decoder_input_tokens) + self.pos(decoder_positions)
        mask = make_causal_mask(decoder_input_tokens.shape[1])
        if FIXED and decoder_segment_ids is not None:
            mask = mask & make_segment_mask(decoder_segment_ids)
        for layer in self.layers:
            x = x + layer(x, mask)
        return self.out(x)


model = DecoderOnly().eval()
# two packed rows of a T5X training batch: row 0 holds examples of 4, 3 and 2 tokens; row 1 one of 5, then padding
segments = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 3, 3], [1, 1, 1, 1, 1, 0, 0, 0, 0]])
positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 0, 0, 0, 0]])
tokens = torch.randint(1, 50, segments.shape) * (segments > 0)
with torch.no_grad():
    logits = model(tokens, decoder_segment_ids=segments, decoder_positions=positions)
    alone = model(tokens[:1, 4:7], decoder_segment_ids=torch.ones(1, 3, dtype=torch.long),
                  decoder_positions=torch.arange(3)[None])
print(f"fixed={FIXED} max |packed - alone| of row 0's second example: {(logits[0, 4:7] - alone[0]).abs().max():.4f}")
