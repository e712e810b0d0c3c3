"""KerasHub Falcon: cached generation built the ALiBi bias over the query window, not the cache.

Citation: keras-team/keras-hub#2977 ("Fix Falcon ALiBi bias when using the KV cache"), fixes
keras-team/keras-hub#2861 (same fix first proposed in #2862). Code ported from
keras_hub/src/models/falcon/falcon_transformer_decoder.py, falcon_attention.py, falcon_causal_lm.py
and the shared CausalLM.generate_step / GreedySampler loop, Keras ops rewritten in plain torch.

The bug: ``FalconTransformerDecoder.call`` builds ``alibi = self._build_alibi_tensor(num_heads,
mask)`` from ``decoder_padding_mask`` or, when none is given (as ``call_with_cache`` never gives
one), from ``ones((batch_size, seq_length))`` of the *query*. During ``generate()`` each decode step
has a query of one token, so the bias is ``(batch, heads, 1, 1)`` of ``slope * 0``: it broadcasts
over the cache length and every decode step runs with no ALiBi bias at all (a multi-token cached
call would fail to broadcast instead).

The fix: when an attention cache is present, build the ALiBi tensor over the full cache length
(``ones((batch_size, cache_length))``), so key slot ``j`` gets ``slope * j`` as in the full forward
pass; slots not yet written are already masked by the causal mask built from
``attention_cache_update_index``.

Toy sizes, random weights; two right-padded prompts (KerasHub's generate pads on the right and
keeps a ``padding_mask``), greedy sampling to ``max_length``.
"""

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


# --- keras_hub/src/layers/modeling/transformer_layer_utils.py -------------------------------
def merge_padding_and_attention_mask(inputs, padding_mask, attention_mask):
    mask = padding_mask
    if mask is not None:
        mask = mask.to(torch.int32)[:, None, :]  # (batch, 1, seq)
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.int32)
        if mask is None:
            return attention_mask
        return torch.minimum(mask, attention_mask)
    return mask


def compute_causal_mask(batch_size, input_length, output_length, cache_index=0):
    i = torch.arange(output_length)[:, None] + cache_index
    j = torch.arange(input_length)[None, :]
    mask = (i >= j).to(torch.int32)[None, :, :]
    return mask.expand(batch_size, output_length, input_length)


def keras_masked_softmax(scores, mask):
    # keras.layers.Softmax(inputs, mask): adds a large negative number where mask is 0.
    if mask is not None:
        adder = (1.0 - mask.to(scores.dtype)) * (-1e9)
        scores = scores + adder
    return torch.softmax(scores.float(), dim=-1).to(scores.dtype)


# --- falcon_attention.py --------------------------------------------------------------------
class FalconAttention(nn.Module):
    def __init__(self, num_heads, hidden_dim, attention_dropout_rate=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.attention_dropout_rate = attention_dropout_rate
        self.head_dim = hidden_dim // num_heads
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.query_dense = nn.Linear(hidden_dim, hidden_dim)
        self.key_dense = nn.Linear(hidden_dim, hidden_dim)
        self.value_dense = nn.Linear(hidden_dim, hidden_dim)
        self.attention_dropout = nn.Dropout(attention_dropout_rate)
        self.output_dense = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, inputs, alibi, attention_mask=None, cache=None, cache_update_index=None):
        batch_size, seq_length, hidden_dim = inputs.shape
        query = self.query_dense(inputs).view(batch_size, seq_length, self.num_heads, self.head_dim)
        key = self.key_dense(inputs).view(batch_size, seq_length, self.num_heads, self.head_dim)
        value = self.value_dense(inputs).view(batch_size, seq_length, self.num_heads, self.head_dim)

        if cache is not None:
            key_cache = cache[:, 0, ...]
            value_cache = cache[:, 1, ...]
            if cache_update_index is None:
                key = key_cache
                value = value_cache
            else:
                # ops.slice_update(key_cache, [0, cache_update_index, 0, 0], key)
                start = int(cache_update_index)
                key_cache = key_cache.clone()
                value_cache = value_cache.clone()
                key_cache[:, start : start + seq_length] = key
                value_cache[:, start : start + seq_length] = value
                key, value = key_cache, value_cache
                cache = torch.stack((key, value), dim=1)
        elif cache_update_index is not None:
            raise ValueError("`cache_update_index` should not be set if `cache` is `None`.")

        attention_scores = torch.einsum("bqnh,bknh->bnqk", query, key)
        attention_scores = attention_scores + alibi
        # [batch_size, num_heads, query_length, kv_length]
        attention_scores = attention_scores * self.inv_norm_factor
        attention_scores = keras_masked_softmax(attention_scores, attention_mask[:, None])
        attention_scores = self.attention_dropout(attention_scores)
        attention_output = torch.einsum("bnqk,bknh->bqnh", attention_scores, value)

        attention_output = attention_output.reshape(
            batch_size, seq_length, self.num_heads * self.head_dim
        )
        attention_output = self.output_dense(attention_output)
        if cache is not None:
            return attention_output, cache
        return attention_output


