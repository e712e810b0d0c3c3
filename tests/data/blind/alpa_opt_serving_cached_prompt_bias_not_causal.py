# Citation: alpa-projects/alpa#608 (commit 7356392b, "[OPT] Fix attention bias when cache is used"),
# examples/opt_serving/model/opt_model.py (OPTSelfAttention) and test_cache.py; Flax/JAX code ported to torch.
#
# Alpa's OPT serving model writes new keys/values into a preallocated cache with
# dynamic_update_slice at cache_index and builds an additive attention bias over all
# max_length cache slots. Before the fix that bias had shape [1, 1, 1, max_length] and only
# hid the slots at or beyond cache_index + num_updated_cache_vectors, so when a whole
# prompt (input length > 1) went through the cached path every prompt token also saw the
# later prompt tokens. The fix builds a [1, 1, num_updated_cache_vectors, max_length] bias
# where row i hides slots > cache_index + i.
#
# This runs test_cache.py's "decompose_input=False" path (the whole prompt through the
# cached forward in one step), then decodes a few tokens greedily one at a time, as the
# serving wrapper does.
import math
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


@dataclass(frozen=True)
class OPTConfig:
    decoder_layers: int = 2
    max_target_positions: int = 32
    decoder_embed_dim: int = 32
    decoder_attention_heads: int = 4
    decoder_input_dim: int = 32
    decoder_ffn_embed_dim: int = 64
    pad: int = 1
    activation_fn: str = "relu"
    dtype: torch.dtype = torch.float32
    no_scale_embedding: bool = True
    decoder_learned_pos: bool = True
    decoder_normalize_before: bool = True
    share_decoder_input_output_embed: bool = True
    version: int = 3
    vocab_size: int = 64
    layer_norm_eps: float = 0.00001


ACT2FN = {"relu": F.relu, "gelu": F.gelu}


def dot_product_attention_weights(query, key, bias=None):
    # flax.linen.attention.dot_product_attention_weights, "...qhd,...khd->...hqk"
    depth = query.shape[-1]
    query = query / math.sqrt(depth)
    attn_weights = torch.einsum("...qhd,...khd->...hqk", query, key)
    if bias is not None:
        attn_weights = attn_weights + bias
    return torch.softmax(attn_weights, dim=-1)


class OPTEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_scale = 1.0 if config.no_scale_embedding else math.sqrt(config.decoder_embed_dim)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.decoder_input_dim)
        self.position_embeddings = nn.Embedding(config.max_target_positions + config.pad + 1,
                                                config.decoder_embed_dim)

    def forward(self, input_ids, position_ids):
        inputs_embeds = self.embed_scale * self.word_embeddings(input_ids)
        position_embeds = self.position_embeddings(position_ids)
        return inputs_embeds + position_embeds


class OPTSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.qvk_combined = nn.Linear(config.decoder_embed_dim, config.decoder_embed_dim * 3)

    def forward(self, hidden_states, attention_cache=None):
        head_dim = self.config.decoder_embed_dim // self.config.decoder_attention_heads

        qvk_combined_states = self.qvk_combined(hidden_states)
        qvk_combined_states = qvk_combined_states.reshape(qvk_combined_states.shape[:2] + (-1, 3))
        query_states, value_states, key_states = torch.split(qvk_combined_states, 1, dim=3)

        query_states = query_states.reshape(hidden_states.shape[:2] +
                                            (self.config.decoder_attention_heads, head_dim))
        value_states = value_states.reshape(hidden_states.shape[:2] +
                                            (self.config.decoder_attention_heads, head_dim))
        key_states = key_states.reshape(hidden_states.shape[:2] +
                                        (self.config.decoder_attention_heads, head_dim))

        if attention_cache is None:
            attention_bias = torch.triu(
                torch.full((query_states.shape[1], key_states.shape[1]), -1e10), 1)[None, None]
        else:
            cache_key, cache_value, cache_index = attention_cache
            cache_index_ = int(cache_index[0])
            num_updated_cache_vectors = query_states.shape[1]
            # lax.dynamic_update_slice(cache_key, key_states, (0, cache_index_, 0, 0))
            key_states_full = cache_key.clone()
            key_states_full[:, cache_index_:cache_index_ + num_updated_cache_vectors] = key_states
            value_states_full = cache_value.clone()
            value_states_full[:, cache_index_:cache_index_ + num_updated_cache_vectors] = value_states
            key_states, value_states = key_states_full, value_states_full
            max_length = key_states.shape[1]
            if FIXED:
                row_idxs = torch.arange(num_updated_cache_vectors)
                mask = torch.arange(max_length) - (cache_index_ + 1)
                attention_bias = ((row_idxs[:, None] <= mask).to(self.config.dtype) * -1e10)[None, None]
            else:
                attention_bias = (torch.arange(max_length) >=
                                  cache_index_ + num_updated_cache_vectors).to(self.config.dtype) * -1e10
                attention_bias = attention_bias[None, None, None, :]
            attention_cache = key_states, value_states, cache_index + num_updated_cache_vectors

        attn_weights = dot_product_attention_weights(query_states, key_states, bias=attention_bias)
        attn_output = torch.einsum("...hqk,...khd->...qhd", attn_weights, value_states)
        attn_output = attn_output.reshape(attn_output.shape[:2] + (-1,))
        return attn_output, attention_cache


class OPTAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = OPTSelfAttention(config)
        self.dense = nn.Linear(config.decoder_embed_dim, config.decoder_embed_dim)
        self.layer_norm = nn.LayerNorm(config.decoder_embed_dim, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_cache=None):
        residual = hidden_states
        hidden_states = self.layer_norm(hidden_states)
        attn_output, attention_cache = self.self(hidden_states, attention_cache=attention_cache)
        hidden_states = self.dense(attn_output)
        return hidden_states + residual, attention_cache


class OPTFFN(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.decoder_embed_dim, config.decoder_ffn_embed_dim)
        self.activation = ACT2FN[config.activation_fn]
        self.fc2 = nn.Linear(config.decoder_ffn_embed_dim, config.decoder_embed_dim)
        self.layer_norm = nn.LayerNorm(config.decoder_embed_dim, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.layer_norm(hidden_states)
        hidden_states = self.activation(self.fc1(hidden_states))
        hidden_states = self.fc2(hidden_states)
        return hidden_states + residual


class OPTTransformerLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = OPTAttention(config)
        self.ffn = OPTFFN(config)

    def forward(self, hidden_states, attention_cache=None):
        attention_output, attention_cache = self.attention(hidden_states, attention_cache=attention_cache)
        return self.ffn(attention_output), attention_cache


class OPTForLMModule(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = OPTEmbeddings(config)
        self.layers = nn.ModuleList([OPTTransformerLayer(config) for _ in range(config.decoder_layers)])
        self.layer_norm = nn.LayerNorm(config.decoder_embed_dim, eps=config.layer_norm_eps)

    def forward(self, input_ids, position_ids, attention_cache=None):
        hidden_states = self.embeddings(input_ids, position_ids)
        new_attention_cache = () if attention_cache is not None else None
        for i, layer in enumerate(self.layers):
            layer_attention_cache = attention_cache[i] if attention_cache is not None else None
            hidden_states, layer_cache = layer(hidden_states, attention_cache=layer_attention_cache)
            if attention_cache is not None:
                new_attention_cache += (layer_cache,)
        if self.config.version > 2:
            hidden_states = self.layer_norm(hidden_states)
        logits = hidden_states @ self.embeddings.word_embeddings.weight.T
        return logits, new_attention_cache


def init_cache_np(config, batch_size):
    head_dim = config.decoder_embed_dim // config.decoder_attention_heads
    all_cache = []
    for _ in range(config.decoder_layers):
        all_cache.append((
            torch.zeros((batch_size, config.max_target_positions, config.decoder_attention_heads, head_dim)),
            torch.zeros((batch_size, config.max_target_positions, config.decoder_attention_heads, head_dim)),
            torch.zeros((batch_size,), dtype=torch.int32),
        ))
    return tuple(all_cache)


def build_position_ids(input_ids, padding_idx):
    mask = (input_ids != padding_idx).astype(np.int32)
    position_ids = np.cumsum(mask, axis=1).astype(np.int32) * mask + padding_idx
    return position_ids


config = OPTConfig()
model = OPTForLMModule(config).eval()

input_ids = np.array([[25, 16, 10, 27, 18, 8, 38, 23, 7]], dtype=np.int64)
position_ids = build_position_ids(input_ids, config.pad)

with torch.no_grad():
    cache = init_cache_np(config, input_ids.shape[0])
    # test_cache.py, decompose_input=False: the whole prompt through the cached forward.
    logits_step, cache = model(torch.from_numpy(input_ids), torch.from_numpy(position_ids).long(),
                               attention_cache=cache)
    print("prompt logits[0, :, :4]:")
    print(np.round(logits_step[0, :, :4].numpy(), 4))

    # Greedy decode, one token per step, as the serving wrapper does.
    step_ct = input_ids.shape[1]
    next_token = logits_step[:, -1].argmax(-1, keepdim=True)
    generated = [int(next_token)]
    for _ in range(6):
        position_ids_step = torch.full_like(next_token, step_ct + config.pad + 1)
        logits_step, cache = model(next_token, position_ids_step, attention_cache=cache)
        next_token = logits_step[:, -1].argmax(-1, keepdim=True)
        generated.append(int(next_token))
        step_ct += 1
    print("generated:", generated)
