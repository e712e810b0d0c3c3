# vllm-project/vllm#21863: Gemma3n's HF config has `layer_types` but no `sliding_window_pattern`, so vLLM did not see the
# model as interleaved; the global layers (per_layer_sliding_window=None) fell back to cache_config.sliding_window.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Gemma3nTextConfig:
    model_type = "gemma3n_text"
    hidden_size = 32
    num_attention_heads = 2
    head_dim = 16
    num_hidden_layers = 4
    sliding_window = 4
    layer_types = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]


def maybe_set_sliding_window_pattern(hf_text_config):
    # gemma3n configs describe the interleave with layer_types only
    if hf_text_config.model_type == "gemma3n_text" and getattr(hf_text_config, "sliding_window_pattern", None) is None:
        hf_text_config.sliding_window_pattern = hf_text_config.layer_types.index("full_attention") + 1


class ModelConfig:
    def __init__(self, hf_text_config, disable_sliding_window=False):
        self.hf_text_config = hf_text_config
        self.disable_sliding_window = disable_sliding_window
        if FIXED:
            maybe_set_sliding_window_pattern(hf_text_config)

    def get_sliding_window(self):
        if self.disable_sliding_window:
            return None
        # interleaved models carry their window per layer; the model-wide value is only for uniform SWA
        if getattr(self.hf_text_config, "sliding_window_pattern", None) is not None:
            return None
        return getattr(self.hf_text_config, "sliding_window", None)


class CacheConfig:
    def __init__(self, block_size=16):
        self.block_size = block_size
        self.sliding_window = None


def _make_sliding_window_bias(seq_lens, window_size, dtype):
    attn_biases = []
    for seq_len in seq_lens:
        tensor = torch.full((1, seq_len, seq_len), dtype=dtype, fill_value=1)
        shift = 0
        mask = torch.tril(tensor, diagonal=shift).to(dtype)
        if window_size is not None:
            mask = torch.triu(mask, diagonal=shift - window_size + 1)
        mask = torch.log(mask)
        attn_biases.append(mask.to(dtype))
    return attn_biases


class Attention(nn.Module):
    def __init__(self, num_heads, head_size, scale, cache_config=None, per_layer_sliding_window=None, prefix=""):
        super().__init__()
        if per_layer_sliding_window is not None:
            sliding_window = per_layer_sliding_window
        elif cache_config is not None:
            sliding_window = cache_config.sliding_window
        else:
            sliding_window = None
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.sliding_window = sliding_window
        self.layer_name = prefix

    def forward(self, query, key, value, seq_lens):
        # TorchSDPA prefill: one bias per sequence of the batch
        attn_masks = _make_sliding_window_bias(seq_lens, self.sliding_window, query.dtype)
        outputs, start = [], 0
        for seq_len, mask in zip(seq_lens, attn_masks):
            end = start + seq_len
            q, k, v = (t[start:end].view(seq_len, self.num_heads, self.head_size).transpose(0, 1)
                       for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            outputs.append(out.transpose(0, 1).reshape(seq_len, -1))
            start = end
        return torch.cat(outputs)


class Gemma3nAttention(nn.Module):
    def __init__(self, config, cache_config, layer_idx, prefix=""):
        super().__init__()
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.num_attention_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=False)
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None
        self.attn = Attention(config.num_attention_heads, config.head_dim, 1.0, cache_config=cache_config,
                              per_layer_sliding_window=self.sliding_window, prefix=f"{prefix}.attn")

    def forward(self, hidden_states, seq_lens):
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        return self.o_proj(self.attn(q, k, v, seq_lens))


class Gemma3nTextModel(nn.Module):
    def __init__(self, config, cache_config):
        super().__init__()
        self.layers = nn.ModuleList([Gemma3nAttention(config, cache_config, i, prefix=f"model.layers.{i}")
                                     for i in range(config.num_hidden_layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(config.hidden_size) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, seq_lens):
        for norm, layer in zip(self.norms, self.layers):
            hidden_states = hidden_states + layer(norm(hidden_states), seq_lens)
        return hidden_states


hf_config = Gemma3nTextConfig()
model_config = ModelConfig(hf_config)
cache_config = CacheConfig()
cache_config.sliding_window = model_config.get_sliding_window()
model = Gemma3nTextModel(hf_config, cache_config).eval()

seq_lens = [14, 9]
hidden = torch.randn(sum(seq_lens), hf_config.hidden_size)
with torch.no_grad():
    out = model(hidden, seq_lens)
    perturbed = hidden.clone()
    perturbed[0] = torch.randn(hf_config.hidden_size)  # first token of the first request
    out2 = model(perturbed, seq_lens)
print(f"fixed={FIXED} effect of token 0 on token 13 of request 0: {(out[13] - out2[13]).abs().max().item():.4f}")