# --- falcon_transformer_decoder.py ----------------------------------------------------------
class FalconTransformerDecoder(nn.Module):
    def __init__(self, num_attention_heads, hidden_dim, intermediate_dim, layer_norm_epsilon=1e-5):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.input_layernorm = nn.LayerNorm(hidden_dim, eps=layer_norm_epsilon)
        self.attention_layer = FalconAttention(num_attention_heads, hidden_dim)
        self.post_attention_layernorm = nn.LayerNorm(hidden_dim, eps=layer_norm_epsilon)
        self.dense_h_to_4h = nn.Linear(hidden_dim, intermediate_dim)
        self.dense_4h_to_h = nn.Linear(intermediate_dim, hidden_dim)

    def forward(
        self,
        inputs,
        decoder_padding_mask=None,
        decoder_attention_mask=None,
        attention_cache=None,
        attention_cache_update_index=None,
    ):
        attention_mask = self._compute_attention_mask(
            decoder_sequence=inputs,
            decoder_padding_mask=decoder_padding_mask,
            decoder_attention_mask=decoder_attention_mask,
            attention_cache=attention_cache,
            attention_cache_update_index=attention_cache_update_index,
        )

        residual = inputs
        x = self.input_layernorm(inputs)

        mask = decoder_padding_mask
        if FIXED and attention_cache is not None:
            batch_size = inputs.shape[0]
            cache_length = attention_cache.shape[2]
            mask = torch.ones((batch_size, cache_length), dtype=torch.int32)
        elif mask is None:
            batch_size, seq_length = inputs.shape[:2]
            mask = torch.ones((batch_size, seq_length), dtype=torch.int32)
        alibi = self._build_alibi_tensor(self.num_attention_heads, mask)

        attention_output = self.attention_layer(
            inputs=x,
            alibi=alibi,
            attention_mask=attention_mask,
            cache=attention_cache,
            cache_update_index=attention_cache_update_index,
        )
        if attention_cache is None:
            x = attention_output
        else:
            x, attention_cache = attention_output

        x = x + residual
        residual = x
        x = self.post_attention_layernorm(x)
        x = self.dense_h_to_4h(x)
        x = F.gelu(x)
        x = self.dense_4h_to_h(x)
        x = x + residual

        if attention_cache is not None:
            return x, attention_cache
        return x

    def _compute_attention_mask(
        self,
        decoder_sequence,
        decoder_padding_mask,
        decoder_attention_mask,
        attention_cache=None,
        attention_cache_update_index=None,
    ):
        decoder_mask = merge_padding_and_attention_mask(
            decoder_sequence, decoder_padding_mask, decoder_attention_mask
        )
        batch_size = decoder_sequence.shape[0]
        input_length = output_length = decoder_sequence.shape[1]
        # We need to handle a rectangular causal mask when doing cached
        # decoding. For generative inference, `decoder_sequence` will
        # generally be length 1, and `cache` will be the full generation length.
        if attention_cache is not None:
            input_length = attention_cache.shape[2]

        causal_mask = compute_causal_mask(
            batch_size,
            input_length,
            output_length,
            0 if attention_cache_update_index is None else attention_cache_update_index,
        )
        return torch.minimum(decoder_mask, causal_mask) if decoder_mask is not None else causal_mask

    def _build_alibi_tensor(self, num_heads, mask):
        slopes = torch.tensor(self._get_slopes(num_heads), dtype=torch.float32)  # num_heads
        mask = mask.to(torch.int32)
        cumsum_mask = (torch.cumsum(mask, dim=-1) - 1).to(torch.int32)
        arange_tensor = (cumsum_mask * mask)[:, None, :]
        alibi = slopes[..., None] * arange_tensor.to(torch.float32)
        alibi = alibi[None]  # [None, batch_size, num_heads, seq_length]
        return alibi.permute(1, 2, 0, 3)

    def _get_slopes(self, num_heads):
        def get_slopes_power_of_2(n):
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            ratio = start
            return [start * ratio**i for i in range(n)]

        if math.log2(num_heads).is_integer():
            return get_slopes_power_of_2(num_heads)
        closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
        return (
            get_slopes_power_of_2(closest_power_of_2)
            + self._get_slopes(2 * closest_power_of_2)[0::2][: num_heads - closest_power_of_2]
        )


