"""KerasHub GPTNeoXCausalLM generate, ported from Keras (ops) to plain torch at tiny sizes.

Citation: keras-team/keras-hub PR #2870, commit 016c612b1 ("Rotate GPT-NeoX queries at their cache
position during decoding"); bug as in keras_hub/src/models/gpt_neo_x/gpt_neo_x_attention.py at master
71453d08f (GPTNeoXAttention.call), with gpt_neo_x_decoder.py and gpt_neo_x_causal_lm.py (call_with_cache,
_build_cache, generate_step) and samplers/sampler.py from the same snapshot.

Bug: the cache holds unrotated keys and `key_rot` is rotated over the whole cache from position 0, but
during cached decoding the query (one token, at cache_update_index) was rotated by the RotaryEmbedding
layer with its default start_index=0, i.e. as if it sat at position 0.
Fix: rotate the query with start_index=cache_update_index (0 when there is no cache index).
"""
import math
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, max_wavelength=10000):
        super().__init__()
        self.max_wavelength = max_wavelength

    def forward(self, inputs, start_index=0):
        # inputs: (batch, seq, heads, rotary_dim); sequence_axis=1, feature_axis=-1
        seq_len, dim = inputs.shape[1], inputs.shape[-1]
        inverse_freq = 1.0 / (self.max_wavelength ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        positions = torch.arange(seq_len, dtype=torch.float32) + start_index
        freq = torch.einsum("i,j->ij", positions, inverse_freq)
        embedding = torch.cat([freq, freq], dim=-1)[None, :, None, :]
        cos_emb, sin_emb = torch.cos(embedding), torch.sin(embedding)
        x1, x2 = torch.chunk(inputs, 2, dim=-1)
        half_rot = torch.cat([-x2, x1], dim=-1)
        return inputs * cos_emb + half_rot * sin_emb


class GPTNeoXAttention(torch.nn.Module):
    def __init__(self, num_heads, hidden_dim, rotary_percentage=0.25, rotary_max_wavelength=10000):
        super().__init__()
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.attn_head_size = hidden_dim // num_heads
        self.rotary_dim = int(self.attn_head_size * rotary_percentage)
        self.rotary_embedding_layer = RotaryEmbedding(rotary_max_wavelength)
        self._inv_norm_factor = 1.0 / math.sqrt(self.attn_head_size)
        # EinsumDense "abc,cde->abde" with output (None, num_heads, 3 * head_size)
        self._qkv_dense = torch.nn.Linear(hidden_dim, num_heads * 3 * self.attn_head_size)
        self._output_dense = torch.nn.Linear(hidden_dim, hidden_dim)

    def _compute_attention(self, query, key, value, attention_mask=None):
        # Fused path (dropout == 0): ops.dot_product_attention, layout (b, seq, heads, dim).
        if attention_mask is not None:
            attention_mask = attention_mask.unsqueeze(1).bool()
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            attn_mask=attention_mask, scale=self._inv_norm_factor,
        )
        return out.transpose(1, 2)

    def forward(self, hidden_states, attention_mask=None, cache=None, cache_update_index=None):
        b, s, _ = hidden_states.shape
        query_key_value = self._qkv_dense(hidden_states).view(b, s, self.num_heads, 3 * self.attn_head_size)
        query = query_key_value[..., : self.attn_head_size]
        if cache is not None:
            key_cache = cache[:, 0, ...]
            value_cache = cache[:, 1, ...]
            if cache_update_index is None:
                key, value = key_cache, value_cache
            else:
                key_update = query_key_value[..., self.attn_head_size : 2 * self.attn_head_size]
                value_update = query_key_value[..., 2 * self.attn_head_size :]
                key = key_cache.clone()
                value = value_cache.clone()
                key[:, cache_update_index : cache_update_index + s] = key_update
                value[:, cache_update_index : cache_update_index + s] = value_update
                cache = torch.stack((key, value), dim=1)
        else:
            key = query_key_value[..., self.attn_head_size : 2 * self.attn_head_size]
            value = query_key_value[..., 2 * self.attn_head_size :]

        query_rot, query_pass = query[..., : self.rotary_dim], query[..., self.rotary_dim :]
        key_rot, key_pass = key[..., : self.rotary_dim], key[..., self.rotary_dim :]

        if FIXED:
            start_index = cache_update_index if cache_update_index is not None else 0
            query_rot = self.rotary_embedding_layer(query_rot, start_index=start_index)
        else:
            query_rot = self.rotary_embedding_layer(query_rot)
        key_rot = self.rotary_embedding_layer(key_rot)

        query = torch.cat((query_rot, query_pass), dim=-1)
        key = torch.cat((key_rot, key_pass), dim=-1)

        attention_output = self._compute_attention(query, key, value, attention_mask)
        attention_output = attention_output.reshape(b, s, self.hidden_dim)
        return self._output_dense(attention_output), cache


