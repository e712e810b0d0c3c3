"""KerasNLP TokenAndPositionEmbedding(mask_zero=True) made no implicit mask, so the encoder attended to padding.

Citation: keras-team/keras-hub (then keras-nlp) PR #140 ("Fix masking for TokenAndPositionEmbedding", commit
6e933cd), fixing keras-team/keras-hub#138 ("TokenAndPositionEmbedding does not propagate keras masks").
keras_nlp/layers/token_and_position_embedding.py, transformer_encoder.py and transformer_layer_utils.py read at
6e933cd^ and 6e933cd.

Bug: ``TokenAndPositionEmbedding`` wraps ``keras.layers.Embedding(mask_zero=True)``; the inner embedding's output
carries ``_keras_mask``, but ``call`` returns ``embedded_tokens + embedded_positions`` (a new tensor) and the layer
neither declared ``supports_masking`` nor overrode ``compute_mask``, so Keras attached no mask to its output.
``TransformerEncoder`` looks for ``inputs._keras_mask`` in ``merge_padding_and_attention_mask`` when no
``padding_mask`` is passed; it found none and the self-attention ran over the pad ids.

Fix (#140): ``self.supports_masking = self.token_embedding.supports_masking`` and
``compute_mask(inputs, mask) -> self.token_embedding.compute_mask(inputs, mask=mask)``.

Reproduction: Keras' implicit-mask plumbing (``Layer.__call__`` asks ``compute_mask`` and sets ``_keras_mask``
on the output; the base ``compute_mask`` returns None unless ``supports_masking``) in torch; a text classifier
as the keras-nlp examples build it: ``TokenAndPositionEmbedding(mask_zero=True)`` -> ``TransformerEncoder`` ->
``GlobalAveragePooling1D`` -> ``Dense(1)``, over a right-padded batch (id 0 = padding).
"""
import inspect
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


# --- the part of keras.layers.Layer that carries the implicit (`_keras_mask`) mask --------------------------------
class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.supports_masking = False

    def forward(self, *args, **kwargs):
        return self.call(*args, **kwargs)

    def __call__(self, inputs, *args, **kwargs):
        previous_mask = getattr(inputs, "_keras_mask", None)
        if previous_mask is not None and "mask" in inspect.signature(self.call).parameters:
            kwargs.setdefault("mask", previous_mask)
        outputs = super().__call__(inputs, *args, **kwargs)
        output_mask = self.compute_mask(inputs, previous_mask)
        if output_mask is not None:
            outputs._keras_mask = output_mask
        return outputs

    def compute_mask(self, inputs, mask=None):
        if not self.supports_masking:
            return None
        return mask


def glorot_uniform(*shape, fan_in, fan_out):
    limit = (6.0 / (fan_in + fan_out)) ** 0.5
    return nn.Parameter(torch.empty(*shape).uniform_(-limit, limit))


class Embedding(Layer):
    def __init__(self, input_dim, output_dim, mask_zero=False):
        super().__init__()
        self.mask_zero = mask_zero
        self.supports_masking = mask_zero
        self.embeddings = nn.Parameter(torch.empty(input_dim, output_dim).uniform_(-0.05, 0.05))

    def call(self, inputs):
        return self.embeddings[inputs]

    def compute_mask(self, inputs, mask=None):
        if not self.mask_zero:
            return None
        return inputs != 0


class Dense(Layer):
    def __init__(self, in_dim, units, activation=None):
        super().__init__()
        self.kernel = glorot_uniform(in_dim, units, fan_in=in_dim, fan_out=units)
        self.bias = nn.Parameter(torch.zeros(units))
        self.activation = activation

    def call(self, inputs):
        x = inputs @ self.kernel + self.bias
        return self.activation(x) if self.activation is not None else x


class LayerNormalization(Layer):
    def __init__(self, dim, epsilon=1e-3):
        super().__init__()
        self.supports_masking = True
        self.norm = nn.LayerNorm(dim, eps=epsilon)

    def call(self, inputs):
        return self.norm(inputs)


class EinsumDense(Layer):
    def __init__(self, equation, kernel_shape, bias_shape, fan_in, fan_out):
        super().__init__()
        self.equation = equation
        self.kernel = glorot_uniform(*kernel_shape, fan_in=fan_in, fan_out=fan_out)
        self.bias = nn.Parameter(torch.zeros(*bias_shape))

    def call(self, inputs):
        return torch.einsum(self.equation, inputs, self.kernel) + self.bias