# --- falcon_backbone.py ---------------------------------------------------------------------
class FalconBackbone(nn.Module):
    def __init__(self, vocabulary_size, num_layers, num_attention_heads, hidden_dim,
                 intermediate_dim, layer_norm_epsilon=1e-5):
        super().__init__()
        self.num_layers = num_layers
        self.num_attention_heads = num_attention_heads
        self.hidden_dim = hidden_dim
        self.token_embedding = nn.Embedding(vocabulary_size, hidden_dim)
        self.transformer_layers = nn.ModuleList(
            [
                FalconTransformerDecoder(num_attention_heads, hidden_dim, intermediate_dim,
                                         layer_norm_epsilon)
                for _ in range(num_layers)
            ]
        )
        self.final_layernorm = nn.LayerNorm(hidden_dim, eps=layer_norm_epsilon)

    def reverse_embedding(self, x):
        # ReversibleEmbedding(reverse=True): tied output projection.
        return x @ self.token_embedding.weight.T

    def forward(self, token_ids, padding_mask):
        x = self.token_embedding(token_ids)
        for layer in self.transformer_layers:
            x = layer(x, decoder_padding_mask=padding_mask)
        return self.final_layernorm(x)


# --- falcon_causal_lm.py + causal_lm.py + samplers ------------------------------------------
class FalconCausalLM(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone

    def call_with_cache(self, token_ids, cache, cache_update_index):
        x = self.backbone.token_embedding(token_ids)
        # Each decoder layer has a cache; we update them separately.
        caches = []
        for i, transformer_layer in enumerate(self.backbone.transformer_layers):
            current_cache = cache[:, i, ...]
            x, next_cache = transformer_layer(
                x,
                attention_cache=current_cache,
                attention_cache_update_index=cache_update_index,
            )
            caches.append(next_cache)
        cache = torch.stack(caches, dim=1)
        hidden_states = x = self.backbone.final_layernorm(x)
        logits = self.backbone.reverse_embedding(x)
        return logits, hidden_states, cache

    def _build_cache(self, token_ids):
        batch_size, max_length = token_ids.shape
        num_layers = self.backbone.num_layers
        num_heads = self.backbone.num_attention_heads
        head_dim = self.backbone.hidden_dim // num_heads
        shape = [batch_size, num_layers, 2, max_length, num_heads, head_dim]
        cache = torch.zeros(shape)
        # Seed the cache.
        _, hidden_states, cache = self.call_with_cache(token_ids, cache, 0)
        return hidden_states, cache

    @torch.no_grad()
    def generate_step(self, inputs, stop_token_ids=None):
        token_ids, padding_mask = inputs["token_ids"], inputs["padding_mask"]
        hidden_states, cache = self._build_cache(token_ids)
        # Compute the lengths of all user inputted tokens ids.
        row_lengths = padding_mask.to(torch.int32).sum(dim=-1)
        # Start at the first index that has no user inputted id.
        index = int(row_lengths.min())

        def next(prompt, cache, index):
            # The cache index is the index of our previous token.
            cache_update_index = index - 1
            prompt = prompt[:, cache_update_index : cache_update_index + 1]
            logits, hidden_states, cache = self.call_with_cache(prompt, cache, cache_update_index)
            return logits.squeeze(1), hidden_states.squeeze(1), cache

        # GreedySampler.__call__
        prompt = token_ids.clone()
        mask = padding_mask.clone().bool()
        max_length = prompt.shape[1]
        while index < max_length:
            logits, _, cache = next(prompt, cache, index)
            probabilities = torch.softmax(logits, dim=-1)
            next_token = torch.argmax(probabilities, dim=-1).to(prompt.dtype)
            # Don't overwrite anywhere mask is True.
            next_token = torch.where(mask[:, index], prompt[:, index], next_token)
            prompt[:, index] = next_token
            index += 1

        # Compute an output padding mask with the token ids we updated.
        return {"token_ids": prompt, "padding_mask": torch.ones_like(padding_mask)}


def main():
    torch.manual_seed(0)
    backbone = FalconBackbone(
        vocabulary_size=64,
        num_layers=2,
        num_attention_heads=8,
        hidden_dim=64,
        intermediate_dim=128,
    )
    with torch.no_grad():
        backbone.token_embedding.weight.normal_(0.0, 0.5)
        for m in backbone.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.3)
    falcon_lm = FalconCausalLM(backbone).eval()

    max_length = 16
    prompts = [[5, 17, 42, 8, 23], [11, 3, 29]]
    token_ids = torch.zeros((len(prompts), max_length), dtype=torch.long)
    padding_mask = torch.zeros((len(prompts), max_length), dtype=torch.bool)
    for b, p in enumerate(prompts):
        token_ids[b, : len(p)] = torch.tensor(p)
        padding_mask[b, : len(p)] = True

    out = falcon_lm.generate_step({"token_ids": token_ids, "padding_mask": padding_mask})
    for b, p in enumerate(prompts):
        print(f"row {b}: prompt {p} -> generated {out['token_ids'][b, len(p):].tolist()}")


if __name__ == "__main__":
    main()