def compute_causal_mask(batch_size, input_length, output_length, cache_index=0):
    i = torch.arange(output_length, dtype=torch.float32) + float(cache_index)
    i = i[:, None]
    j = torch.arange(input_length, dtype=torch.float32)
    mask = (i >= j)[None]
    return mask.expand(batch_size, output_length, input_length)


class GPTNeoXDecoder(torch.nn.Module):
    def __init__(self, hidden_dim, num_heads, intermediate_dim, rotary_percentage=0.25):
        super().__init__()
        self._self_attention_layer = GPTNeoXAttention(num_heads, hidden_dim, rotary_percentage)
        self._self_attention_layer_norm = torch.nn.LayerNorm(hidden_dim, eps=1e-5)
        self._feedforward_layer_norm = torch.nn.LayerNorm(hidden_dim, eps=1e-5)
        self._feedforward_intermediate_dense = torch.nn.Linear(hidden_dim, intermediate_dim)
        self._feedforward_output_dense = torch.nn.Linear(intermediate_dim, hidden_dim)

    def _compute_self_attention_mask(self, decoder_sequence, decoder_padding_mask,
                                     self_attention_cache=None, self_attention_cache_update_index=None):
        decoder_mask = None
        if decoder_padding_mask is not None:
            decoder_mask = decoder_padding_mask[:, None, :].bool()
        batch_size = decoder_sequence.shape[0]
        input_length = output_length = decoder_sequence.shape[1]
        if self_attention_cache is not None:
            input_length = self_attention_cache.shape[2]
        causal_mask = compute_causal_mask(
            batch_size, input_length, output_length,
            0 if self_attention_cache_update_index is None else self_attention_cache_update_index,
        )
        return torch.minimum(decoder_mask, causal_mask) if decoder_mask is not None else causal_mask

    def forward(self, decoder_sequence, decoder_padding_mask=None,
                self_attention_cache=None, self_attention_cache_update_index=None):
        self_attention_mask = self._compute_self_attention_mask(
            decoder_sequence, decoder_padding_mask, self_attention_cache, self_attention_cache_update_index
        )
        residual = decoder_sequence
        x = self._self_attention_layer_norm(decoder_sequence)
        x, self_attention_cache = self._self_attention_layer(
            x, attention_mask=self_attention_mask, cache=self_attention_cache,
            cache_update_index=self_attention_cache_update_index,
        )
        attention_output = x
        x = self._feedforward_layer_norm(decoder_sequence)
        x = self._feedforward_output_dense(F.gelu(self._feedforward_intermediate_dense(x)))
        x = x + attention_output + residual
        if self_attention_cache is not None:
            return x, self_attention_cache
        return x


