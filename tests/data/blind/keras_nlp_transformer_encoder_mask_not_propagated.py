"""KerasNLP TransformerEncoder: the implicit Keras padding mask stopped after the first encoder block.

Citation: keras-team/keras-hub (then keras-nlp) issue #137 ("TransformerEncoder/TransformerDecoder do not
propagate keras masks"), fixed by PR #139 ("Fix mask propagation of transformer layers", merged: add
``self.supports_masking = True``). I read both threads, not the diff.

Bug: ``TransformerEncoder.call`` builds its self-attention mask with ``merge_padding_and_attention_mask``,
which reads the implicit mask ``inputs._keras_mask`` set by ``Embedding(mask_zero=True)``. The layer did not
declare ``supports_masking``, so Keras did not attach the mask to its output: the first encoder block masked
the padding, every later block attended to it ("we end up just pooling every output position including
padding").

Fix (#139): ``self.supports_masking = True`` in ``__init__``, so the output keeps ``_keras_mask`` and the next
block masks the padding too.

Reproduction: Keras' implicit-mask plumbing rendered in torch (a ``Layer.__call__`` that copies
``_keras_mask`` from input to output only when ``supports_masking``, as Keras' default ``compute_mask`` does),
``Embedding(mask_zero=True)``, two stacked ``TransformerEncoder`` blocks whose attention runs
``F.scaled_dot_product_attention``; a batch of two right-padded sequences (id 0 = padding).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Layer(nn.Module):
    """The part of keras.layers.Layer.__call__ that carries the implicit mask."""

    supports_masking = False

    def __call__(self, inputs, *args, **kwargs):
        outputs = super().__call__(inputs, *args, **kwargs)
        previous_mask = getattr(inputs, "_keras_mask", None)
        output_mask = self.compute_mask(inputs, previous_mask)
        if output_mask is not None:
            outputs._keras_mask = output_mask
        return outputs

    def compute_mask(self, inputs, mask=None):
        if not self.supports_masking:
            return None
        return mask


class Embedding(Layer):
    def __init__(self, input_dim, output_dim, mask_zero=False):
        super().__init__()
        self.embeddings = nn.Embedding(input_dim, output_dim)
        self.mask_zero = mask_zero

    def forward(self, inputs):
        return self.embeddings(inputs)

    def __call__(self, inputs):
        outputs = nn.Module.__call__(self, inputs)
        if self.mask_zero:
            outputs._keras_mask = inputs != 0
        return outputs


def merge_padding_and_attention_mask(inputs, padding_mask, attention_mask):
    mask = padding_mask
    if hasattr(inputs, "_keras_mask"):
        if mask is None:
            # Keras masking is used when no explicit padding mask is given.
            mask = inputs._keras_mask
    if mask is not None:
        mask = mask[:, None, :]  # (batch, 1, seq)
    if attention_mask is not None:
        return attention_mask if mask is None else (mask & attention_mask)
    return mask


class TransformerEncoder(Layer):
    def __init__(self, intermediate_dim, num_heads, hidden_dim=16):
        super().__init__()
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.qkv = nn.Linear(hidden_dim, 3 * hidden_dim)
        self.out = nn.Linear(hidden_dim, hidden_dim)
        self.norm1 = nn.LayerNorm(hidden_dim)
        self.ffn = nn.Sequential(nn.Linear(hidden_dim, intermediate_dim), nn.ReLU(),
                                 nn.Linear(intermediate_dim, hidden_dim))
        self.norm2 = nn.LayerNorm(hidden_dim)
        if FIXED:
            self.supports_masking = True

    def forward(self, inputs, padding_mask=None, attention_mask=None):
        x = inputs
        self_attention_mask = merge_padding_and_attention_mask(inputs, padding_mask, attention_mask)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if self_attention_mask is None else self_attention_mask[:, None])
        x = self.norm1(x + self.out(attn.transpose(1, 2).reshape(b, t, d)))
        return self.norm2(x + self.ffn(x))


def main():
    torch.manual_seed(0)
    token_ids = torch.tensor([[12, 34, 7, 5, 0, 0],
                              [9, 3, 0, 0, 0, 0]])
    embedding = Embedding(input_dim=100, output_dim=16, mask_zero=True)
    encoders = [TransformerEncoder(intermediate_dim=32, num_heads=2) for _ in range(2)]
    with torch.no_grad():
        x = embedding(token_ids)
        for encoder in encoders:
            encoder.eval()
            x = encoder(x)
    print("x[:, 0, :3]:", [[round(v, 4) for v in row[0, :3].tolist()] for row in x])


if __name__ == "__main__":
    main()
