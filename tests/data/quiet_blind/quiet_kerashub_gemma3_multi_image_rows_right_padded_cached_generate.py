"""KerasHub Gemma3CausalLM generate over a batch whose rows hold 2, 1 and 0 images, ported
from Keras (ops) to plain torch at tiny sizes.

Follows keras-team/keras-hub (files at their last commits in the snapshot read, HEAD 71453d08):
  keras_hub/src/models/gemma3/gemma3_decoder_block.py @84b167e8e
      _compute_image_bidirectional_attention_mask (each contiguous run of vision_mask numbered
      by a cumsum of its rising edges; query and key in the same run see each other),
      _compute_attention_mask (merge_padding_and_attention_mask, compute_causal_mask with the
      cache length as key length, OR the image mask, then minimum with the padding mask), call
  keras_hub/src/models/gemma3/gemma3_attention.py @3fccb3efe
      call (query/key RMS norm, RoPE at cache_update_index, cache slice_update kept where
      cache_update_mask is False), _compute_attention (1/sqrt(head_dim), _mask_sliding_window
      on local layers: band |i - j| <= window - 1 sliced from row cache_update_index, GQA
      einsum, masked softmax), the "no attended tokens" wipe
  keras_hub/src/models/gemma3/gemma3_causal_lm.py @0c3b2aaef
      call_with_cache, _build_cache (prefill over the whole right-padded buffer at index 0 with
      padding_mask and vision_mask), generate_step (index = min(row_lengths); next() feeds token
      index - 1 alone, no padding or vision mask, cache_update_mask = ~padding_mask there)
  keras_hub/src/models/gemma3/gemma3_layers.py @84b167e8e
      RMSNormalization (1 + scale), Gemma3InterleaveEmbeddings (vision_indices padded with 0,
      position 0 restored after the scatter)
  keras_hub/src/models/gemma3/gemma3_causal_lm_preprocessor.py @8f221ff2c
      "\\n\\n<start_of_image>" + placeholder * num_vision_tokens_per_image + "<end_of_image>\\n\\n",
      vision_mask = token_ids == image_placeholder_id, _get_vision_indices, images padded to
      max_images_per_prompt
  keras_hub/src/models/gemma3/gemma3_backbone.py @84b167e8e (i % 6 < 5 sliding, 10k / 1M rope)
  keras_hub/src/layers/modeling/transformer_layer_utils.py @6b4044c2d
  keras_hub/src/samplers/sampler.py @a5c9e542b (prompt tokens kept where the mask is True)
The vision encoder is a small stand-in (patches averaged to num_vision_tokens_per_image tokens
and projected); the SigLIP tower plays no part in the text model's masks.

Checked against each prompt alone (unpadded, only its own images) generated greedily with no
cache, recomputing the whole sequence each step under a mask written as a double loop.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

LARGE_NEGATIVE = -1e9  # keras _large_negative_number(float32)

# Tokenizer ids (a tiny stand-in vocabulary).
PAD_ID, BOS_ID, START_OF_IMAGE, END_OF_IMAGE, IMAGE_PLACEHOLDER, DOUBLE_NEWLINE = 0, 2, 3, 4, 5, 6

CONFIG = dict(
    vocabulary_size=48,
    image_size=8,
    patch_size=4,
    num_layers=6,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=64,
    head_dim=8,
    query_head_dim_normalize=True,
    use_query_key_norm=True,
    use_sliding_window_attention=True,
    sliding_window_size=6,
    layer_norm_epsilon=1e-6,
    num_vision_tokens_per_image=4,
    max_images_per_prompt=2,
)


# ---------------------------------------------------------------- transformer_layer_utils.py
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
        mask = mask[:, None, :].to(torch.int32)
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.int32)
        if mask is None:
            return attention_mask
        return torch.minimum(mask, attention_mask)
    return mask


# ---------------------------------------------------------------- gemma3_layers.py
class RMSNormalization(nn.Module):
    def __init__(self, dim, epsilon=1e-6):
        super().__init__()
        self.epsilon = epsilon
        self.scale = nn.Parameter(torch.randn(dim) * 0.1)

    def forward(self, x):
        var = torch.mean(torch.square(x), dim=-1, keepdim=True)
        normed_inputs = x * torch.reciprocal(torch.sqrt(var + self.epsilon))
        return normed_inputs * (1 + self.scale)


class Gemma3InterleaveEmbeddings(nn.Module):
    def __init__(self, num_vision_tokens_per_image):
        super().__init__()
        self.num_vision_tokens_per_image = num_vision_tokens_per_image

    def forward(self, image_embeddings, text_embeddings, vision_indices):
        batch_size, seq_length, embedding_dim = text_embeddings.shape
        num_images = image_embeddings.shape[0]
        flat_text_embeddings = text_embeddings.reshape(batch_size * seq_length, embedding_dim)
        flat_image_embeddings = image_embeddings.reshape(
            num_images * self.num_vision_tokens_per_image, embedding_dim
        )
        to_add = (torch.arange(batch_size, dtype=torch.int64) * seq_length)[:, None]
        vision_indices = vision_indices + to_add
        indices = vision_indices.reshape(-1)
        # Before reconstructing, store the 0th index so that we can restore it later.
        zeroth_index_text_embeddings = flat_text_embeddings[to_add[:, 0]]
        reconstructed_embedding = flat_text_embeddings.clone()
        reconstructed_embedding[indices] = flat_image_embeddings
        # `vision_indices` is padded with the 0th index: restore it.
        reconstructed_embedding[to_add[:, 0]] = zeroth_index_text_embeddings
        return reconstructed_embedding.reshape(batch_size, seq_length, embedding_dim)


class RotaryEmbedding(nn.Module):
    def __init__(self, max_wavelength=10000.0, scaling_factor=1.0):
        super().__init__()
        self.max_wavelength = max_wavelength
        self.scaling_factor = scaling_factor

    def forward(self, inputs, start_index=0):
        # inputs: (batch, seq, heads, head_dim)
        rotary_dim = inputs.shape[-1]
        inverse_freq = 1.0 / (
            self.max_wavelength ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        )
        inverse_freq = inverse_freq / self.scaling_factor
        positions = torch.arange(inputs.shape[1], dtype=torch.float64) + float(start_index)
        freq = torch.einsum("i,j->ij", positions, inverse_freq)
        embedding = torch.cat((freq, freq), dim=-1)[None, :, None, :]
        x1, x2 = torch.chunk(inputs, 2, dim=-1)
        half_rot_tensor = torch.cat((-x2, x1), dim=-1)
        return inputs * torch.cos(embedding) + half_rot_tensor * torch.sin(embedding)


# ---------------------------------------------------------------- gemma3_attention.py
class CachedGemma3Attention(nn.Module):
    def __init__(self, cfg, use_sliding_window_attention, rope_wavelength):
        super().__init__()
        self.num_query_heads = cfg["num_query_heads"]
        self.num_key_value_heads = cfg["num_key_value_heads"]
        self.head_dim = cfg["head_dim"]
        self.hidden_dim = cfg["hidden_dim"]
        self.query_head_dim_normalize = cfg["query_head_dim_normalize"]
        self.use_query_key_norm = cfg["use_query_key_norm"]
        self.use_sliding_window_attention = use_sliding_window_attention
        self.sliding_window_size = cfg["sliding_window_size"]
        hd = self.hidden_dim
        self.query_dense = nn.Linear(hd, self.num_query_heads * self.head_dim, bias=False)
        self.key_dense = nn.Linear(hd, self.num_key_value_heads * self.head_dim, bias=False)
        self.value_dense = nn.Linear(hd, self.num_key_value_heads * self.head_dim, bias=False)
        self.output_dense = nn.Linear(self.num_query_heads * self.head_dim, hd, bias=False)
        self.query_norm = RMSNormalization(self.head_dim, cfg["layer_norm_epsilon"])
        self.key_norm = RMSNormalization(self.head_dim, cfg["layer_norm_epsilon"])
        self.rope_layer = RotaryEmbedding(max_wavelength=rope_wavelength)

    def _mask_sliding_window(self, attention_mask, cache_update_index=0):
        batch_size, query_len, key_len = attention_mask.shape
        all_ones = torch.ones((key_len, key_len), dtype=torch.bool)
        sliding_mask = torch.triu(all_ones, -1 * self.sliding_window_size + 1) & torch.tril(
            all_ones, self.sliding_window_size - 1
        )
        sliding_mask = sliding_mask[cache_update_index:cache_update_index + query_len, :key_len]
        return torch.logical_and(attention_mask.bool(), sliding_mask[None])

    def _compute_attention(self, q, k, v, attention_mask, cache_update_index=0):
        if self.query_head_dim_normalize:
            query_normalization = 1 / math.sqrt(self.head_dim)
        else:
            query_normalization = 1 / math.sqrt(self.hidden_dim // self.num_query_heads)

        if self.use_sliding_window_attention and attention_mask is not None:
            attention_mask = self._mask_sliding_window(attention_mask, cache_update_index)

        q = q * query_normalization
        b, q_len = q.shape[:2]
        q = q.reshape(b, q_len, self.num_key_value_heads,
                      self.num_query_heads // self.num_key_value_heads, self.head_dim)
        attention_logits = torch.einsum("btkgh,bskh->bkgts", q, k)
        # keras.layers.Softmax with a mask: additive large negative, softmax, times the mask.
        mask = attention_mask[:, None, None, :, :].to(attention_logits.dtype)
        attention_logits = attention_logits + (1.0 - mask) * LARGE_NEGATIVE
        attention_softmax = torch.softmax(attention_logits, dim=-1) * mask
        results = torch.einsum("bkgts,bskh->btkgh", attention_softmax, v)
        return results.reshape(b, q_len, self.num_query_heads, self.head_dim)

    def _split(self, t, heads):
        return t.reshape(t.shape[0], t.shape[1], heads, self.head_dim)

    def forward(self, x, attention_mask, cache=None, cache_update_index=0, cache_update_mask=None):
        query = self._split(self.query_dense(x), self.num_query_heads)
        if self.use_query_key_norm:
            query = self.query_norm(query)
        query = self.rope_layer(query, cache_update_index)

        key_update = self._split(self.key_dense(x), self.num_key_value_heads)
        if self.use_query_key_norm:
            key_update = self.key_norm(key_update)
        key_update = self.rope_layer(key_update, cache_update_index)
        value_update = self._split(self.value_dense(x), self.num_key_value_heads)

        key_cache, value_cache = cache[:, 0], cache[:, 1]
        t = x.shape[1]
        if cache_update_mask is not None:
            keep = cache_update_mask[:, :, None, None]
            key_update = torch.where(keep, key_update, key_cache[:, cache_update_index:cache_update_index + t])
            value_update = torch.where(keep, value_update, value_cache[:, cache_update_index:cache_update_index + t])
        key = key_cache.clone()
        value = value_cache.clone()
        key[:, cache_update_index:cache_update_index + t] = key_update
        value[:, cache_update_index:cache_update_index + t] = value_update
        cache = torch.stack((key, value), dim=1)

        attention_vec = self._compute_attention(query, key, value, attention_mask, cache_update_index)

        # Wipe attn vec if there are no attended tokens.
        no_attended_tokens = torch.all(attention_mask == 0, dim=-1, keepdim=True)[..., None]
        attention_vec = torch.where(no_attended_tokens, torch.zeros_like(attention_vec), attention_vec)
        attention_output = self.output_dense(attention_vec.reshape(x.shape[0], t, -1))
        return attention_output, cache


# ---------------------------------------------------------------- gemma3_decoder_block.py
class Gemma3DecoderBlock(nn.Module):
    def __init__(self, cfg, use_sliding_window_attention, rope_wavelength):
        super().__init__()
        hd, eps = cfg["hidden_dim"], cfg["layer_norm_epsilon"]
        self.pre_attention_norm = RMSNormalization(hd, eps)
        self.post_attention_norm = RMSNormalization(hd, eps)
        self.pre_ffw_norm = RMSNormalization(hd, eps)
        self.post_ffw_norm = RMSNormalization(hd, eps)
        self.attention = CachedGemma3Attention(cfg, use_sliding_window_attention, rope_wavelength)
        self.gating_ffw = nn.Linear(hd, cfg["intermediate_dim"], bias=False)
        self.gating_ffw_2 = nn.Linear(hd, cfg["intermediate_dim"], bias=False)
        self.ffw_linear = nn.Linear(cfg["intermediate_dim"], hd, bias=False)

    def _compute_image_bidirectional_attention_mask(self, vision_mask):
        # vision_mask is False for text, True for images. (bsz, seq_len).
        bidirectional_mask = vision_mask
        # Left pad with 0.
        padded_mask = F.pad(bidirectional_mask.to(torch.int32), (1, 0), value=0)
        # Assign unique indices to every contiguous span of True.
        boundary = (padded_mask[..., 1:] > padded_mask[..., :-1]).to(torch.int32)
        numbered_boundary = torch.cumsum(boundary, -1)
        indices = bidirectional_mask.to(torch.int32) * numbered_boundary
        indices_expanded_1 = indices[:, None, :]
        indices_expanded_2 = indices[:, :, None]
        return torch.logical_and(indices_expanded_1 == indices_expanded_2, indices_expanded_2.bool())

    def _compute_attention_mask(self, x, padding_mask, vision_mask, cache, cache_update_index):
        decoder_mask = merge_padding_and_attention_mask(x, padding_mask, None)
        batch_size = x.shape[0]
        input_length = output_length = x.shape[1]
        if cache is not None:
            input_length = cache.shape[2]
        causal_mask = compute_causal_mask(batch_size, input_length, output_length, cache_update_index)
        # Image tokens attend to each other in both directions, within the same image.
        if vision_mask is not None:
            bidirectional_image_mask = self._compute_image_bidirectional_attention_mask(vision_mask)
            causal_mask = torch.logical_or(causal_mask, bidirectional_image_mask)
        # Respect the padding mask.
        causal_mask = causal_mask.to(torch.int32)
        if decoder_mask is not None:
            causal_mask = torch.minimum(decoder_mask, causal_mask)
        return causal_mask

    def forward(self, x, padding_mask=None, vision_mask=None, cache=None,
                cache_update_index=0, cache_update_mask=None):
        normalized_x = self.pre_attention_norm(x)
        attention_mask = self._compute_attention_mask(
            normalized_x, padding_mask, vision_mask, cache, cache_update_index
        )
        attention, new_cache = self.attention(
            normalized_x, attention_mask=attention_mask, cache=cache,
            cache_update_index=cache_update_index, cache_update_mask=cache_update_mask,
        )
        attention = self.post_attention_norm(attention)
        attention_x = x + attention
        normalized_x = self.pre_ffw_norm(attention_x)
        x1 = self.gating_ffw(normalized_x)
        x2 = self.gating_ffw_2(normalized_x)
        x = F.gelu(x1, approximate="tanh") * x2
        x = self.post_ffw_norm(self.ffw_linear(x))
        return x + attention_x, new_cache


# ---------------------------------------------------------------- gemma3_backbone.py
class TinyVisionEncoder(nn.Module):
    """Stand-in for Gemma3VisionEncoder: (B, N, H, W, 3) -> (B * N, tokens, hidden)."""

    def __init__(self, cfg):
        super().__init__()
        p = cfg["patch_size"]
        self.p = p
        self.tokens = cfg["num_vision_tokens_per_image"]
        self.proj = nn.Linear(p * p * 3, cfg["hidden_dim"])
        self.norm = RMSNormalization(cfg["hidden_dim"], cfg["layer_norm_epsilon"])

    def forward(self, images):
        b, n, h, w, c = images.shape
        x = images.reshape(b * n, h // self.p, self.p, w // self.p, self.p, c)
        x = x.permute(0, 1, 3, 2, 4, 5).reshape(b * n, -1, self.p * self.p * c)
        return self.norm(self.proj(x))[:, : self.tokens]


class Gemma3Backbone(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.hidden_dim = cfg["hidden_dim"]
        self.num_layers = cfg["num_layers"]
        self.num_key_value_heads = cfg["num_key_value_heads"]
        self.head_dim = cfg["head_dim"]
        self.token_embedding = nn.Embedding(cfg["vocabulary_size"], cfg["hidden_dim"])
        self.vision_encoder = TinyVisionEncoder(cfg)
        self.interleave_embeddings = Gemma3InterleaveEmbeddings(cfg["num_vision_tokens_per_image"])
        layers = []
        for i in range(cfg["num_layers"]):
            sliding_window = cfg["use_sliding_window_attention"] and (i % 6 < 5)
            rope_wavelength = 10_000.0 if sliding_window else 1_000_000.0
            layers.append(Gemma3DecoderBlock(cfg, sliding_window, rope_wavelength))
        self.transformer_layers = nn.ModuleList(layers)
        self.layer_norm = RMSNormalization(cfg["hidden_dim"], cfg["layer_norm_epsilon"])


# ---------------------------------------------------------------- gemma3_causal_lm.py
class Gemma3CausalLM(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone

    def call_with_cache(self, token_ids, cache, cache_update_index, img_embeddings=None,
                        vision_mask=None, padding_mask=None, vision_indices=None,
                        cache_update_mask=None):
        text_embeddings = self.backbone.token_embedding(token_ids)
        text_embeddings = text_embeddings * math.sqrt(self.backbone.hidden_dim)
        if img_embeddings is not None:
            x = self.backbone.interleave_embeddings(img_embeddings, text_embeddings, vision_indices)
        else:
            x = text_embeddings
        caches = []
        for i, transformer_layer in enumerate(self.backbone.transformer_layers):
            x, next_cache = transformer_layer(
                x, cache=cache[:, i], cache_update_index=cache_update_index,
                padding_mask=padding_mask, vision_mask=vision_mask,
                cache_update_mask=cache_update_mask,
            )
            caches.append(next_cache)
        cache = torch.stack(caches, dim=1)
        hidden_states = x = self.backbone.layer_norm(x)
        logits = x @ self.backbone.token_embedding.weight.T
        return logits, hidden_states, cache

    def _build_cache(self, token_ids, img_embeddings, vision_mask, padding_mask, vision_indices):
        batch_size, max_length = token_ids.shape
        shape = [batch_size, self.backbone.num_layers, 2, max_length,
                 self.backbone.num_key_value_heads, self.backbone.head_dim]
        cache = torch.zeros(shape)
        logits, hidden_states, cache = self.call_with_cache(
            token_ids=token_ids, img_embeddings=img_embeddings, vision_mask=vision_mask,
            cache=cache, cache_update_index=0, padding_mask=padding_mask,
            vision_indices=vision_indices, cache_update_mask=None,
        )
        return logits, hidden_states, cache

    @torch.no_grad()
    def generate_step(self, inputs):
        token_ids = inputs["token_ids"].clone()
        padding_mask = inputs["padding_mask"]
        images, vision_mask, vision_indices = inputs["images"], inputs["vision_mask"], inputs["vision_indices"]
        img_embeddings = self.backbone.vision_encoder(images)

        prefill_logits, hidden_states, cache = self._build_cache(
            token_ids, img_embeddings, vision_mask, padding_mask, vision_indices
        )
        row_lengths = padding_mask.to(torch.int32).sum(-1)
        index = int(row_lengths.min())

        def next(prompt, cache, index):
            cache_update_index = index - 1
            prompt = prompt[:, index - 1:index]
            sliced_cache_update_mask = (~padding_mask)[:, index - 1:index]
            logits, hidden_states, cache = self.call_with_cache(
                token_ids=prompt, cache=cache, cache_update_index=cache_update_index,
                cache_update_mask=sliced_cache_update_mask,
            )
            return logits[:, 0], hidden_states[:, 0], cache

        # keras_hub GreedySampler.__call__ (stop_token_ids=None: run to max_length).
        max_length = token_ids.shape[1]
        step_logits = {}
        while index < max_length:
            logits, _, cache = next(token_ids, cache, index)
            step_logits[index] = logits
            next_token = torch.argmax(logits, dim=-1)
            next_token = torch.where(padding_mask[:, index], token_ids[:, index], next_token)
            token_ids[:, index] = next_token
            index += 1
        return token_ids, prefill_logits, step_logits


# ---------------------------------------------------------------- preprocessor (generate_preprocess)
def build_prompt(text_chunks):
    """text_chunks: list of token lists; an image between each pair, as "<start_of_image>" expands."""
    ids = [BOS_ID]
    n = CONFIG["num_vision_tokens_per_image"]
    for k, chunk in enumerate(text_chunks):
        ids += chunk
        if k < len(text_chunks) - 1:
            ids += [DOUBLE_NEWLINE, START_OF_IMAGE] + [IMAGE_PLACEHOLDER] * n + [END_OF_IMAGE, DOUBLE_NEWLINE]
    return ids


def get_vision_indices(vision_mask):
    batch_size, _ = vision_mask.shape
    width = CONFIG["max_images_per_prompt"] * CONFIG["num_vision_tokens_per_image"]
    out = torch.zeros(batch_size, width, dtype=torch.int64)
    for b in range(batch_size):
        idx = torch.nonzero(vision_mask[b]).flatten()
        out[b, : len(idx)] = idx
    return out


def generate_preprocess(prompts, images_per_row, sequence_length):
    batch = len(prompts)
    token_ids = torch.full((batch, sequence_length), PAD_ID, dtype=torch.int64)
    padding_mask = torch.zeros(batch, sequence_length, dtype=torch.bool)
    for b, ids in enumerate(prompts):
        token_ids[b, : len(ids)] = torch.tensor(ids)
        padding_mask[b, : len(ids)] = True
    s = CONFIG["image_size"]
    images = torch.zeros(batch, CONFIG["max_images_per_prompt"], s, s, 3)
    for b, imgs in enumerate(images_per_row):
        for k, img in enumerate(imgs):
            images[b, k] = img
    vision_mask = token_ids == IMAGE_PLACEHOLDER
    return {
        "token_ids": token_ids,
        "padding_mask": padding_mask,
        "images": images,
        "vision_mask": vision_mask,
        "vision_indices": get_vision_indices(vision_mask),
    }


# ---------------------------------------------------------------- reference
@torch.no_grad()
def reference_logits(model, ids, imgs):
    """One prompt alone, no cache, no padding; the mask written out pair by pair."""
    bb = model.backbone
    T = len(ids)
    tok = torch.tensor(ids)
    x = bb.token_embedding(tok) * math.sqrt(bb.hidden_dim)
    if imgs:
        emb = bb.vision_encoder(torch.stack(imgs)[None]).reshape(-1, bb.hidden_dim)
        positions = [t for t in range(T) if ids[t] == IMAGE_PLACEHOLDER]
        x = x.clone()
        x[positions] = emb
    image_of = []
    current, inside = 0, False
    for t in range(T):
        if ids[t] == IMAGE_PLACEHOLDER:
            if not inside:
                current += 1
            inside = True
            image_of.append(current)
        else:
            inside = False
            image_of.append(0)
    x = x[None]
    for layer in bb.transformer_layers:
        att = layer.attention
        window = att.sliding_window_size if att.use_sliding_window_attention else None
        allowed = torch.zeros(T, T, dtype=torch.bool)
        for i in range(T):
            for j in range(T):
                ok = j <= i or (image_of[i] != 0 and image_of[i] == image_of[j])
                if window is not None and abs(i - j) >= window:
                    ok = False
                allowed[i, j] = ok
        h = layer.pre_attention_norm(x)
        q = att.query_norm(att._split(att.query_dense(h), att.num_query_heads))
        k = att.key_norm(att._split(att.key_dense(h), att.num_key_value_heads))
        v = att._split(att.value_dense(h), att.num_key_value_heads)
        q, k = att.rope_layer(q), att.rope_layer(k)
        rep = att.num_query_heads // att.num_key_value_heads
        q = q.transpose(1, 2)
        k = k.repeat_interleave(rep, dim=2).transpose(1, 2)
        v = v.repeat_interleave(rep, dim=2).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(att.head_dim)
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, T, -1)
        x = x + layer.post_attention_norm(att.output_dense(o))
        n = layer.pre_ffw_norm(x)
        f = F.gelu(layer.gating_ffw(n), approximate="tanh") * layer.gating_ffw_2(n)
        x = x + layer.post_ffw_norm(layer.ffw_linear(f))
    x = bb.layer_norm(x)
    return (x @ bb.token_embedding.weight.T)[0]


@torch.no_grad()
def reference_generate(model, ids, imgs, max_length):
    ids = list(ids)
    prompt_logits = reference_logits(model, ids, imgs)
    step_logits = {}
    while len(ids) < max_length:
        logits = reference_logits(model, ids, imgs)[-1]
        step_logits[len(ids)] = logits
        ids.append(int(torch.argmax(logits)))
    return ids, prompt_logits, step_logits


def main():
    model = Gemma3CausalLM(Gemma3Backbone(CONFIG)).eval()
    s = CONFIG["image_size"]

    text = lambda *t: [7 + (u % 40) for u in t]
    prompts = [
        build_prompt([text(1, 2), text(3, 4, 5), text(6, 7)]),          # two images
        build_prompt([text(8, 9, 10, 11, 12, 13), text(14, 15, 16)]),  # one image
        build_prompt([text(17, 18, 19, 20, 21)]),                      # text only
    ]
    images_per_row = [
        [torch.rand(s, s, 3), torch.rand(s, s, 3)],
        [torch.rand(s, s, 3)],
        [],
    ]
    sequence_length = max(len(p) for p in prompts) + 6
    inputs = generate_preprocess(prompts, images_per_row, sequence_length)

    token_ids, prefill_logits, step_logits = model.generate_step(inputs)

    worst = 0.0
    for b, (ids, imgs) in enumerate(zip(prompts, images_per_row)):
        ref_ids, ref_prompt_logits, ref_step_logits = reference_generate(model, ids, imgs, sequence_length)
        got = token_ids[b].tolist()
        assert got == ref_ids, (b, got, ref_ids)
        # The prefill's logits on every real token of the row.
        err = (prefill_logits[b, : len(ids)] - ref_prompt_logits).abs().max().item()
        worst = max(worst, err)
        # Each cached step that produced a token for this row.
        for index, logits in ref_step_logits.items():
            err = (step_logits[index][b] - logits).abs().max().item()
            worst = max(worst, err)
        print(f"row {b}: {len(imgs)} image(s), prompt {len(ids)} tokens, generated {got[len(ids):]}")
    assert worst < 1e-9, worst
    print(f"batched cached generate == per-prompt uncached reference (max logit err {worst:.2e})")


if __name__ == "__main__":
    main()