class GPTNeoXBackbone(torch.nn.Module):
    def __init__(self, vocabulary_size, num_layers, num_heads, hidden_dim, intermediate_dim, rotary_percentage=0.25):
        super().__init__()
        self.num_layers, self.num_heads, self.hidden_dim = num_layers, num_heads, hidden_dim
        # ReversibleEmbedding(tie_weights=False): a separate reverse projection.
        self.token_embedding = torch.nn.Embedding(vocabulary_size, hidden_dim)
        self.token_embedding_reverse = torch.nn.Linear(hidden_dim, vocabulary_size, bias=False)
        self.transformer_layers = torch.nn.ModuleList(
            [GPTNeoXDecoder(hidden_dim, num_heads, intermediate_dim, rotary_percentage) for _ in range(num_layers)]
        )
        self.layer_norm = torch.nn.LayerNorm(hidden_dim, eps=1e-5)


class GPTNeoXCausalLM(torch.nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone

    def call_with_cache(self, token_ids, cache, cache_update_index):
        x = self.backbone.token_embedding(token_ids)
        caches = []
        for i, transformer_layer in enumerate(self.backbone.transformer_layers):
            current_cache = cache[:, i, ...]
            x, next_cache = transformer_layer(
                x, self_attention_cache=current_cache, self_attention_cache_update_index=cache_update_index
            )
            caches.append(next_cache)
        cache = torch.stack(caches, dim=1)
        x = self.backbone.layer_norm(x)
        hidden_states = x
        logits = self.backbone.token_embedding_reverse(hidden_states)
        return logits, hidden_states, cache

    def _build_cache(self, token_ids):
        batch_size, max_length = token_ids.shape
        head_dim = self.backbone.hidden_dim // self.backbone.num_heads
        shape = [batch_size, self.backbone.num_layers, 2, max_length, self.backbone.num_heads, head_dim]
        cache = torch.zeros(shape)
        _, hidden_states, cache = self.call_with_cache(token_ids, cache, 0)
        return hidden_states, cache

    def generate_step(self, inputs):
        token_ids, padding_mask = inputs["token_ids"], inputs["padding_mask"]
        hidden_states, cache = self._build_cache(token_ids)
        row_lengths = padding_mask.int().sum(-1)
        index = int(row_lengths.min())

        def next(prompt, cache, index):
            cache_update_index = index - 1
            prompt = prompt[:, cache_update_index : cache_update_index + 1]
            logits, hidden_states, cache = self.call_with_cache(prompt, cache, cache_update_index)
            return logits.squeeze(1), hidden_states.squeeze(1), cache

        # GreedySampler.__call__ without stop tokens.
        prompt, mask = token_ids.clone(), padding_mask.bool()
        max_length = prompt.shape[-1]
        while index < max_length:
            logits, _, cache = next(prompt, cache, index)
            next_token = torch.softmax(logits, dim=-1).argmax(-1)
            next_token = torch.where(mask[:, index], prompt[:, index], next_token)
            prompt[:, index] = next_token
            index += 1
        return {"token_ids": prompt, "padding_mask": torch.ones_like(prompt, dtype=torch.bool)}


def main():
    backbone = GPTNeoXBackbone(
        vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64, rotary_percentage=1.0
    )
    model = GPTNeoXCausalLM(backbone).eval()

    # GPTNeoXCausalLMPreprocessor output for generate: right padded to sequence_length.
    sequence_length = 12
    prompts = [[1, 17, 23, 5, 9], [1, 40, 8]]
    token_ids = torch.zeros(len(prompts), sequence_length, dtype=torch.long)
    padding_mask = torch.zeros(len(prompts), sequence_length, dtype=torch.bool)
    for row, p in enumerate(prompts):
        token_ids[row, : len(p)] = torch.tensor(p)
        padding_mask[row, : len(p)] = True

    with torch.no_grad():
        outputs = model.generate_step({"token_ids": token_ids, "padding_mask": padding_mask})
    for row in outputs["token_ids"].tolist():
        print(row)


if __name__ == "__main__":
    main()
