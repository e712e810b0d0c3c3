"""KerasHub BartSeq2SeqLM generate, ported from Keras (ops) to plain torch at tiny sizes.

Follows keras-team/keras-hub:
  keras_hub/src/models/bart/bart_seq_2_seq_lm.py @0e1444fdfbc088d2e736a43927f4719a30becd19
      call_encoder (encoder layers given the source padding_mask), call_decoder_with_cache
      (decoder positions start at self_attention_cache_update_index, each layer handed
      encoder_padding_mask and its own self / cross caches), _initialize_cache (zeros of
      (B, layers, 2, len, heads, head_dim) for the decoder's max_length and the source
      length), _build_cache (one call over the whole right-padded decoder prompt, both cache
      update indices 0), generate_step (index = min(row_lengths); next() feeds token
      index - 1, cross cache reused with update index None; output padding mask from the
      first new stop token)
  keras_hub/src/models/bart/bart_backbone.py @7eea6c8155cf375079e5da4c55d670d27f705ce9
      (learned encoder / decoder PositionEmbedding, post-LN TransformerEncoder /
      TransformerDecoder, decoder_padding_mask and encoder_padding_mask in the forward)
  keras_hub/src/layers/modeling/transformer_decoder.py @aa42194c18ba6e912d4ec811a72beb898e50e7a5
      call / _compute_self_attention_mask (cache length as key length, cache index as the
      causal offset, minimum with the padding mask), cross_attention_mask from
      merge_padding_and_attention_mask(encoder_sequence, encoder_padding_mask, ...)
  keras_hub/src/layers/modeling/transformer_layer_utils.py @aa42194c18ba6e912d4ec811a72beb898e50e7a5
      compute_causal_mask, merge_padding_and_attention_mask
  keras_hub/src/layers/modeling/cached_multi_head_attention.py @f333f54e0637c8976d60cf018e7999a9acad07bf
  keras_hub/src/samplers/sampler.py (Sampler.__call__: prompt tokens kept where mask is True)
  keras MultiHeadAttention._compute_attention: ops.dot_product_attention with a bool mask
      when the layer has no attention dropout, else _masked_softmax (keras.layers.Softmax:
      adder = (1 - mask) * -1e9, softmax, times the mask).

Sources are packed as BartSeq2SeqLMPreprocessor does (<s> ... </s>, right padded with <pad>,
padding mask beside); decoder prompts start with </s> <s> and are right padded to max_length.
Checked against each source and prompt generated alone, unpadded, by a cache-free loop that
reruns the backbone over the whole prefix; the padded batch's teacher-forced logits against
each row alone.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

LARGE_NEGATIVE = -1e9  # keras _large_negative_number(float32)
BOS, PAD, EOS = 0, 1, 2  # "<s>", "<pad>", "</s>"


# --- keras_hub/src/layers/modeling/transformer_layer_utils.py --------------------------------


def compute_causal_mask(batch_size, input_length, output_length, cache_index=0):
    i = torch.arange(output_length, dtype=torch.float32)
    i = i + float(cache_index)
    i = i[:, None]
    j = torch.arange(input_length, dtype=torch.float32)
    mask = (i >= j)[None]
    return mask.expand(batch_size, output_length, input_length)


def merge_padding_and_attention_mask(inputs, padding_mask, attention_mask):
    mask = padding_mask
    if mask is not None:
        # Add an axis for broadcasting, the attention mask should be 2D
        # (not including the batch axis).
        mask = mask[:, None, :].to(torch.int32)
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.int32)
        if mask is None:
            return attention_mask
        return torch.minimum(mask, attention_mask)
    return mask


# --- embeddings ---------------------------------------------------------------------------


class ReversibleEmbedding(nn.Embedding):
    def forward(self, inputs, reverse=False):
        if reverse:
            return inputs @ self.weight.T
        return super().forward(inputs)


class PositionEmbedding(nn.Module):
    def __init__(self, sequence_length, hidden_dim):
        super().__init__()
        self.position_embeddings = nn.Parameter(torch.randn(sequence_length, hidden_dim))

    def forward(self, inputs, start_index=0):
        sequence_length = inputs.shape[1]
        start_index = 0 if start_index is None else int(start_index)
        positions = self.position_embeddings[start_index : start_index + sequence_length]
        return positions[None].expand(inputs.shape[0], -1, -1)


# --- keras MultiHeadAttention + CachedMultiHeadAttention ----------------------------------


class CachedMultiHeadAttention(nn.Module):
    def __init__(self, num_heads, key_dim, hidden_dim, dropout=0.0):
        super().__init__()
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._dropout = dropout
        self._inverse_sqrt_key_dim = 1.0 / math.sqrt(float(key_dim))
        self._query_dense = nn.Linear(hidden_dim, num_heads * key_dim)
        self._key_dense = nn.Linear(hidden_dim, num_heads * key_dim)
        self._value_dense = nn.Linear(hidden_dim, num_heads * key_dim)
        self._output_dense = nn.Linear(num_heads * key_dim, hidden_dim)
        self._dropout_layer = nn.Dropout(dropout)

    def _split(self, x):  # EinsumDense "abc,cde->abde": (B, T, N, H)
        return x.view(x.shape[0], x.shape[1], self._num_heads, self._key_dim)

    def _masked_softmax(self, attention_scores, attention_mask=None):
        # attention_scores: (B, N, T, S); the mask gains the heads axis at -3.
        if attention_mask is not None:
            while attention_mask.dim() < attention_scores.dim():
                attention_mask = attention_mask.unsqueeze(-3)
            mask = attention_mask.to(attention_scores.dtype)
            attention_scores = attention_scores + (1.0 - mask) * LARGE_NEGATIVE
            probs = torch.softmax(attention_scores, dim=-1)
            return probs * mask
        return torch.softmax(attention_scores, dim=-1)

    def _compute_attention(self, query, key, value, attention_mask=None):
        if self._dropout == 0.0:
            # ops.dot_product_attention on the torch backend (B, T, N, H) layout.
            if attention_mask is not None:
                while attention_mask.dim() < 4:
                    attention_mask = attention_mask.unsqueeze(-3)
                attention_mask = attention_mask.to(torch.bool)
            out = F.scaled_dot_product_attention(
                query.transpose(1, 2),
                key.transpose(1, 2),
                value.transpose(1, 2),
                attn_mask=attention_mask,
                is_causal=False,
                scale=self._inverse_sqrt_key_dim,
            )
            return out.transpose(1, 2), None
        query = query * self._inverse_sqrt_key_dim
        attention_scores = torch.einsum("aecd,abcd->acbe", key, query)
        attention_scores = self._masked_softmax(attention_scores, attention_mask)
        final_attn_scores = self._dropout_layer(attention_scores)
        attention_output = torch.einsum("acbe,aecd->abcd", final_attn_scores, value)
        return attention_output, attention_scores

    def forward(self, query, value, key=None, attention_mask=None, cache=None, cache_update_index=None):
        if key is None:
            key = value
        query = self._split(self._query_dense(query))
        if cache is not None:
            key_cache = cache[:, 0, ...]
            value_cache = cache[:, 1, ...]
            if cache_update_index is None:
                key = key_cache
                value = value_cache
            else:
                key_update = self._split(self._key_dense(key))
                value_update = self._split(self._value_dense(value))
                start = int(cache_update_index)
                stop = start + key_update.shape[1]
                key = key_cache.clone()
                value = value_cache.clone()
                key[:, start:stop] = key_update
                value[:, start:stop] = value_update
                cache = torch.stack((key, value), dim=1)
        else:
            if cache_update_index is not None:
                raise ValueError("`cache_update_index` should not be set if `cache` is `None`.")
            key = self._split(self._key_dense(key))
            value = self._split(self._value_dense(value))

        attention_output, _ = self._compute_attention(query, key, value, attention_mask)
        attention_output = self._output_dense(attention_output.flatten(2))
        if cache is not None:
            return attention_output, cache
        return attention_output


# --- TransformerEncoder / TransformerDecoder (normalize_first=False, as BART) --------------


class TransformerEncoder(nn.Module):
    def __init__(self, intermediate_dim, num_heads, hidden_dim, dropout, layer_norm_epsilon=1e-5):
        super().__init__()
        self._self_attention_layer = CachedMultiHeadAttention(num_heads, hidden_dim // num_heads, hidden_dim, dropout)
        self._self_attention_layer_norm = nn.LayerNorm(hidden_dim, eps=layer_norm_epsilon)
        self._self_attention_dropout = nn.Dropout(dropout)
        self._feedforward_intermediate_dense = nn.Linear(hidden_dim, intermediate_dim)
        self._feedforward_output_dense = nn.Linear(intermediate_dim, hidden_dim)
        self._feedforward_layer_norm = nn.LayerNorm(hidden_dim, eps=layer_norm_epsilon)
        self._feedforward_dropout = nn.Dropout(dropout)

    def forward(self, inputs, padding_mask=None, attention_mask=None):
        x = inputs
        self_attention_mask = merge_padding_and_attention_mask(inputs, padding_mask, attention_mask)
        residual = x
        x = self._self_attention_layer(query=x, value=x, attention_mask=self_attention_mask)
        x = self._self_attention_dropout(x)
        x = self._self_attention_layer_norm(x + residual)
        residual = x
        x = self._feedforward_output_dense(F.gelu(self._feedforward_intermediate_dense(x)))
        x = self._feedforward_dropout(x)
        return self._feedforward_layer_norm(x + residual)


class TransformerDecoder(nn.Module):
    def __init__(self, intermediate_dim, num_heads, hidden_dim, dropout, layer_norm_epsilon=1e-5):
        super().__init__()
        head_dim = hidden_dim // num_heads
        self._self_attention_layer = CachedMultiHeadAttention(num_heads, head_dim, hidden_dim, dropout)
        self._self_attention_layer_norm = nn.LayerNorm(hidden_dim, eps=layer_norm_epsilon)
        self._self_attention_dropout = nn.Dropout(dropout)
        self._cross_attention_layer = CachedMultiHeadAttention(num_heads, head_dim, hidden_dim, dropout)
        self._cross_attention_layer_norm = nn.LayerNorm(hidden_dim, eps=layer_norm_epsilon)
        self._cross_attention_dropout = nn.Dropout(dropout)
        self._feedforward_intermediate_dense = nn.Linear(hidden_dim, intermediate_dim)
        self._feedforward_output_dense = nn.Linear(intermediate_dim, hidden_dim)
        self._feedforward_layer_norm = nn.LayerNorm(hidden_dim, eps=layer_norm_epsilon)
        self._feedforward_dropout = nn.Dropout(dropout)

    def forward(
        self,
        decoder_sequence,
        encoder_sequence=None,
        decoder_padding_mask=None,
        decoder_attention_mask=None,
        encoder_padding_mask=None,
        encoder_attention_mask=None,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        cross_attention_cache=None,
        cross_attention_cache_update_index=None,
        use_causal_mask=True,
    ):
        if (self_attention_cache is None) != (cross_attention_cache is None):
            raise ValueError("`self_attention_cache` and `cross_attention_cache` should both be set or both be `None`.")

        self_attention_mask = self._compute_self_attention_mask(
            decoder_sequence=decoder_sequence,
            decoder_padding_mask=decoder_padding_mask,
            decoder_attention_mask=decoder_attention_mask,
            use_causal_mask=use_causal_mask,
            self_attention_cache=self_attention_cache,
            self_attention_cache_update_index=self_attention_cache_update_index,
        )

        x = decoder_sequence
        residual = x
        attention_output = self._self_attention_layer(
            query=x,
            value=x,
            attention_mask=self_attention_mask,
            cache=self_attention_cache,
            cache_update_index=self_attention_cache_update_index,
        )
        if self_attention_cache is None:
            x = attention_output
        else:
            x, self_attention_cache = attention_output
        x = self._self_attention_dropout(x)
        x = self._self_attention_layer_norm(x + residual)

        cross_attention_mask = merge_padding_and_attention_mask(
            encoder_sequence, encoder_padding_mask, encoder_attention_mask
        )
        residual = x
        attention_output = self._cross_attention_layer(
            query=x,
            value=encoder_sequence,
            attention_mask=cross_attention_mask,
            cache=cross_attention_cache,
            cache_update_index=cross_attention_cache_update_index,
        )
        if cross_attention_cache is None:
            x = attention_output
        else:
            x, cross_attention_cache = attention_output
        x = self._cross_attention_dropout(x)
        x = self._cross_attention_layer_norm(x + residual)

        residual = x
        x = self._feedforward_output_dense(F.gelu(self._feedforward_intermediate_dense(x)))
        x = self._feedforward_dropout(x)
        x = self._feedforward_layer_norm(x + residual)

        if self_attention_cache is not None:
            return x, self_attention_cache, cross_attention_cache
        return x

    def _compute_self_attention_mask(
        self,
        decoder_sequence,
        decoder_padding_mask,
        decoder_attention_mask,
        use_causal_mask,
        self_attention_cache,
        self_attention_cache_update_index,
    ):
        decoder_mask = merge_padding_and_attention_mask(decoder_sequence, decoder_padding_mask, decoder_attention_mask)
        if use_causal_mask:
            batch_size = decoder_sequence.shape[0]
            input_length = output_length = decoder_sequence.shape[1]
            # Rectangular causal mask for cached decoding: keys span the whole cache.
            if self_attention_cache is not None:
                input_length = self_attention_cache.shape[2]
            causal_mask = compute_causal_mask(
                batch_size,
                input_length,
                output_length,
                0 if self_attention_cache_update_index is None else self_attention_cache_update_index,
            )
            return torch.minimum(decoder_mask, causal_mask.to(torch.int32)) if decoder_mask is not None else causal_mask
        return decoder_mask


# --- BartBackbone / BartSeq2SeqLM ----------------------------------------------------------


class BartBackbone(nn.Module):
    def __init__(self, vocabulary_size, num_layers, num_heads, hidden_dim, intermediate_dim, dropout=0.1, max_sequence_length=1024):
        super().__init__()
        self.token_embedding = ReversibleEmbedding(vocabulary_size, hidden_dim)
        # Wider than bart_kernel_initializer (stddev 0.02) so the tied logits separate at toy sizes.
        nn.init.trunc_normal_(self.token_embedding.weight, std=0.4, a=-0.8, b=0.8)
        self.encoder_position_embedding = PositionEmbedding(max_sequence_length, hidden_dim)
        self.encoder_embeddings_layer_norm = nn.LayerNorm(hidden_dim, eps=1e-5)
        self.encoder_embeddings_dropout = nn.Dropout(dropout)
        self.encoder_transformer_layers = nn.ModuleList(
            TransformerEncoder(intermediate_dim, num_heads, hidden_dim, dropout) for _ in range(num_layers)
        )
        self.decoder_position_embedding = PositionEmbedding(max_sequence_length, hidden_dim)
        self.decoder_embeddings_layer_norm = nn.LayerNorm(hidden_dim, eps=1e-5)
        self.decoder_embeddings_dropout = nn.Dropout(dropout)
        self.decoder_transformer_layers = nn.ModuleList(
            TransformerDecoder(intermediate_dim, num_heads, hidden_dim, dropout) for _ in range(num_layers)
        )
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim

    def forward(self, inputs):
        # Encoder.
        tokens = self.token_embedding(inputs["encoder_token_ids"])
        positions = self.encoder_position_embedding(tokens)
        x = self.encoder_embeddings_layer_norm(tokens + positions)
        x = self.encoder_embeddings_dropout(x)
        for transformer_layer in self.encoder_transformer_layers:
            x = transformer_layer(x, padding_mask=inputs["encoder_padding_mask"])
        encoder_output = x
        # Decoder.
        tokens = self.token_embedding(inputs["decoder_token_ids"])
        positions = self.decoder_position_embedding(tokens)
        x = self.decoder_embeddings_layer_norm(tokens + positions)
        x = self.decoder_embeddings_dropout(x)
        for transformer_layer in self.decoder_transformer_layers:
            x = transformer_layer(
                decoder_sequence=x,
                encoder_sequence=encoder_output,
                decoder_padding_mask=inputs["decoder_padding_mask"],
                encoder_padding_mask=inputs["encoder_padding_mask"],
            )
        return {"encoder_sequence_output": encoder_output, "decoder_sequence_output": x}


def any_equal(inputs, values, padding_mask):
    output = torch.zeros_like(inputs, dtype=torch.bool)
    for value in values:
        output = output | (inputs == value)
    return output & padding_mask


class GreedySampler:
    def __call__(self, next, prompt, cache=None, index=0, mask=None, stop_token_ids=None):
        max_length = prompt.shape[-1]
        mask = torch.zeros_like(prompt, dtype=torch.bool) if mask is None else mask.to(torch.bool)
        self.step_probabilities = {}

        def cond(prompt):
            if stop_token_ids is None:
                return True
            # Stop if all sequences have produced a *new* id from stop_token_ids.
            end_tokens = any_equal(prompt, stop_token_ids, ~mask)
            return not bool(end_tokens.any(dim=-1).all())

        while index < max_length and cond(prompt):
            logits, _, cache = next(prompt, cache, index)
            probabilities = torch.softmax(logits.float(), dim=-1)
            self.step_probabilities[index] = probabilities
            next_token = torch.argmax(probabilities, dim=-1).to(prompt.dtype)
            # Don't overwrite anywhere mask is True.
            next_token = torch.where(mask[:, index], prompt[:, index], next_token)
            prompt = prompt.clone()
            prompt[:, index] = next_token
            index = index + 1
        return prompt


class BartSeq2SeqLM(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.sampler = GreedySampler()

    def forward(self, inputs):
        hidden_states = self.backbone(inputs)["decoder_sequence_output"]
        return self.backbone.token_embedding(hidden_states, reverse=True)

    def call_decoder_with_cache(
        self,
        encoder_hidden_states,
        encoder_padding_mask,
        decoder_token_ids,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        cross_attention_cache=None,
        cross_attention_cache_update_index=None,
    ):
        tokens = self.backbone.token_embedding(decoder_token_ids)
        positions = self.backbone.decoder_position_embedding(tokens, start_index=self_attention_cache_update_index)
        x = self.backbone.decoder_embeddings_layer_norm(tokens + positions)
        x = self.backbone.decoder_embeddings_dropout(x)

        self_attention_caches = []
        cross_attention_caches = []
        for i, layer in enumerate(self.backbone.decoder_transformer_layers):
            current_self_attention_cache = self_attention_cache[:, i, ...]
            current_cross_attention_cache = cross_attention_cache[:, i, ...]
            x, next_self_attention_cache, next_cross_attention_cache = layer(
                decoder_sequence=x,
                encoder_sequence=encoder_hidden_states,
                encoder_padding_mask=encoder_padding_mask,
                self_attention_cache=current_self_attention_cache,
                self_attention_cache_update_index=self_attention_cache_update_index,
                cross_attention_cache=current_cross_attention_cache,
                cross_attention_cache_update_index=cross_attention_cache_update_index,
            )
            if self_attention_cache_update_index is not None:
                self_attention_caches.append(next_self_attention_cache)
            if cross_attention_cache_update_index is not None:
                cross_attention_caches.append(next_cross_attention_cache)

        if self_attention_cache_update_index is not None:
            self_attention_cache = torch.stack(self_attention_caches, dim=1)
        if cross_attention_cache_update_index is not None:
            cross_attention_cache = torch.stack(cross_attention_caches, dim=1)

        hidden_states = x
        logits = self.backbone.token_embedding(hidden_states, reverse=True)
        return logits, hidden_states, self_attention_cache, cross_attention_cache

    def call_encoder(self, token_ids, padding_mask):
        tokens = self.backbone.token_embedding(token_ids)
        positions = self.backbone.encoder_position_embedding(tokens)
        x = self.backbone.encoder_embeddings_layer_norm(tokens + positions)
        x = self.backbone.encoder_embeddings_dropout(x)
        for transformer_layer in self.backbone.encoder_transformer_layers:
            x = transformer_layer(x, padding_mask=padding_mask)
        return x

    def _initialize_cache(self, encoder_token_ids, decoder_token_ids):
        batch_size = encoder_token_ids.shape[0]
        encoder_max_length = encoder_token_ids.shape[1]
        decoder_max_length = decoder_token_ids.shape[1]
        num_layers = self.backbone.num_layers
        num_heads = self.backbone.num_heads
        head_dim = self.backbone.hidden_dim // self.backbone.num_heads
        shape = [batch_size, num_layers, 2, decoder_max_length, num_heads, head_dim]
        self_attention_cache = torch.zeros(shape)
        shape[3] = encoder_max_length
        cross_attention_cache = torch.zeros(shape)
        return self_attention_cache, cross_attention_cache

    def _build_cache(self, encoder_token_ids, encoder_padding_mask, decoder_token_ids):
        encoder_hidden_states = self.call_encoder(token_ids=encoder_token_ids, padding_mask=encoder_padding_mask)
        self_attention_cache, cross_attention_cache = self._initialize_cache(encoder_token_ids, decoder_token_ids)
        # Seed the self-attention cache and the cross-attention cache.
        _, hidden_states, self_attention_cache, cross_attention_cache = self.call_decoder_with_cache(
            encoder_hidden_states=encoder_hidden_states,
            encoder_padding_mask=encoder_padding_mask,
            decoder_token_ids=decoder_token_ids,
            self_attention_cache=self_attention_cache,
            self_attention_cache_update_index=0,
            cross_attention_cache=cross_attention_cache,
            cross_attention_cache_update_index=0,
        )
        return hidden_states, encoder_hidden_states, self_attention_cache, cross_attention_cache

    @torch.no_grad()
    def generate_step(self, inputs, stop_token_ids=None):
        encoder_token_ids = inputs["encoder_token_ids"]
        encoder_padding_mask = inputs["encoder_padding_mask"]
        decoder_token_ids = inputs["decoder_token_ids"]
        decoder_padding_mask = inputs["decoder_padding_mask"]
        batch_size = encoder_token_ids.shape[0]

        # Create and seed cache with a single forward pass.
        hidden_states, encoder_hidden_states, self_attention_cache, cross_attention_cache = self._build_cache(
            encoder_token_ids, encoder_padding_mask, decoder_token_ids
        )
        # Compute the lengths of all user inputted tokens ids.
        row_lengths = decoder_padding_mask.to(torch.int32).sum(dim=-1)
        # Start at the first index that has no user inputted id.
        index = int(row_lengths.min())

        def next(prompt, cache, index):
            # The cache index is the index of our previous token.
            cache_index = index - 1
            num_samples = prompt.shape[0]
            prompt = prompt[:, cache_index : cache_index + 1]

            def repeat_tensor(x):
                """Repeats tensors along batch axis to match dim for beam search."""
                if x.shape[0] == num_samples:
                    return x
                return x.repeat_interleave(num_samples // batch_size, dim=0)

            logits, hidden_states, cache, _ = self.call_decoder_with_cache(
                encoder_hidden_states=repeat_tensor(encoder_hidden_states),
                encoder_padding_mask=repeat_tensor(encoder_padding_mask),
                decoder_token_ids=prompt,
                self_attention_cache=cache,
                self_attention_cache_update_index=cache_index,
                cross_attention_cache=repeat_tensor(cross_attention_cache),
                cross_attention_cache_update_index=None,
            )
            return logits.squeeze(1), hidden_states.squeeze(1), cache

        decoder_token_ids = self.sampler(
            next=next,
            prompt=decoder_token_ids,
            cache=self_attention_cache,
            index=index,
            mask=decoder_padding_mask,
            stop_token_ids=stop_token_ids,
        )

        if stop_token_ids is not None:
            # Mask of stop tokens not in the original prompt.
            end_locations = any_equal(decoder_token_ids, stop_token_ids, ~decoder_padding_mask).to(torch.int32)
            # Use cumsum to get ones in all locations after `end_locations`.
            cumsum = torch.cumsum(end_locations, dim=-1)
            overflow = cumsum - end_locations
            decoder_padding_mask = ~overflow.to(torch.bool)
        else:
            decoder_padding_mask = torch.ones_like(decoder_token_ids, dtype=torch.bool)
        return {"decoder_token_ids": decoder_token_ids, "decoder_padding_mask": decoder_padding_mask}


# --- BartSeq2SeqLMPreprocessor.generate_preprocess (StartEndPacker) ------------------------


def pack(rows, sequence_length, start_value, end_value=None):
    token_ids = torch.full((len(rows), sequence_length), PAD, dtype=torch.long)
    padding_mask = torch.zeros((len(rows), sequence_length), dtype=torch.bool)
    for b, row in enumerate(rows):
        seq = list(start_value) + list(row) + ([end_value] if end_value is not None else [])
        seq = seq[:sequence_length]
        token_ids[b, : len(seq)] = torch.tensor(seq)
        padding_mask[b, : len(seq)] = True
    return token_ids, padding_mask


def generate_preprocess(encoder_texts, decoder_texts, encoder_sequence_length, max_length):
    encoder_token_ids, encoder_padding_mask = pack(encoder_texts, encoder_sequence_length, [BOS], EOS)
    decoder_token_ids, decoder_padding_mask = pack(decoder_texts, max_length, [EOS, BOS])
    return {
        "encoder_token_ids": encoder_token_ids,
        "encoder_padding_mask": encoder_padding_mask,
        "decoder_token_ids": decoder_token_ids,
        "decoder_padding_mask": decoder_padding_mask,
    }


# --- reference: one row alone, unpadded, no cache -----------------------------------------


@torch.no_grad()
def reference_generate(model, source, prompt, max_length, stop_token_ids):
    enc = torch.tensor([[BOS] + source + [EOS]])
    dec = [EOS, BOS] + prompt
    n_prompt = len(dec)
    probs = {}
    while len(dec) < max_length:
        dec_t = torch.tensor([dec])
        logits = model(
            {
                "encoder_token_ids": enc,
                "encoder_padding_mask": torch.ones_like(enc, dtype=torch.bool),
                "decoder_token_ids": dec_t,
                "decoder_padding_mask": torch.ones_like(dec_t, dtype=torch.bool),
            }
        )
        probs[len(dec)] = torch.softmax(logits[0, -1], dim=-1)
        dec.append(int(logits[0, -1].argmax()))
        if dec[-1] in stop_token_ids:
            break
    return dec, n_prompt, probs


def run(dropout):
    torch.manual_seed(6)
    backbone = BartBackbone(
        vocabulary_size=48, num_layers=2, num_heads=4, hidden_dim=32, intermediate_dim=64,
        dropout=dropout, max_sequence_length=32,
    )
    # Toy sizes: wider dense weights and unit-scale positions (not bart_kernel_initializer's
    # 0.02) so greedy decoding does not just copy its last token through the tied embedding.
    for module in backbone.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.3)
    model = BartSeq2SeqLM(backbone).eval()

    g = torch.Generator().manual_seed(1)
    sources = [torch.randint(3, 48, (n,), generator=g).tolist() for n in (9, 3, 6, 12)]
    prompts = [[], [17, 23, 5], [40], []]
    encoder_sequence_length, max_length = 16, 14
    stop_token_ids = (EOS,)

    inputs = generate_preprocess(sources, prompts, encoder_sequence_length, max_length)
    outputs = model.generate_step(inputs, stop_token_ids=stop_token_ids)
    step_probabilities = model.sampler.step_probabilities

    for b, (source, prompt) in enumerate(zip(sources, prompts)):
        ref, n_prompt, ref_probs = reference_generate(model, source, prompt, max_length, stop_token_ids)
        keep = outputs["decoder_padding_mask"][b]
        got = outputs["decoder_token_ids"][b][keep].tolist()
        assert got == ref, (dropout, b, got, ref)
        for index in range(n_prompt, len(ref)):
            torch.testing.assert_close(step_probabilities[index][b], ref_probs[index], atol=1e-5, rtol=1e-4)

    # Teacher-forced logits on the padded batch (decoder right padded after the generated text).
    dec_ids = torch.where(outputs["decoder_padding_mask"], outputs["decoder_token_ids"], PAD)
    batch = dict(inputs, decoder_token_ids=dec_ids, decoder_padding_mask=outputs["decoder_padding_mask"])
    with torch.no_grad():
        logits = model(batch)
        for b in range(len(sources)):
            n_src = int(batch["encoder_padding_mask"][b].sum())
            n_dec = int(batch["decoder_padding_mask"][b].sum())
            alone = model(
                {
                    "encoder_token_ids": batch["encoder_token_ids"][b : b + 1, :n_src],
                    "encoder_padding_mask": batch["encoder_padding_mask"][b : b + 1, :n_src],
                    "decoder_token_ids": dec_ids[b : b + 1, :n_dec],
                    "decoder_padding_mask": batch["decoder_padding_mask"][b : b + 1, :n_dec],
                }
            )
            torch.testing.assert_close(logits[b, :n_dec], alone[0], atol=1e-4, rtol=1e-4)

    texts = [outputs["decoder_token_ids"][b][outputs["decoder_padding_mask"][b]].tolist() for b in range(len(sources))]
    print(f"dropout={dropout}: generated {texts}")


if __name__ == "__main__":
    run(dropout=0.1)  # BART's default: keras MHA takes the masked-softmax path
    run(dropout=0.0)  # no attention dropout: ops.dot_product_attention with a bool mask
    print("ok: cached batched generate matches each row alone")
