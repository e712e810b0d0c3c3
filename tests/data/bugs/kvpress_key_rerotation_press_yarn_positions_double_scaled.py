# kvpress (NVIDIA/kvpress#85, "Fix RoPE with Yarn", commit 2770562), KeyRerotationPress.compress.
# Bug: pruned keys are moved to their new cache positions 0..n_kept-1 by un-rotating and re-rotating with the layer's
# position_embeddings, whose cos/sin carry YaRN's attention_scaling, so the kept keys end up scaled by attention_scaling**2.
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, rotate_half

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ----------------------------------------------------------------------------- kvpress presses
@dataclass
class BasePress:
    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError

    def forward_hook(self, module, input, kwargs, output):
        hidden_states = kwargs["hidden_states"]
        cache = kwargs["past_key_value"]
        q_len = hidden_states.shape[1]

        # Don't compress after pre-filling
        if kwargs["cache_position"][-1] > q_len:
            return output

        keys = cache.key_cache[module.layer_idx]
        values = cache.value_cache[module.layer_idx]
        keys, values = self.compress(module, hidden_states, keys, values, output[1], kwargs)
        cache.key_cache[module.layer_idx] = keys
        cache.value_cache[module.layer_idx] = values
        return output


@dataclass
class ScorerPress(BasePress):
    compression_ratio: float = 0.0


@dataclass
class KnormPress(ScorerPress):
    """Prune KV pairs with highest L2 norm of keys (https://arxiv.org/pdf/2406.11430)"""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return -keys.norm(dim=-1)


@dataclass
class KeyRerotationPress(BasePress):
    press: ScorerPress = None

    @staticmethod
    def _rerotate_cos_sin(x, inv_freq, selected_positions):
        bsz, num_key_value_heads, n_kept = selected_positions.shape
        device = selected_positions.device
        dtype = x.dtype
        idx = torch.arange(0, n_kept, device=device)
        idx = idx.unsqueeze(0)
        inv_freq = inv_freq[None, None, :, None].float().expand(bsz, num_key_value_heads, -1, 1)
        idx = idx[:, None, :].float().expand(bsz, num_key_value_heads, n_kept)
        delta_pos = idx - selected_positions
        delta_pos = delta_pos.unsqueeze(2)
        freqs = delta_pos.float() * inv_freq.float()
        freqs = freqs.transpose(2, 3)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().contiguous()
        sin = emb.sin().contiguous()
        return cos.to(dtype=dtype), sin.to(dtype=dtype)

    @staticmethod
    def rerotate_keys(module, indices, keys):
        new_cos, new_sin = KeyRerotationPress._rerotate_cos_sin(keys, module.rotary_emb.inv_freq, indices)
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
        keys = keys.gather(2, indices).contiguous()
        return (keys * new_cos) + (rotate_half(keys) * new_sin)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.press.compression_ratio == 0:
            return keys, values

        # Compute scores from base press
        scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)

        # Get indices of KV pairs with the lowest scores
        q_len = hidden_states.shape[1]
        n_kept = int(q_len * (1 - self.press.compression_ratio))
        indices = scores.topk(n_kept, dim=-1).indices
        indices = torch.sort(indices, dim=2).values
        self.last_indices = indices
        if FIXED:
            keys = self.rerotate_keys(module, indices, keys)
            indices = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
        else:
            indices = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)

            cos, sin = kwargs["position_embeddings"]
            # 2. Inverse of rotation matrix is equivalent to setting sin -> -sin in the equation below
            keys = (keys * cos.unsqueeze(1)) + (rotate_half(keys) * (-sin.unsqueeze(1)))
            # 3. Prune keys
            keys = keys.gather(2, indices).contiguous()
            # 4. Apply RoPE
            cos, sin = cos[:, :n_kept], sin[:, :n_kept]
            keys = (keys * cos.unsqueeze(1)) + (rotate_half(keys) * sin.unsqueeze(1))

        values = values.gather(2, indices).contiguous()
        return keys, values


# ----------------------------------------------------------------------------- a tiny Llama (transformers conventions)
class SimpleCache:
    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def update(self, k, v, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(k)
            self.value_cache.append(v)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], k], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], v], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx=0):
        return self.key_cache[layer_idx].shape[-2]


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads, self.num_kv = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, past_key_value, cache_position):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = past_key_value.update(k, v, self.layer_idx)
        # (the question's queries are the last n of the keys: a mask aligned bottom-right, as transformers' sdpa path
        # builds one over a cache; the blind draft's `is_causal=n > 1` was top-left there, a bug of its own, not kvpress')
        mask = torch.ones(n, k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - n)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1)), None


class TinyLlama(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaAttention(config, i) for i in range(config.num_hidden_layers)])
        self.rotary_emb = LlamaRotaryEmbedding(config)
        for layer in self.layers:  # as kvpress' tests do: layer.self_attn.rotary_emb = model.model.rotary_emb
            layer.rotary_emb = self.rotary_emb

    def forward(self, input_ids, position_ids, past_key_value):
        h = self.embed(input_ids)
        position_embeddings = self.rotary_emb(h, position_ids)
        cache_position = position_ids[0]
        layer_inputs = []
        for layer in self.layers:
            layer_inputs.append(h)
            out, _ = layer(hidden_states=h, position_embeddings=position_embeddings,
                           past_key_value=past_key_value, cache_position=cache_position)
            h = h + out
        return h, layer_inputs


config = LlamaConfig(
    vocab_size=100, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
    max_position_embeddings=128,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
)
model = TinyLlama(config).eval()
press = KeyRerotationPress(press=KnormPress(compression_ratio=0.5))

context_ids = torch.randint(0, 100, (1, 24))
cache = SimpleCache()
handles = [layer.register_forward_hook(press.forward_hook, with_kwargs=True) for layer in model.layers]
kept = {}
orig_compress = press.compress


def recording_compress(module, *args):
    out = orig_compress(module, *args)
    kept[module.layer_idx] = press.last_indices
    return out


press.compress = recording_compress
with torch.no_grad():
    _, layer_inputs = model(context_ids, torch.arange(24).unsqueeze(0), cache)  # pre-filling with the press
for hdl in handles:
    hdl.remove()

# Reference (kvpress' own test): keys = W_k h, prune, then RoPE at the new positions 0..n_kept-1
err = 0.0
with torch.no_grad():
    for layer in model.layers:
        idx = kept[layer.layer_idx]
        raw = layer.k_proj(layer_inputs[layer.layer_idx]).view(1, 24, -1, layer.head_dim).transpose(1, 2)
        raw = raw.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, layer.head_dim))
        cos, sin = model.rotary_emb(raw, torch.arange(idx.shape[-1]).unsqueeze(0))
        ref = raw * cos.unsqueeze(1) + rotate_half(raw) * sin.unsqueeze(1)
        err = max(err, (cache.key_cache[layer.layer_idx] - ref).abs().max().item())

    # then answer with the compressed cache, as KVPressTextGenerationPipeline.generate_answer does
    question = torch.randint(0, 100, (1, 3))
    h, _ = model(question, torch.arange(24, 27).unsqueeze(0), cache)

print(f"attention_scaling={model.rotary_emb.attention_scaling:.4f}; "
      f"max |rerotated cached key - RoPE(pruned key, new position)|: {err:.6f}")
