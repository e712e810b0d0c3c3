"""T5Gemma generate(): the cross-attention cache is built from the decoder config and keeps a sliding window.

Citation: huggingface/transformers#46111 ("Fix a regression in encoder-decoder generation cache
initialization", merged 2026-05). From the PR description: for encoder-decoder models `generate()` passed
the decoder config to both the self-attention cache and the cross-attention cache; for T5Gemma, whose
decoder has sliding-window layers, "the cross-attention cache could inherit the decoder sliding-window
structure and truncate encoder key/value states". Fix: keep the decoder config for the self-attention
cache but build the cross-attention cache without it, so cross-attention stays full-length (the PR
later moved the fix into the t5gemma modeling code: "We do not pass the config to the cross attn cache
to avoid initializing SWA..."). I read the description and that review hunk, not the whole diff.

Bug mechanics (as in transformers' cache_utils): a sliding-window cache layer returns the full states
from update() but stores only the last sliding_window - 1 of them. The cross-attention K/V of the
encoder output are written once, on the first decoder step, and read back from the cache on every
later step, so from the second generated token on, the decoder's sliding layers cross-attend only to
the last sliding_window - 1 encoder positions.

Reproduction: a plain-torch port of the pieces involved (DynamicLayer / DynamicSlidingWindowLayer,
DynamicCache built from config.layer_types, EncoderDecoderCache with is_updated, a T5Gemma-style
decoder layer with self- and cross-attention through F.scaled_dot_product_attention) and greedy decoding
for 3 steps over a 9-token source, sliding_window=4.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class DynamicLayer:
    def __init__(self):
        self.keys = None
        self.values = None

    def update(self, key_states, value_states):
        if self.keys is None:
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values


class DynamicSlidingWindowLayer(DynamicLayer):
    def __init__(self, sliding_window):
        super().__init__()
        self.sliding_window = sliding_window

    def update(self, key_states, value_states):
        if self.keys is None:
            full_k, full_v = key_states, value_states
        else:
            full_k = torch.cat([self.keys, key_states], dim=-2)
            full_v = torch.cat([self.values, value_states], dim=-2)
        # only the last sliding_window - 1 states are needed by the next token
        self.keys = full_k[:, :, -self.sliding_window + 1:, :]
        self.values = full_v[:, :, -self.sliding_window + 1:, :]
        return full_k, full_v


class DynamicCache:
    def __init__(self, config=None):
        self.config = config
        self.layers = []

    def _layer(self, layer_idx):
        while len(self.layers) <= layer_idx:
            i = len(self.layers)
            if self.config is not None and self.config["layer_types"][i] == "sliding_attention":
                self.layers.append(DynamicSlidingWindowLayer(self.config["sliding_window"]))
            else:
                self.layers.append(DynamicLayer())
        return self.layers[layer_idx]

    def update(self, key_states, value_states, layer_idx):
        return self._layer(layer_idx).update(key_states, value_states)

    def get_seq_length(self, layer_idx=0):
        if len(self.layers) <= layer_idx or self.layers[layer_idx].keys is None:
            return 0
        return self.layers[layer_idx].keys.shape[-2]


class EncoderDecoderCache:
    def __init__(self, self_attention_cache, cross_attention_cache):
        self.self_attention_cache = self_attention_cache
        self.cross_attention_cache = cross_attention_cache
        self.is_updated = {}


class T5GemmaAttention(nn.Module):
    def __init__(self, config, layer_idx, is_cross_attention):
        super().__init__()
        d, self.h = config["hidden_size"], config["num_attention_heads"]
        self.hd = d // self.h
        self.layer_idx = layer_idx
        self.is_cross_attention = is_cross_attention
        self.sliding_window = config["sliding_window"] if (
            config["layer_types"][layer_idx] == "sliding_attention" and not is_cross_attention) else None
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def _shape(self, x):
        return x.view(x.shape[0], x.shape[1], self.h, self.hd).transpose(1, 2)

    def forward(self, hidden_states, encoder_hidden_states=None, past_key_values=None, cache_position=None):
        q = self._shape(self.q_proj(hidden_states))
        if self.is_cross_attention:
            cache = past_key_values.cross_attention_cache
            if past_key_values.is_updated.get(self.layer_idx):
                k, v = cache.layers[self.layer_idx].keys, cache.layers[self.layer_idx].values
            else:
                k = self._shape(self.k_proj(encoder_hidden_states))
                v = self._shape(self.v_proj(encoder_hidden_states))
                k, v = cache.update(k, v, self.layer_idx)
                past_key_values.is_updated[self.layer_idx] = True
            # encoder_attention_mask is all ones (no source padding): transformers passes no mask
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            k = self._shape(self.k_proj(hidden_states))
            v = self._shape(self.v_proj(hidden_states))
            k, v = past_key_values.self_attention_cache.update(k, v, self.layer_idx)
            kv_len = k.shape[-2]
            q_pos = cache_position[:, None]
            k_pos = torch.arange(cache_position[-1] + 1 - kv_len, cache_position[-1] + 1)[None, :]
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(hidden_states.shape))


class T5GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = T5GemmaAttention(config, layer_idx, is_cross_attention=False)
        self.cross_attn = T5GemmaAttention(config, layer_idx, is_cross_attention=True)

    def forward(self, x, encoder_hidden_states, past_key_values, cache_position):
        x = x + self.self_attn(x, past_key_values=past_key_values, cache_position=cache_position)
        return x + self.cross_attn(x, encoder_hidden_states, past_key_values, cache_position)


def main():
    torch.manual_seed(0)
    decoder_config = {"hidden_size": 32, "num_attention_heads": 4, "vocab_size": 50,
                      "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    embed = nn.Embedding(decoder_config["vocab_size"], decoder_config["hidden_size"])
    layers = nn.ModuleList(T5GemmaDecoderLayer(decoder_config, i) for i in range(2))
    lm_head = nn.Linear(decoder_config["hidden_size"], decoder_config["vocab_size"], bias=False)
    encoder_outputs = torch.randn(1, 9, decoder_config["hidden_size"])   # 9 source tokens

    # generate(): cache preparation for an encoder-decoder model
    self_attention_cache = DynamicCache(config=decoder_config)
    cross_attention_cache = DynamicCache() if FIXED else DynamicCache(config=decoder_config)
    past_key_values = EncoderDecoderCache(self_attention_cache, cross_attention_cache)

    input_ids = torch.tensor([[0]])   # decoder_start_token_id
    generated = []
    with torch.no_grad():
        for _ in range(3):
            past = past_key_values.self_attention_cache.get_seq_length(1)
            cache_position = torch.arange(past, past + input_ids.shape[1])
            h = embed(input_ids)
            for layer in layers:
                h = layer(h, encoder_outputs, past_key_values, cache_position)
            next_token = lm_head(h[:, -1]).argmax(-1, keepdim=True)
            generated.append(int(next_token))
            input_ids = next_token
    print("cross-attention keys per layer:",
          [layer.keys.shape[-2] for layer in past_key_values.cross_attention_cache.layers],
          "generated", generated)


if __name__ == "__main__":
    main()
