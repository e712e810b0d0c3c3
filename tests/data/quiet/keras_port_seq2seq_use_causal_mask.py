"""A correct torch port of a Keras seq2seq Transformer: MultiHeadAttention takes `use_causal_mask` per call, and the
padding masks are Keras's (True on the tokens).

Written for maskcli's tests (trace/forwardflag.py, checks/real.py must stay quiet), as keras.io's English-to-Spanish
translation example writes it: the encoder's self-attention is called with `use_causal_mask=False` and the source's
padding mask; the decoder's self-attention with `use_causal_mask=True` and the target's padding mask (the layer ANDs
its causal triangle with it); the cross-attention with the source's padding mask only. Both batches right-padded.
"""
import math
import sys

import torch
from torch import nn

_ = "--fixed" in sys.argv  # (a correct program: the same run either way)


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, key_dim, hidden=16):
        super().__init__()
        self.num_heads, self.key_dim = num_heads, key_dim
        self.query_dense = nn.Linear(hidden, num_heads * key_dim)
        self.key_dense = nn.Linear(hidden, num_heads * key_dim)
        self.value_dense = nn.Linear(hidden, num_heads * key_dim)
        self.output_dense = nn.Linear(num_heads * key_dim, hidden)

    def forward(self, query, value, key=None, attention_mask=None, use_causal_mask=False):
        key = value if key is None else key
        b, n, m = query.shape[0], query.shape[1], value.shape[1]
        mask = None if attention_mask is None else attention_mask.bool()  # (b, n, m), True = attend
        if use_causal_mask:
            causal = torch.ones(n, m, dtype=torch.bool).tril()[None]
            mask = causal if mask is None else mask & causal
        q = self.query_dense(query).view(b, n, self.num_heads, self.key_dim)
        k = self.key_dense(key).view(b, m, self.num_heads, self.key_dim)
        v = self.value_dense(value).view(b, m, self.num_heads, self.key_dim)
        scores = torch.einsum("aecd,abcd->acbe", k, q) / math.sqrt(self.key_dim)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None], -1e9)
        weights = torch.softmax(scores, dim=-1)
        return self.output_dense(torch.einsum("acbe,aecd->abcd", weights, v).reshape(b, n, -1))


class TransformerEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = MultiHeadAttention(2, 8)

    def forward(self, inputs, padding_mask):
        mask = padding_mask[:, None, :].expand(-1, inputs.shape[1], -1)
        return inputs + self.attention(inputs, inputs, attention_mask=mask, use_causal_mask=False)


class TransformerDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_1 = MultiHeadAttention(2, 8)
        self.attention_2 = MultiHeadAttention(2, 8)

    def forward(self, inputs, encoder_outputs, padding_mask, encoder_padding_mask):
        self_mask = padding_mask[:, None, :].expand(-1, inputs.shape[1], -1)
        x = inputs + self.attention_1(inputs, inputs, attention_mask=self_mask, use_causal_mask=True)
        cross_mask = encoder_padding_mask[:, None, :].expand(-1, inputs.shape[1], -1)
        return x + self.attention_2(x, encoder_outputs, attention_mask=cross_mask)


class Translator(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.encoder = TransformerEncoder()
        self.decoder = TransformerDecoder()

    def forward(self, encoder_inputs, decoder_inputs):
        source_mask, target_mask = encoder_inputs != 0, decoder_inputs != 0  # Keras's compute_mask: True = a token
        memory = self.encoder(self.embed(encoder_inputs), source_mask)
        return self.decoder(self.embed(decoder_inputs), memory, target_mask, source_mask)


def main():
    torch.manual_seed(0)
    model = Translator().eval()
    source = torch.tensor([[5, 6, 7, 8, 9, 3], [4, 5, 6, 0, 0, 0]])
    target = torch.tensor([[1, 7, 8, 9, 2, 0, 0], [1, 4, 5, 6, 7, 8, 2]])
    with torch.no_grad():
        y = model(source, target)
    print("y[0, 0, :3]:", [round(v, 4) for v in y[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
