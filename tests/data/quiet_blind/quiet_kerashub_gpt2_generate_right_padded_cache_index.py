"""KerasHub GPT2CausalLM generate / score, ported from Keras (ops) to plain torch at tiny sizes.

Follows keras-team/keras-hub:
  keras_hub/src/models/gpt2/gpt2_causal_lm.py @441d0784985fce2923e6e3a2c2ff224533ffb540
      call_with_cache (one causal mask per step, compute_causal_mask(batch, cache_len,
      seq_len, cache_update_index), shared by all layers), _build_cache (zeros cache of
      max_length slots seeded by one call over the whole right-padded token_ids at index 0),
      generate_step (index = min(row_lengths); next() feeds token index-1 with
      cache_update_index = index - 1), score (decoder_padding_mask)
  keras_hub/src/layers/modeling/transformer_layer_utils.py @2afaadd42516f65e0fdc6b4f688bbb3c21c05082
      compute_causal_mask (i + cache_index >= j), merge_padding_and_attention_mask
      (padding_mask[:, None, :] min attention_mask)
  keras_hub/src/layers/modeling/transformer_decoder.py @1dfe1075c4729c20e13c0f7d6eb49c6af90fbe2d
      call_cached / _compute_self_attention_mask (cache length as key length)
  keras_hub/src/layers/modeling/cached_multi_head_attention.py (slice_update of key/value
      at cache_update_index into the (B, 2, max_len, H, D) cache, then attention over all slots)
  keras_hub/src/samplers/sampler.py @05b1f0e8f308a09d2d694055aa4a914a2289b21c
      Sampler.__call__ (prompt tokens kept where mask is True, greedy next token elsewhere)
  keras MultiHeadAttention._masked_softmax / keras.layers.Softmax (adder = (1 - mask) * -1e9,
      softmax, then multiplied by the mask).

Prompts are right padded (GPT2CausalLMPreprocessor.generate_preprocess). The cached decode
uses no padding mask: every pad slot lies at or after the current index, so the causal mask
hides it until the step that overwrites it. Checked against each prompt generated alone,
unpadded, with a cache-free loop; score() on the padded batch against each row alone.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

LARGE_NEGATIVE = -1e9  # keras _large_negative_number(float32)


def compute_causal_mask(batch_size, input_length, output_length, cache_index=0):
    i = torch.arange(output_length, dtype=torch.float32)
    i = i + float(cache_index)
    i = i[:, None]
    j = torch.arange(input_length, dtype=torch.float32)
    mask = (i >= j)[None]
    return mask.expand(batch_size, output_length, input_length)


def merge_padding_and_attention_mask(padding_mask, attention_mask):
    mask = padding_mask
    if mask is not None:
        mask = mask[:, None, :].to(torch.int32)
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.int32)
        if mask is None:
            return attention_mask
        return torch.minimum(mask, attention_mask)
    return mask


def masked_softmax(scores, mask):
    # keras MultiHeadAttention._masked_softmax: expand the (B, T, S) mask over heads
    if mask is not None:
        mask = mask[:, None, :, :]
        adder = (1.0 - mask.to(scores.dtype)) * LARGE_NEGATIVE
        scores = scores + adder
    out = torch.softmax(scores, dim=-1)
    if mask is not None:
        out = out * mask.to(out.dtype)
    return out


class CachedMultiHeadAttention(nn.Module):
    def __init__(self, num_heads, key_dim, hidden):
        super().__init__()
        self.num_heads, self.key_dim = num_heads, key_dim
        self.query_dense = nn.Linear(hidden, num_heads * key_dim)
        self.key_dense = nn.Linear(hidden, num_heads * key_dim)
        self.value_dense = nn.Linear(hidden, num_heads * key_dim)
        self.output_dense = nn.Linear(num_heads * key_dim, hidden)

    def _split(self, x):
        return x.view(x.shape[0], x.shape[1], self.num_heads, self.key_dim)

    def forward(self, query, value, attention_mask=None, cache=None, cache_update_index=None):
        key = value
        q = self._split(self.query_dense(query))
        if cache is not None:
            key_cache = cache[:, 0, ...]
            value_cache = cache[:, 1, ...]
            if cache_update_index is None:
                k, v = key_cache, value_cache
            else:
                key_update = self._split(self.key_dense(key))
                value_update = self._split(self.value_dense(value))
                start = cache_update_index
                n = key_update.shape[1]
                k = key_cache.clone(); k[:, start:start + n] = key_update      # ops.slice_update
                v = value_cache.clone(); v[:, start:start + n] = value_update
                cache = torch.stack((k, v), dim=1)
        else:
            k = self._split(self.key_dense(key))
            v = self._split(self.value_dense(value))
        q = q * (1.0 / math.sqrt(float(self.key_dim)))
        scores = torch.einsum("aecd,abcd->acbe", k, q)  # (B, H, T, S)
        w = masked_softmax(scores, attention_mask)
        out = torch.einsum("acbe,aecd->abcd", w, v)
        out = self.output_dense(out.reshape(out.shape[0], out.shape[1], -1))
        return (out, cache) if cache is not None else out


class TransformerDecoder(nn.Module):
    """normalize_first=True (GPT-2), no cross attention."""

    def __init__(self, hidden, heads, intermediate):
        super().__init__()
        self.self_attention_layer = CachedMultiHeadAttention(heads, hidden // heads, hidden)
        self.self_attention_layer_norm = nn.LayerNorm(hidden, eps=1e-5)
        self.feedforward_layer_norm = nn.LayerNorm(hidden, eps=1e-5)
        self.ff_in = nn.Linear(hidden, intermediate)
        self.ff_out = nn.Linear(intermediate, hidden)

    def _feedforward(self, x):
        residual = x
        x = self.feedforward_layer_norm(x)
        return self.ff_out(F.gelu(self.ff_in(x), approximate="tanh")) + residual

    def forward(self, decoder_sequence, decoder_padding_mask=None):
        # call(): _compute_self_attention_mask with use_causal_mask=True, no cache
        decoder_mask = merge_padding_and_attention_mask(decoder_padding_mask, None)
        b, t = decoder_sequence.shape[:2]
        causal_mask = compute_causal_mask(b, t, t, 0)
        mask = torch.minimum(decoder_mask, causal_mask.to(torch.int32)) if decoder_mask is not None else causal_mask
        x = self.self_attention_layer_norm(decoder_sequence)
        x = self.self_attention_layer(x, x, attention_mask=mask) + decoder_sequence
        return self._feedforward(x)

    def call_cached(self, decoder_sequence, self_attention_cache, self_attention_cache_update_index,
                    self_attention_mask=None):
        residual = decoder_sequence
        x = self.self_attention_layer_norm(decoder_sequence)
        x, self_attention_cache = self.self_attention_layer(
            x, x, attention_mask=self_attention_mask, cache=self_attention_cache,
            cache_update_index=self_attention_cache_update_index)
        x = x + residual
        return self._feedforward(x), self_attention_cache


class GPT2CausalLM(nn.Module):
    def __init__(self, vocabulary_size=50, num_layers=2, num_heads=4, hidden_dim=32,
                 intermediate_dim=64, max_sequence_length=32):
        super().__init__()
        self.num_layers, self.num_heads, self.hidden_dim = num_layers, num_heads, hidden_dim
        self.token_embedding = nn.Embedding(vocabulary_size, hidden_dim)
        self.position_embedding = nn.Embedding(max_sequence_length, hidden_dim)
        self.transformer_layers = nn.ModuleList(
            [TransformerDecoder(hidden_dim, num_heads, intermediate_dim) for _ in range(num_layers)])
        self.layer_norm = nn.LayerNorm(hidden_dim, eps=1e-5)

    def _logits(self, x):  # ReversibleEmbedding(reverse=True)
        return x @ self.token_embedding.weight.T

    def _embed(self, token_ids, start_index=0):
        pos = torch.arange(start_index, start_index + token_ids.shape[1])
        return self.token_embedding(token_ids) + self.position_embedding(pos)[None]

    def call_with_cache(self, token_ids, cache, cache_update_index):
        x = self._embed(token_ids, start_index=cache_update_index)
        batch_size, seq_len = token_ids.shape
        cache_len = cache.shape[3]  # max_length from cache shape
        causal_mask = compute_causal_mask(batch_size, cache_len, seq_len, cache_update_index)
        caches = []
        for i, layer in enumerate(self.transformer_layers):
            current_cache = cache[:, i, ...]
            x, next_cache = layer.call_cached(x, self_attention_cache=current_cache,
                                              self_attention_cache_update_index=cache_update_index,
                                              self_attention_mask=causal_mask)
            caches.append(next_cache)
        cache = torch.stack(caches, dim=1)
        hidden_states = x = self.layer_norm(x)
        return self._logits(x), hidden_states, cache

    def _build_cache(self, token_ids):
        batch_size, max_length = token_ids.shape
        head_dim = self.hidden_dim // self.num_heads
        shape = [batch_size, self.num_layers, 2, max_length, self.num_heads, head_dim]
        cache = torch.zeros(shape)
        # Seed the cache.
        _, hidden_states, cache = self.call_with_cache(token_ids, cache, 0)
        return hidden_states, cache

    def generate_step(self, inputs):
        token_ids, padding_mask = inputs["token_ids"], inputs["padding_mask"]
        hidden_states, cache = self._build_cache(token_ids)
        row_lengths = padding_mask.to(torch.int32).sum(-1)
        index = int(row_lengths.min())

        def next(prompt, cache, index):
            # The cache index is the index of our previous token.
            cache_update_index = index - 1
            prompt = prompt[:, cache_update_index:cache_update_index + 1]
            logits, hidden_states, cache = self.call_with_cache(prompt, cache, cache_update_index)
            return logits.squeeze(1), hidden_states.squeeze(1), cache

        # GreedySampler.__call__ / Sampler.__call__ (stop_token_ids=None)
        self.step_logits = []
        prompt, mask = token_ids.clone(), padding_mask.bool()
        max_length = prompt.shape[1]
        while index < max_length:
            logits, _, cache = next(prompt, cache, index)
            self.step_logits.append((index, logits))
            probabilities = torch.softmax(logits.float(), dim=-1)
            next_token = torch.argmax(probabilities, dim=-1)
            # Preserve prompt tokens
            next_token = torch.where(mask[:, index], prompt[:, index], next_token)
            prompt[:, index] = next_token
            index += 1
        return {"token_ids": prompt, "padding_mask": torch.ones_like(prompt, dtype=torch.bool)}

    def score(self, token_ids, padding_mask=None):
        if padding_mask is None:
            padding_mask = torch.ones(token_ids.shape[:2])
        x = self._embed(token_ids)
        for layer in self.transformer_layers:
            x = layer(x, decoder_padding_mask=padding_mask)
        return self._logits(self.layer_norm(x))


# ---------------- independent reference ----------------
def reference_logits(model, ids):
    """One unpadded row, no cache, no mask: query t attends to the keys sliced to 0..t."""
    x = model._embed(ids[None])
    T = x.shape[1]
    for layer in model.transformer_layers:
        h = layer.self_attention_layer_norm(x)
        att = layer.self_attention_layer
        q = att._split(att.query_dense(h))
        k = att._split(att.key_dense(h))
        v = att._split(att.value_dense(h))
        rows = []
        for t in range(T):
            s = torch.einsum("bhd,bkhd->bhk", q[:, t], k[:, :t + 1]) / math.sqrt(att.key_dim)
            rows.append(torch.einsum("bhk,bkhd->bhd", torch.softmax(s, -1), v[:, :t + 1]))
        o = att.output_dense(torch.stack(rows, 1).reshape(1, T, -1))
        x = layer._feedforward(o + x)
    return model._logits(model.layer_norm(x))[0]


def reference_generate(model, ids, max_length):
    ids = ids.clone()
    while len(ids) < max_length:
        ids = torch.cat([ids, reference_logits(model, ids)[-1].argmax()[None]])
    return ids


@torch.no_grad()
def main():
    model = GPT2CausalLM().eval()
    for name, prm in model.named_parameters():  # make the blocks matter next to the tied embedding
        if "transformer_layers" in name and prm.dim() == 2:
            prm.mul_(3.0)
    max_length = 12
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 50, (n,), generator=g) for n in (3, 6, 4)]
    token_ids = torch.zeros(len(prompts), max_length, dtype=torch.long)  # pad id 0, right padded
    padding_mask = torch.zeros(len(prompts), max_length, dtype=torch.bool)
    for r, p in enumerate(prompts):
        token_ids[r, :len(p)] = p
        padding_mask[r, :len(p)] = True

    ok = True
    out = model.generate_step({"token_ids": token_ids, "padding_mask": padding_mask})["token_ids"]
    for r, p in enumerate(prompts):
        ref = reference_generate(model, p, max_length)
        same = torch.equal(out[r], ref)
        # logits of every cached step (predicting position index) vs the full recompute
        ref_logits = reference_logits(model, out[r])
        for index, logits in model.step_logits:
            same &= torch.allclose(logits[r], ref_logits[index - 1], atol=1e-4)
        print(f"row {r} (prompt {len(p)}): {out[r].tolist()} match alone: {same}")
        ok &= same

    # score() on the right-padded batch with its padding mask vs each row alone
    lens = [len(p) + 3 for p in prompts]
    batch = torch.zeros(len(prompts), max(lens), dtype=torch.long)
    pm = torch.zeros(len(prompts), max(lens), dtype=torch.bool)
    for r, n in enumerate(lens):
        batch[r, :n] = out[r, :n]
        pm[r, :n] = True
    scored = model.score(batch, pm)
    for r, n in enumerate(lens):
        same = torch.allclose(scored[r, :n], reference_logits(model, out[r, :n]), atol=1e-4)
        print(f"score row {r}: real positions match alone: {same}")
        ok &= same
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