class Softmax(Layer):
    """keras.layers.Softmax(axis=-1) with a mask: adds (1 - mask) * -1e9 before the softmax."""

    def __init__(self, axis=-1):
        super().__init__()
        self.supports_masking = True
        self.axis = axis

    def call(self, inputs, mask=None):
        if mask is not None:
            adder = (1.0 - mask.to(inputs.dtype)) * -1e9
            inputs = inputs + adder
        return torch.softmax(inputs, dim=self.axis)


class MultiHeadAttention(Layer):
    """keras.layers.MultiHeadAttention (TF 2.8), no dropout at inference."""

    def __init__(self, num_heads, key_dim, value_dim, feature_size):
        super().__init__()
        self._num_heads = num_heads
        self._key_dim = key_dim
        h, d, f = num_heads, key_dim, feature_size
        self._query_dense = EinsumDense("abc,cde->abde", (f, h, d), (h, d), f, h * d)
        self._key_dense = EinsumDense("abc,cde->abde", (f, h, d), (h, d), f, h * d)
        self._value_dense = EinsumDense("abc,cde->abde", (f, h, value_dim), (h, value_dim), f, h * value_dim)
        self._output_dense = EinsumDense("abcd,cde->abe", (h, value_dim, f), (f,), h * value_dim, f)
        self._softmax = Softmax(axis=-1)
        self._dot_product_equation = "aecd,abcd->acbe"
        self._combine_equation = "acbe,aecd->abcd"

    def _masked_softmax(self, attention_scores, attention_mask=None):
        # Normalize the attention scores to probabilities.
        # `attention_scores` = [B, N, T, S]
        if attention_mask is not None:
            # The expand dim happens starting from the `num_heads` dimension,
            # (<batch_dims>, num_heads, <query_attention_dims, key_attention_dims>)
            mask_expansion_axis = -3
            for _ in range(len(attention_scores.shape) - len(attention_mask.shape)):
                attention_mask = attention_mask.unsqueeze(mask_expansion_axis)
        return self._softmax(attention_scores, mask=attention_mask)

    def _compute_attention(self, query, key, value, attention_mask=None):
        query = query * (1.0 / float(self._key_dim) ** 0.5)
        attention_scores = torch.einsum(self._dot_product_equation, key, query)
        attention_scores = self._masked_softmax(attention_scores, attention_mask)
        attention_output = torch.einsum(self._combine_equation, attention_scores, value)
        return attention_output, attention_scores

    def call(self, query, value, key=None, attention_mask=None):
        if key is None:
            key = value
        query = self._query_dense(query)
        key = self._key_dense(key)
        value = self._value_dense(value)
        attention_output, attention_scores = self._compute_attention(query, key, value, attention_mask)
        return self._output_dense(attention_output)


# --- keras_nlp/layers ---------------------------------------------------------------------------------------------
class PositionEmbedding(Layer):
    def __init__(self, max_length, feature_size):
        super().__init__()
        self.max_length = max_length
        self.position_embeddings = glorot_uniform(max_length, feature_size, fan_in=max_length, fan_out=feature_size)

    def call(self, inputs):
        return self._trim_and_broadcast_position_embeddings(inputs.shape)

    def _trim_and_broadcast_position_embeddings(self, shape):
        sequence_length = shape[-2]
        # trim to match the length of the sequence
        position_embeddings = self.position_embeddings[:sequence_length, :]
        # then broadcast to add the missing dimensions to match "shape"
        return position_embeddings.expand(shape)


class TokenAndPositionEmbedding(Layer):
    def __init__(self, vocabulary_size, max_length, embedding_dim, mask_zero=False):
        super().__init__()
        self.vocabulary_size = int(vocabulary_size)
        self.max_length = int(max_length)
        self.embedding_dim = int(embedding_dim)
        self.token_embedding = Embedding(vocabulary_size, embedding_dim, mask_zero=mask_zero)
        self.position_embedding = PositionEmbedding(max_length=max_length, feature_size=embedding_dim)
        if FIXED:
            self.supports_masking = self.token_embedding.supports_masking

    def call(self, inputs):
        embedded_tokens = self.token_embedding(inputs)
        embedded_positions = self.position_embedding(embedded_tokens)
        outputs = embedded_tokens + embedded_positions
        return outputs

    def compute_mask(self, inputs, mask=None):
        if FIXED:
            return self.token_embedding.compute_mask(inputs, mask=mask)
        return super().compute_mask(inputs, mask=mask)


