"""KerasNLP LlamaCausalLM: cached generation rotated each new query at position 0.

Citation: keras-team/keras-hub (then keras-nlp) PR #1544 ("Fix the rotary embedding computation in LLaMA",
commit 9ac3335), keras_nlp/models/llama/llama_attention.py.

Bug: ``LlamaAttention.call`` kept un-rotated keys in the cache and, after the cache update, called
``self.rotary_embedding_layer(query)`` and ``self.rotary_embedding_layer(key)`` with the default
``start_index=0``. In the prefill (``_build_cache``, the whole padded prompt at index 0) that is right, but in
each generation step the single query token at ``cache_update_index`` was rotated as if it stood at position 0,
while the cache's keys were rotated at 0..max_length-1: the relative offsets every decode step sees are wrong
("LLaMA backbone ignored the start_index parameter when computing the rotary embeddings").

Fix (#1544): ``start_index = cache_update_index if cache_update_index is not None else 0``; the query and the
new key are rotated at ``start_index`` before the key is written into the cache (the cache holds rotated keys).

Reproduction: the keras-nlp Llama layers (RotaryEmbedding, LlamaAttention with its einsum equations and the
Keras masked Softmax, LlamaTransformerDecoder's ``compute_causal_mask`` at ``cache_update_index``,
LlamaCausalLM.call_with_cache / _build_cache / generate_step) and the GreedySampler loop, rendered in torch,
tiny random weights, a right-padded batch of two prompts as the LlamaCausalLMPreprocessor gives them.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


# keras_nlp/layers/modeling/transformer_layer_utils.py
def compute_causal_mask(batch_size, input_length, output_length, cache_index=0):
    i = torch.arange(output_length, dtype=torch.float32)
    i = i + float(cache_index)
    i = i[:, None]
    j = torch.arange(input_length, dtype=torch.float32)
    mask = (i >= j)[None]
    return torch.broadcast_to(mask, (batch_size, output_length, input_length))


def merge_padding_and_attention_mask(inputs, padding_mask, attention_mask):
    mask = padding_mask
    if mask is not None:
        mask = mask[:, None, :].to(torch.int32)
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.int32)
        if mask is None:
            return attention_mask
        return torch.minimum(mask, attention_mask)
    return mask


# keras.layers.Softmax(axis=-1) with a mask
class Softmax(nn.Module):
    def forward(self, inputs, mask=None):
        if mask is not None:
            adder = (1.0 - mask.to(inputs.dtype)) * -1e9
            inputs = inputs + adder
        return torch.softmax(inputs, dim=-1)


# keras_nlp/layers/modeling/rotary_embedding.py
class RotaryEmbedding(nn.Module):
    def __init__(self, max_wavelength=10000, scaling_factor=1.0, sequence_axis=1, feature_axis=-1):
        super().__init__()
        self.max_wavelength = max_wavelength
        self.sequence_axis = sequence_axis
        self.feature_axis = feature_axis
        self.scaling_factor = scaling_factor

    def forward(self, inputs, start_index=0):
        inputs = torch.moveaxis(inputs, (self.feature_axis, self.sequence_axis), (-1, 1))
        cos_emb, sin_emb = self._compute_cos_sin_embedding(inputs, start_index)
        output = self._apply_rotary_pos_emb(inputs, cos_emb, sin_emb)
        return torch.moveaxis(output, (-1, 1), (self.feature_axis, self.sequence_axis))

    def _apply_rotary_pos_emb(self, tensor, cos_emb, sin_emb):
        x1, x2 = torch.chunk(tensor, 2, dim=-1)
        half_rot_tensor = torch.stack((-x2, x1), dim=-2)
        half_rot_tensor = torch.reshape(half_rot_tensor, tensor.shape)
        return (tensor * cos_emb) + (half_rot_tensor * sin_emb)

    def _compute_cos_sin_embedding(self, inputs, start_index=0):
        start_index = float(start_index)
        feature_axis = inputs.dim() - 1
        sequence_axis = 1
        rotary_dim = inputs.shape[feature_axis]
        inverse_freq = self._get_inverse_freq(rotary_dim)
        seq_len = inputs.shape[sequence_axis]
        tensor = torch.arange(seq_len, dtype=torch.float32) + start_index
        freq = torch.einsum("i,j->ij", tensor, inverse_freq)
        embedding = torch.stack((freq, freq), dim=-2)
        embedding = torch.reshape(embedding, (*freq.shape[:-1], freq.shape[-1] * 2))
        for axis in range(inputs.dim()):
            if axis != sequence_axis and axis != feature_axis:
                embedding = embedding.unsqueeze(axis)
        return torch.cos(embedding), torch.sin(embedding)

    def _get_inverse_freq(self, rotary_dim):
        freq_range = torch.arange(0, rotary_dim, 2, dtype=torch.float32)
        freq_range = freq_range / float(self.scaling_factor)
        return 1.0 / (self.max_wavelength ** (freq_range / float(rotary_dim)))


def slice_update(inputs, start, updates):
    out = inputs.clone()
    idx = tuple(slice(s, s + n) for s, n in zip(start, updates.shape))
    out[idx] = updates
    return out


class LlamaLayerNorm(nn.Module):
    def __init__(self, dim, epsilon=1e-6):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.epsilon = epsilon

    def forward(self, x):
        var = torch.mean(torch.square(x), dim=-1, keepdim=True)
        x = x * torch.rsqrt(var + self.epsilon)
        return x * self.scale


# keras_nlp/models/llama/llama_attention.py
class LlamaAttention(nn.Module):
    def __init__(self, hidden_dim, num_query_heads, num_key_value_heads, rope_max_wavelength=10000,
                 rope_scaling_factor=1.0):
        super().__init__()
        self.num_query_heads = num_query_heads
        self.num_key_value_heads = num_key_value_heads
        self.num_key_value_groups = num_query_heads // num_key_value_heads
        head_dim = hidden_dim // num_query_heads
        self._norm_factor = torch.sqrt(torch.tensor(float(head_dim)))
        std = 0.2
        # EinsumDense kernels
        self._query_dense = nn.Parameter(torch.randn(hidden_dim, num_query_heads, head_dim) * std)
        self._key_dense = nn.Parameter(torch.randn(hidden_dim, num_key_value_heads, head_dim) * std)
        self._value_dense = nn.Parameter(torch.randn(hidden_dim, num_key_value_heads, head_dim) * std)
        self._output_dense = nn.Parameter(torch.randn(num_query_heads, head_dim, hidden_dim) * std)
        self._softmax = Softmax()
        self.rotary_embedding_layer = RotaryEmbedding(
            max_wavelength=rope_max_wavelength, scaling_factor=rope_scaling_factor
        )
        self._dot_product_equation = "bquh,bkuh->buqk"
        self._combine_equation = "buqk,bkuh->bquh"

    def forward(self, hidden_states, attention_mask=None, cache=None, cache_update_index=None):
        if FIXED:
            start_index = cache_update_index if cache_update_index is not None else 0

        query = torch.einsum("bqm,muh->bquh", hidden_states, self._query_dense)

        if FIXED:
            # Compute RoPE for queries
            query = self.rotary_embedding_layer(query, start_index=start_index)

        def _compute_key_value(x):
            key = torch.einsum("bkm,mvh->bkvh", x, self._key_dense)
            value = torch.einsum("bkm,mvh->bkvh", x, self._value_dense)
            if FIXED:
                # Compute RoPE for keys
                key = self.rotary_embedding_layer(key, start_index=start_index)
            return key, value

        if cache is not None:
            key_cache = cache[:, 0, ...]
            value_cache = cache[:, 1, ...]
            if cache_update_index is None:
                key = key_cache
                value = value_cache
            else:
                key_update, value_update = _compute_key_value(hidden_states)
                start = [0, cache_update_index, 0, 0]
                key = slice_update(key_cache, start, key_update)
                value = slice_update(value_cache, start, value_update)
                cache = torch.stack((key, value), dim=1)
        else:
            if cache_update_index is not None:
                raise ValueError("`cache_update_index` should not be set if `cache` is `None`.")
            key, value = _compute_key_value(hidden_states)

        if not FIXED:
            query = self.rotary_embedding_layer(query)
            key = self.rotary_embedding_layer(key)

        # [batch_shape, seq_len, num_key_value_heads, head_dim]
        # -> [batch_shape, seq_len, num_heads, head_dim]
        key = torch.repeat_interleave(key, repeats=self.num_key_value_groups, dim=2)
        value = torch.repeat_interleave(value, repeats=self.num_key_value_groups, dim=2)

        attention_output = self._compute_attention(query, key, value, attention_mask)
        attention_output = torch.einsum("bquh,uhm->bqm", attention_output, self._output_dense)

        if cache is not None:
            return attention_output, cache
        return attention_output

    def _masked_softmax(self, attention_scores, attention_mask=None):
        if attention_mask is not None:
            return self._softmax(attention_scores, attention_mask[:, None, :, :])
        return self._softmax(attention_scores)

    def _compute_attention(self, query, key, value, attention_mask=None):
        attention_scores = torch.einsum(self._dot_product_equation, query, key)
        attention_scores = attention_scores / self._norm_factor
        attention_scores = self._masked_softmax(attention_scores, attention_mask)
        return torch.einsum(self._combine_equation, attention_scores, value)


# keras_nlp/models/llama/llama_decoder.py
class LlamaTransformerDecoder(nn.Module):
    def __init__(self, hidden_dim, intermediate_dim, num_query_heads, num_key_value_heads,
                 layer_norm_epsilon=1e-6):
        super().__init__()
        self._self_attention_layernorm = LlamaLayerNorm(hidden_dim, layer_norm_epsilon)
        self._self_attention_layer = LlamaAttention(hidden_dim, num_query_heads, num_key_value_heads)
        self._feedforward_layernorm = LlamaLayerNorm(hidden_dim, layer_norm_epsilon)
        self._feedforward_intermediate_dense = nn.Linear(hidden_dim, intermediate_dim, bias=False)
        self._feedforward_gate_dense = nn.Linear(hidden_dim, intermediate_dim, bias=False)
        self._feedforward_output_dense = nn.Linear(intermediate_dim, hidden_dim, bias=False)

    def forward(self, decoder_sequence, decoder_padding_mask=None, decoder_attention_mask=None,
                self_attention_cache=None, self_attention_cache_update_index=None):
        self_attention_mask = self._compute_self_attention_mask(
            decoder_sequence=decoder_sequence,
            decoder_padding_mask=decoder_padding_mask,
            decoder_attention_mask=decoder_attention_mask,
            self_attention_cache=self_attention_cache,
            self_attention_cache_update_index=self_attention_cache_update_index,
        )
        residual = decoder_sequence
        x = self._self_attention_layernorm(decoder_sequence)
        x = self._self_attention_layer(
            hidden_states=x,
            attention_mask=self_attention_mask,
            cache=self_attention_cache,
            cache_update_index=self_attention_cache_update_index,
        )
        if self_attention_cache is not None:
            x, self_attention_cache = x
        x = x + residual
        residual = x
        x = self._feedforward_layernorm(x)
        gate_output = torch.nn.functional.silu(self._feedforward_gate_dense(x))
        x = self._feedforward_intermediate_dense(x)
        x = self._feedforward_output_dense(x * gate_output)
        decoder_output = x + residual
        if self_attention_cache is not None:
            return decoder_output, self_attention_cache
        return decoder_output

    def _compute_self_attention_mask(self, decoder_sequence, decoder_padding_mask, decoder_attention_mask,
                                     self_attention_cache, self_attention_cache_update_index):
        decoder_mask = merge_padding_and_attention_mask(
            decoder_sequence, decoder_padding_mask, decoder_attention_mask
        )
        batch_size = decoder_sequence.shape[0]
        input_length = output_length = decoder_sequence.shape[1]
        # We need to handle a rectangular causal mask when doing cached
        # decoding. For generative inference, `decoder_sequence` will
        # generally be length 1, and `cache` will be the full generation length.
        if self_attention_cache is not None:
            input_length = self_attention_cache.shape[2]
        cache_update_index = (
            0 if self_attention_cache_update_index is None else self_attention_cache_update_index
        )
        causal_mask = compute_causal_mask(batch_size, input_length, output_length, cache_update_index)
        return torch.minimum(decoder_mask, causal_mask.to(torch.int32)) if decoder_mask is not None else causal_mask


# keras_nlp/models/llama/llama_backbone.py
class LlamaBackbone(nn.Module):
    def __init__(self, vocabulary_size, num_layers, num_query_heads, hidden_dim, intermediate_dim,
                 num_key_value_heads, layer_norm_epsilon=1e-6):
        super().__init__()
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_query_heads = num_query_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_dim = hidden_dim
        # ReversibleEmbedding(tie_weights=False)
        self.token_embedding = nn.Embedding(vocabulary_size, hidden_dim)
        self.reverse_embeddings = nn.Parameter(torch.randn(hidden_dim, vocabulary_size))
        self.transformer_layers = nn.ModuleList([
            LlamaTransformerDecoder(hidden_dim, intermediate_dim, num_query_heads, num_key_value_heads,
                                    layer_norm_epsilon)
            for _ in range(num_layers)
        ])
        self.layer_norm = LlamaLayerNorm(hidden_dim, layer_norm_epsilon)

    def reverse(self, x):
        return x @ self.reverse_embeddings

    def forward(self, token_ids, padding_mask):
        x = self.token_embedding(token_ids)
        for transformer_layer in self.transformer_layers:
            x = transformer_layer(x, decoder_padding_mask=padding_mask)
        return self.layer_norm(x)


# keras_nlp/samplers/greedy_sampler.py + sampler.py
class GreedySampler:
    temperature = 1.0

    def __call__(self, next, prompt, cache=None, index=0, mask=None, hidden_states=None):
        max_length = prompt.shape[-1]
        mask = torch.zeros_like(prompt, dtype=torch.bool) if mask is None else mask.to(torch.bool)
        for _ in range(max_length - index):
            logits, _, cache = next(prompt, cache, index)
            probabilities = torch.softmax(logits.float() / self.temperature, dim=-1)
            next_token = torch.argmax(probabilities, dim=-1)
            next_token = torch.where(mask[:, index], prompt[:, index], next_token)
            prompt = slice_update(prompt, [0, index], next_token[:, None])
            index = index + 1
        return prompt


# keras_nlp/models/llama/llama_causal_lm.py
class LlamaCausalLM(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self._sampler = GreedySampler()

    def call_with_cache(self, token_ids, cache, cache_update_index):
        x = self.backbone.token_embedding(token_ids)
        # Each decoder layer has a cache; we update them separately.
        updated_cache = []
        for i in range(self.backbone.num_layers):
            current_cache = cache[:, i, ...]
            x, next_cache = self.backbone.transformer_layers[i](
                x,
                self_attention_cache=current_cache,
                self_attention_cache_update_index=cache_update_index,
            )
            updated_cache.append(next_cache)
        cache = torch.stack(updated_cache, dim=1)
        hidden_states = x = self.backbone.layer_norm(x)
        logits = self.backbone.reverse(x)
        return logits, hidden_states, cache

    def _build_cache(self, token_ids):
        batch_size = token_ids.shape[0]
        max_length = token_ids.shape[1]
        num_layers = self.backbone.num_layers
        num_key_value_heads = self.backbone.num_key_value_heads
        head_dim = self.backbone.hidden_dim // self.backbone.num_query_heads
        shape = [batch_size, num_layers, 2, max_length, num_key_value_heads, head_dim]
        cache = torch.zeros(shape)
        # Seed the cache.
        _, hidden_states, cache = self.call_with_cache(token_ids, cache, 0)
        return hidden_states, cache

    def generate_step(self, inputs):
        token_ids, padding_mask = inputs["token_ids"], inputs["padding_mask"]
        # Create and seed cache with a single forward pass.
        hidden_states, cache = self._build_cache(token_ids)
        # Compute the lengths of all user inputted tokens ids.
        row_lengths = torch.sum(padding_mask.to(torch.int32), dim=-1)
        # Start at the first index that has no user inputted id.
        index = int(torch.min(row_lengths))

        def next(prompt, cache, index):
            # The cache index is the index of our previous token.
            cache_update_index = index - 1
            prompt = prompt[:, cache_update_index:cache_update_index + 1]
            logits, hidden_states, cache = self.call_with_cache(prompt, cache, cache_update_index)
            return logits.squeeze(1), hidden_states.squeeze(1), cache

        token_ids = self._sampler(
            next=next, prompt=token_ids, cache=cache, index=index, mask=padding_mask,
            hidden_states=hidden_states,
        )
        return {"token_ids": token_ids, "padding_mask": torch.ones_like(token_ids, dtype=torch.bool)}


def main():
    backbone = LlamaBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=4, hidden_dim=32, intermediate_dim=64,
        num_key_value_heads=2,
    )
    model = LlamaCausalLM(backbone).eval()

    # LlamaCausalLMPreprocessor.generate_preprocess: start token 1, right-padded to sequence_length with 0.
    sequence_length = 14
    prompts = [[1, 17, 42, 9, 33, 5, 28], [1, 50, 12, 7]]
    token_ids = torch.zeros(len(prompts), sequence_length, dtype=torch.long)
    padding_mask = torch.zeros(len(prompts), sequence_length, dtype=torch.bool)
    for b, p in enumerate(prompts):
        token_ids[b, :len(p)] = torch.tensor(p)
        padding_mask[b, :len(p)] = True

    with torch.no_grad():
        out = model.generate_step({"token_ids": token_ids, "padding_mask": padding_mask})
    for b, row in enumerate(out["token_ids"].tolist()):
        print(f"sequence {b}: {row}")


if __name__ == "__main__":
    main()
