"""A BERT-style encoder converted from a checkpoint with a massive activation (one hidden channel tens of times the
others on its special tokens, as "Massive Activations in LLMs" describes them; here the pad token's): its q and k
projections carry it, so its attention scores lie thousands apart. The batch of
two sentences is left-padded and the key padding mask is made the BERT way, `(1.0 - mask) * -10000.0`, added by SDPA:
beside scores that large, -1e4 masks nothing and the real tokens attend the pads. The fix fills
`torch.finfo(dtype).min`. Written after NVIDIA/TensorRT-Model-Connect#695 (GPT-NeoX's kMaskedScore = -1e4) in another
style: an encoder's padding mask rather than a decoder's causal one, two rows, padded on the left."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D, HEADS, VOCAB, PAD = 32, 4, 40, 0
OUTLIER = 7  # the hidden channel the checkpoint's activations blow up in


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.key, self.value, self.dense = (nn.Linear(D, D) for _ in range(4))
        self.norm = nn.LayerNorm(D)
        with torch.no_grad():  # (the converted weights: q and k both read the outlier channel strongly)
            self.query.weight[:, OUTLIER] = 30.0
            self.key.weight[:, OUTLIER] = 30.0

    def forward(self, hidden, extended_mask):
        b, n, _ = hidden.shape
        split = lambda x: x.view(b, n, HEADS, D // HEADS).transpose(1, 2)
        ctx = F.scaled_dot_product_attention(split(self.query(hidden)), split(self.key(hidden)),
                                             split(self.value(hidden)), attn_mask=extended_mask)
        return self.norm(hidden + self.dense(ctx.transpose(1, 2).reshape(b, n, D)))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Layer() for _ in range(2)])

    def forward(self, input_ids, attention_mask):
        hidden = self.embed(input_ids)
        hidden[..., OUTLIER] = torch.where(input_ids == PAD, 60.0, 2.0)  # (the massive activation: the pad token's)
        extended = attention_mask[:, None, None, :].to(hidden.dtype)
        fill = torch.finfo(hidden.dtype).min if FIXED else -10000.0
        extended = (1.0 - extended) * fill
        for layer in self.layers:
            hidden = layer(hidden, extended)
        return hidden


lengths = (5, 8)
ids = torch.full((2, 8), PAD)
mask = torch.zeros(2, 8, dtype=torch.long)
for row, n in enumerate(lengths):
    ids[row, 8 - n:] = torch.randint(1, VOCAB, (n,))
    mask[row, 8 - n:] = 1
with torch.no_grad():
    out = Encoder().eval()(ids, mask)
print(out.shape)