def merge_padding_and_attention_mask(inputs, padding_mask, attention_mask):
    mask = padding_mask
    if hasattr(inputs, "_keras_mask"):
        if mask is None:
            # If no padding mask is explicitly provided, we look for padding
            # mask from the input data.
            mask = inputs._keras_mask
        else:
            print("You are explicitly setting `padding_mask` while the `inputs` "
                  "have built-in mask, so the built-in mask is ignored.")
    if mask is not None:
        # Add an axis for broadcasting, the attention mask should be 2D
        # (not including the batch axis).
        mask = mask[:, None, :].to(torch.int32)
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.int32)
        if mask is None:
            return attention_mask
        else:
            return torch.minimum(mask[:, None, :], attention_mask)
    return mask


class TransformerEncoder(Layer):
    def __init__(self, intermediate_dim, num_heads, feature_size, layer_norm_epsilon=1e-05):
        super().__init__()
        self.intermediate_dim = intermediate_dim
        self.num_heads = num_heads
        self.layer_norm_epsilon = layer_norm_epsilon
        self.supports_masking = True
        self._attention_head_size = int(feature_size // self.num_heads)
        self._multi_head_attention_layer = MultiHeadAttention(
            num_heads=self.num_heads,
            key_dim=self._attention_head_size,
            value_dim=self._attention_head_size,
            feature_size=feature_size,
        )
        self._attention_layernorm = LayerNormalization(feature_size, epsilon=self.layer_norm_epsilon)
        self._feedforward_layernorm = LayerNormalization(feature_size, epsilon=self.layer_norm_epsilon)
        self._intermediate_dense = Dense(feature_size, self.intermediate_dim, activation=torch.relu)
        self._output_dense = Dense(self.intermediate_dim, feature_size)

    def _add_and_norm(self, input1, input2, norm_layer):
        return norm_layer(input1 + input2)

    def _feed_forward(self, input):
        x = self._intermediate_dense(input)
        x = self._output_dense(x)
        return x

    def call(self, inputs, padding_mask=None, attention_mask=None):
        mask = merge_padding_and_attention_mask(inputs, padding_mask, attention_mask)

        # Self attention.
        attended = self._multi_head_attention_layer(inputs, inputs, inputs, attention_mask=mask)
        attended = self._add_and_norm(inputs, attended, self._attention_layernorm)
        # Feedforward.
        feed_forward_output = self._feed_forward(attended)
        return self._add_and_norm(attended, feed_forward_output, self._feedforward_layernorm)


class GlobalAveragePooling1D(Layer):
    def __init__(self):
        super().__init__()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        if mask is not None:
            mask = mask.to(inputs.dtype).unsqueeze(2)
            return (inputs * mask).sum(1) / mask.sum(1)
        return inputs.mean(1)

    def compute_mask(self, inputs, mask=None):
        return None


# --- the model: keras-nlp's text-classification example layout ----------------------------------------------------
VOCAB_SIZE = 50
SEQ_LEN = 8
EMBED_DIM = 16
NUM_HEADS = 2
INTERMEDIATE_DIM = 32


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = TokenAndPositionEmbedding(
            vocabulary_size=VOCAB_SIZE, max_length=SEQ_LEN, embedding_dim=EMBED_DIM, mask_zero=True
        )
        self.encoder = TransformerEncoder(
            intermediate_dim=INTERMEDIATE_DIM, num_heads=NUM_HEADS, feature_size=EMBED_DIM
        )
        self.pool = GlobalAveragePooling1D()
        self.head = Dense(EMBED_DIM, 1)

    def forward(self, token_ids):
        x = self.embedding(token_ids)
        x = self.encoder(x)
        pooled = self.pool(x)
        return self.head(pooled), x


def main():
    model = Classifier().eval()
    # Right padded with 0, as the keras-nlp tokenizers' `sequence_length` padding does.
    token_ids = torch.tensor(
        [
            [12, 7, 33, 4, 19, 25, 8, 41],
            [5, 27, 16, 3, 0, 0, 0, 0],
            [44, 9, 0, 0, 0, 0, 0, 0],
        ]
    )
    with torch.no_grad():
        logits, encoded = model(token_ids)
    lengths = (token_ids != 0).sum(1)
    for b in range(token_ids.shape[0]):
        real = encoded[b, : lengths[b]]
        print(f"row {b}: logit {logits[b, 0].item():+.6f}  first real token[:4] {real[0, :4].tolist()}")


if __name__ == "__main__":
    main()
