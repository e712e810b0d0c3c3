# Citation: keras-team/keras-hub (then keras-nlp) issue #783, fixed by PR #790
#   (commit 600cbf1 "Function merge_padding_and_attention_mask does not return an output
#   with the desired shape when both padding and attention masks are given").
# Upstream: keras_nlp/layers/transformer_layer_utils.py merge_padding_and_attention_mask,
#   called by keras_nlp/layers/transformer_encoder.py TransformerEncoder.call, whose mask
#   goes to keras.layers.MultiHeadAttention (_compute_attention / _masked_softmax / Softmax).
#   Ported to torch here (Keras layout and 1 = attend convention kept).
# Bug: when both `padding_mask` (B, T) and a custom `attention_mask` (B, T, T) are given,
#   the padding mask already made (B, 1, T) gets a second `tf.newaxis`, so
#   tf.minimum((B, 1, 1, T), (B, T, T)) broadcasts to (B, B, T, T). It is added to the
#   (B, num_heads, T, S) scores; when batch_size == num_heads it broadcasts silently and
#   head h of every example uses example h's attention_mask.
# Fix: drop the duplicated axis: tf.minimum(mask, attention_mask) -> (B, T, T).
import sys
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def merge_padding_and_attention_mask(inputs, padding_mask, attention_mask):
    """Merge the padding mask with a customized attention mask (1 = attend)."""
    mask = padding_mask
    if hasattr(inputs, "_keras_mask"):
        if mask is None:
            mask = inputs._keras_mask
    if mask is not None:
        # Add an axis for broadcasting, the attention mask should be 2D
        # (not including the batch axis).
        mask = mask[:, None, :].to(torch.int32)
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.int32)
        if mask is None:
            return attention_mask
        else:
            if FIXED:
                return torch.minimum(mask, attention_mask)
            return torch.minimum(mask[:, None, :], attention_mask)
    return mask


def _large_compatible_negative(dtype):
    if dtype == torch.float16:
        return torch.finfo(torch.float16).min
    return -1e9


class Softmax(nn.Module):
    """keras.layers.Softmax with a mask (1 = keep)."""

    def __init__(self, axis=-1):
        super().__init__()
        self.axis = axis

    def forward(self, inputs, mask=None):
        if mask is not None:
            adder = (1.0 - mask.to(inputs.dtype)) * _large_compatible_negative(inputs.dtype)
            inputs = inputs + adder
        return F.softmax(inputs, dim=self.axis)


class EinsumDense(nn.Module):
    def __init__(self, equation, kernel_shape, bias_shape):
        super().__init__()
        self.equation = equation
        fan_in, fan_out = kernel_shape[0], math.prod(kernel_shape[1:])
        limit = math.sqrt(6.0 / (fan_in + fan_out))  # glorot_uniform
        self.kernel = nn.Parameter(torch.empty(kernel_shape).uniform_(-limit, limit))
        self.bias = nn.Parameter(torch.zeros(bias_shape))

    def forward(self, x):
        return torch.einsum(self.equation, x, self.kernel) + self.bias


class MultiHeadAttention(nn.Module):
    """keras.layers.MultiHeadAttention (attention_axes = (1,), 3D inputs)."""

    def __init__(self, num_heads, key_dim, hidden_dim, dropout=0.0):
        super().__init__()
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._query_dense = EinsumDense("abc,cde->abde", (hidden_dim, num_heads, key_dim), (num_heads, key_dim))
        self._key_dense = EinsumDense("abc,cde->abde", (hidden_dim, num_heads, key_dim), (num_heads, key_dim))
        self._value_dense = EinsumDense("abc,cde->abde", (hidden_dim, num_heads, key_dim), (num_heads, key_dim))
        self._output_dense = EinsumDense("abcd,cde->abe", (num_heads, key_dim, hidden_dim), (hidden_dim,))
        self._softmax = Softmax(axis=-1)
        self._dropout_layer = nn.Dropout(dropout)
        self._attention_axes = (1,)

    def _masked_softmax(self, attention_scores, attention_mask=None):
        # Normalize the attention scores to probabilities.
        # `attention_scores` = [B, N, T, S]
        if attention_mask is not None:
            # The expand dim happens starting from the `num_heads` dimension,
            # (<batch_dims>, num_heads, <query_attention_dims, key_attention_dims>)
            mask_expansion_axis = -len(self._attention_axes) * 2 - 1
            for _ in range(attention_scores.dim() - attention_mask.dim()):
                attention_mask = attention_mask.unsqueeze(mask_expansion_axis)
        return self._softmax(attention_scores, attention_mask)

    def _compute_attention(self, query, key, value, attention_mask=None):
        query = query * (1.0 / math.sqrt(float(self._key_dim)))
        attention_scores = torch.einsum("aecd,abcd->acbe", key, query)
        attention_scores = self._masked_softmax(attention_scores, attention_mask)
        attention_scores_dropout = self._dropout_layer(attention_scores)
        attention_output = torch.einsum("acbe,aecd->abcd", attention_scores_dropout, value)
        return attention_output, attention_scores

    def forward(self, query, value, key=None, attention_mask=None):
        if key is None:
            key = value
        query = self._query_dense(query)
        key = self._key_dense(key)
        value = self._value_dense(value)
        attention_output, _ = self._compute_attention(query, key, value, attention_mask)
        return self._output_dense(attention_output)


class TransformerEncoder(nn.Module):
    def __init__(self, intermediate_dim, num_heads, hidden_dim, dropout=0.0,
                 layer_norm_epsilon=1e-05, normalize_first=False):
        super().__init__()
        self.num_heads = num_heads
        self.normalize_first = normalize_first
        key_dim = int(hidden_dim // num_heads)
        self._self_attention_layer = MultiHeadAttention(num_heads, key_dim, hidden_dim, dropout)
        self._self_attention_layernorm = nn.LayerNorm(hidden_dim, eps=layer_norm_epsilon)
        self._self_attention_dropout = nn.Dropout(dropout)
        self._feedforward_layernorm = nn.LayerNorm(hidden_dim, eps=layer_norm_epsilon)
        self._feedforward_intermediate_dense = nn.Linear(hidden_dim, intermediate_dim)
        self._feedforward_output_dense = nn.Linear(intermediate_dim, hidden_dim)
        self._feedforward_dropout = nn.Dropout(dropout)

    def forward(self, inputs, padding_mask=None, attention_mask=None):
        x = inputs
        # Compute self attention mask.
        self_attention_mask = merge_padding_and_attention_mask(inputs, padding_mask, attention_mask)

        # Self attention block.
        residual = x
        if self.normalize_first:
            x = self._self_attention_layernorm(x)
        x = self._self_attention_layer(query=x, value=x, attention_mask=self_attention_mask)
        x = self._self_attention_dropout(x)
        x = x + residual
        if not self.normalize_first:
            x = self._self_attention_layernorm(x)

        # Feedforward block.
        residual = x
        if self.normalize_first:
            x = self._feedforward_layernorm(x)
        x = F.relu(self._feedforward_intermediate_dense(x))
        x = self._feedforward_output_dense(x)
        x = self._feedforward_dropout(x)
        x = x + residual
        if not self.normalize_first:
            x = self._feedforward_layernorm(x)
        return x


class PackedTagger(nn.Module):
    """Token tagger over rows that pack several short documents; each document
    attends only within itself (custom attention_mask) and padding is masked."""

    def __init__(self, vocab_size=50, hidden_dim=16, num_heads=2, num_layers=2, num_tags=5, max_len=16):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, hidden_dim)
        self.position_embedding = nn.Embedding(max_len, hidden_dim)
        self.encoders = nn.ModuleList(
            [TransformerEncoder(intermediate_dim=32, num_heads=num_heads, hidden_dim=hidden_dim) for _ in range(num_layers)]
        )
        self.head = nn.Linear(hidden_dim, num_tags)

    def forward(self, token_ids, padding_mask, segment_ids):
        T = token_ids.shape[1]
        x = self.token_embedding(token_ids) + self.position_embedding(torch.arange(T))[None]
        # (B, T, T): 1 where query and key are in the same packed document.
        attention_mask = (segment_ids[:, :, None] == segment_ids[:, None, :]).to(torch.int32)
        for enc in self.encoders:
            x = enc(x, padding_mask=padding_mask, attention_mask=attention_mask)
        return self.head(x)


def main():
    model = PackedTagger().eval()
    # batch_size 2 == num_heads 2; two packed documents per row, right padding.
    token_ids = torch.tensor([
        [5, 9, 12, 7, 3, 22, 17, 8, 0, 0],
        [14, 6, 31, 2, 11, 40, 19, 0, 0, 0],
    ])
    padding_mask = (token_ids != 0).to(torch.int32)
    segment_ids = torch.tensor([
        [1, 1, 1, 2, 2, 2, 2, 2, 0, 0],
        [1, 1, 1, 1, 1, 1, 2, 0, 0, 0],
    ])
    tags = torch.tensor([
        [0, 1, 2, 3, 4, 0, 1, 2, -100, -100],
        [4, 3, 2, 1, 0, 4, 3, -100, -100, -100],
    ])
    with torch.no_grad():
        logits = model(token_ids, padding_mask, segment_ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tags.reshape(-1), ignore_index=-100)
    print("fixed" if FIXED else "buggy")
    print("logits[0, :3, 0]:", [round(v, 4) for v in logits[0, :3, 0].tolist()])
    print("logits[1, :3, 0]:", [round(v, 4) for v in logits[1, :3, 0].tolist()])
    print("tagging loss: %.6f" % loss.item())


if __name__ == "__main__":
    main()
