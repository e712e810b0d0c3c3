# flash-linear-attention (fla-org/flash-linear-attention#477, fixed by #478, commit 729751c): fla.models.utils.Cache
# added the step's tokens to `_seen_tokens` as soon as layer 0 called update(). In a cached decode step every later
# attention layer then read get_seq_length() already one step ahead, so its new query/key were rotated at position
# past + 1 (a hole after the cached keys, growing with no end) instead of past. The fix counts the tokens on the
# first (prefill) update at layer 0 and, after that, only when the last cached layer updates.
import sys
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.configuration_utils import PretrainedConfig

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- fla/models/transformer/configuration_transformer.py (trimmed)
class TransformerConfig(PretrainedConfig):
    model_type = 'transformer'
    keys_to_ignore_at_inference = ['past_key_values']

    def __init__(self, hidden_size=64, num_hidden_layers=3, num_heads=4, num_kv_heads=None, qkv_bias=False,
                 qk_norm=False, window_size=None, rope_theta=10000., max_position_embeddings=2048, hidden_ratio=4,
                 intermediate_size=None, hidden_act="swish", initializer_range=0.02, norm_eps=1e-6, use_cache=True,
                 pad_token_id=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, vocab_size=128,
                 **kwargs):
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.qkv_bias = qkv_bias
        self.qk_norm = qk_norm
        self.window_size = window_size
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.norm_eps = norm_eps
        self.use_cache = use_cache
        self.vocab_size = vocab_size
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


# ---- fla/models/utils.py Cache
class Cache:
    """
    A cache used for storing hidden states produced by flash linear attention models.
    """

    def __init__(self, seen_tokens: int = 0):
        self.states: List[Dict[str, Any]] = []
        self._seen_tokens = seen_tokens  # Used in `generate` to keep tally of how many tokens the cache has seen

    def __getitem__(self, layer_idx):
        return self.states[layer_idx]

    def __len__(self):
        return len(self.states)

    def update(self, recurrent_state=None, attn_state=None, conv_state=None, ffn_state=None, layer_idx: int = 0,
               offset: Optional[int] = 1, cache_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        if not FIXED:
            # Update the number of seen tokens
            if layer_idx == 0:
                self._seen_tokens += offset

        if cache_kwargs is None:
            cache_kwargs = {}
        if attn_state is not None:
            input_size = attn_state[0].shape[1]
            window_size = cache_kwargs.get('window_size', None)
        if len(self.states) <= layer_idx:
            if FIXED:
                # update the number of seen tokens
                if layer_idx == 0:
                    self._seen_tokens += offset
            if attn_state is not None:
                if window_size is not None and input_size > window_size:
                    attn_state = [state[:, -window_size:].contiguous() for state in attn_state]
            state = dict(recurrent_state=recurrent_state, attn_state=attn_state, conv_state=conv_state,
                         ffn_state=ffn_state)
            self.states.append(state)
        else:
            if FIXED:
                # update the number of seen tokens
                if layer_idx == len(self.states) - 1:
                    self._seen_tokens += offset
            state = self.states[layer_idx]
            if recurrent_state is not None:
                state['recurrent_state'] = recurrent_state
            if attn_state is not None:
                if window_size is not None and state['attn_state'][0].shape[1] == window_size:
                    for i, (old_state, new_state) in enumerate(zip(state['attn_state'], attn_state)):
                        old_state = old_state.roll(-input_size, 1)
                        old_state[:, -input_size:] = new_state
                        state['attn_state'][i] = old_state
                else:
                    attn_state = [torch.cat([old_state, new_state], 1)
                                  for old_state, new_state in zip(state['attn_state'], attn_state)]
                    state['attn_state'] = attn_state
            if conv_state is not None:
                state['conv_state'] = conv_state
            if ffn_state is not None:
                state['ffn_state'] = ffn_state
        return state

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        """Returns the sequence length of the cached states. A layer index can be optionally passed."""
        if len(self.states) <= layer_idx:
            return 0
        return self._seen_tokens

    @classmethod
    def from_legacy_cache(cls, past_key_values=None, seen_tokens: int = 0):
        cache = cls(seen_tokens)
        if isinstance(past_key_values, list):
            for layer_idx in range(len(past_key_values)):
                cache.states.append(past_key_values[layer_idx])
        return cache


# ---- CPU stand-in for flash_attn.flash_attn_func (flash-attn >= 2.1: a causal mask is aligned to the bottom-right
# corner when seqlen_q != seqlen_k; window_size=(left, right), -1 = unbounded)
def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1)):
    B, Tq, H, D = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    if Hk != H:
        k = k.repeat_interleave(H // Hk, dim=2)
        v = v.repeat_interleave(H // Hk, dim=2)
    i = torch.arange(Tq)[:, None] + (Tk - Tq)
    j = torch.arange(Tk)[None, :]
    allowed = torch.ones(Tq, Tk, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    left, right = window_size
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed)
    return o.transpose(1, 2)


# ---- fla/modules/rotary.py RotaryEmbedding (non-interleaved; torch reference of the triton kernel)
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0, interleaved=False):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.register_buffer("inv_freq", 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)),
                             persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        if seqlen > self._seq_len_cached:
            self._seq_len_cached = seqlen
            t = torch.arange(seqlen, device=device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)

    def forward(self, q, k, seqlen_offset=0, max_seqlen=None, cu_seqlens=None):
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=q.device, dtype=q.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(q.shape[1] + seqlen_offset, device=q.device, dtype=q.dtype)
        T = q.shape[1]
        cos = torch.cat([self._cos_cached[seqlen_offset:seqlen_offset + T]] * 2, -1)[None, :, None, :]
        sin = torch.cat([self._sin_cached[seqlen_offset:seqlen_offset + T]] * 2, -1)[None, :, None, :]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k


# ---- fla/layers/attn.py Attention (the attention_mask / varlen branches trimmed: prompts here are unpadded)
class Attention(nn.Module):
    def __init__(self, hidden_size=2048, num_heads=32, num_kv_heads=None, qkv_bias=False, qk_norm=False,
                 window_size=None, rope_theta=10000., max_position_embeddings=None, layer_idx=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.num_kv_groups = num_heads // self.num_kv_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.kv_dim = self.num_kv_heads * self.head_dim
        self.qkv_bias = qkv_bias
        self.qk_norm = qk_norm
        self.window_size = window_size
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.layer_idx = layer_idx

        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=self.qkv_bias)
        self.k_proj = nn.Linear(self.hidden_size, self.kv_dim, bias=self.qkv_bias)
        self.v_proj = nn.Linear(self.hidden_size, self.kv_dim, bias=self.qkv_bias)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

        self.rotary = RotaryEmbedding(dim=self.head_dim, base=self.rope_theta)

    def forward(self, hidden_states, attention_mask=None, past_key_values: Optional[Cache] = None,
                output_attentions=False, use_cache=False, **kwargs):
        batch_size, q_len, _ = hidden_states.size()

        q = self.q_proj(hidden_states).unflatten(-1, (-1, self.head_dim))
        k = self.k_proj(hidden_states).unflatten(-1, (-1, self.head_dim))
        v = self.v_proj(hidden_states).unflatten(-1, (-1, self.head_dim))

        cu_seqlens = kwargs.get('cu_seqlens', None)

        seqlen_offset, max_seqlen = 0, q_len
        if past_key_values is not None:
            seqlen_offset = past_key_values.get_seq_length(self.layer_idx)
            max_seqlen = q.shape[1] + seqlen_offset

        if self.max_position_embeddings is not None:
            max_seqlen = max(max_seqlen, self.max_position_embeddings)
        q, k = self.rotary(q, k, seqlen_offset=seqlen_offset, max_seqlen=max_seqlen, cu_seqlens=cu_seqlens)

        if past_key_values is not None:
            cache_has_content = past_key_values.get_seq_length(self.layer_idx) > 0
            k_cached, v_cached = past_key_values.update(
                attn_state=(k.flatten(-2, -1), v.flatten(-2, -1)),
                layer_idx=self.layer_idx,
                offset=q_len,
                cache_kwargs=dict(window_size=self.window_size)
            )['attn_state']
            if cache_has_content:
                k, v = k_cached, v_cached
                k = k.unflatten(-1, (-1, self.head_dim))
                v = v.unflatten(-1, (-1, self.head_dim))

        o = flash_attn_func(
            q, k, v,
            causal=True,
            window_size=(-1, -1) if self.window_size is None else (self.window_size - 1, 0)
        )
        o = o.reshape(batch_size, q_len, -1)
        o = self.o_proj(o)
        return o, None, past_key_values


# ---- fla/modules GatedMLP (swiglu), torch path
class TransformerMLP(nn.Module):
    def __init__(self, hidden_size, hidden_ratio=4, intermediate_size=None, hidden_act='swish'):
        super().__init__()
        if intermediate_size is None:
            intermediate_size = int(hidden_size * hidden_ratio * 2 / 3)
            intermediate_size = 32 * ((intermediate_size + 32 - 1) // 32)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x, **kwargs):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---- fla/models/transformer/modeling_transformer.py (trimmed)
class TransformerBlock(nn.Module):
    def __init__(self, config: TransformerConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = Attention(hidden_size=config.hidden_size, num_heads=config.num_heads,
                              num_kv_heads=config.num_kv_heads, qkv_bias=config.qkv_bias, qk_norm=config.qk_norm,
                              window_size=config.window_size, rope_theta=config.rope_theta,
                              max_position_embeddings=config.max_position_embeddings, layer_idx=layer_idx)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = TransformerMLP(hidden_size=config.hidden_size, hidden_ratio=config.hidden_ratio,
                                  intermediate_size=config.intermediate_size, hidden_act=config.hidden_act)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, output_attentions=False,
                use_cache=False, **kwargs):
        residual = hidden_states
        hidden_states = self.attn_norm(hidden_states)
        hidden_states, attentions, past_key_values = self.attn(
            hidden_states=hidden_states, attention_mask=attention_mask, past_key_values=past_key_values,
            use_cache=use_cache, output_attentions=output_attentions, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp_norm(hidden_states)
        hidden_states = self.mlp(hidden_states, **kwargs)
        hidden_states = residual + hidden_states
        outputs = (hidden_states,)
        if use_cache:
            outputs += (past_key_values,)
        return outputs


class TransformerModel(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([TransformerBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, **kwargs):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if use_cache and not isinstance(past_key_values, Cache):
            past_key_values = Cache.from_legacy_cache(past_key_values)
        hidden_states = self.embeddings(input_ids)
        next_cache = None
        for layer in self.layers:
            layer_outputs = layer(hidden_states, attention_mask=attention_mask, past_key_values=past_key_values,
                                  use_cache=use_cache, **kwargs)
            hidden_states = layer_outputs[0]
            if use_cache:
                next_cache = layer_outputs[1]
        hidden_states = self.norm(hidden_states)
        return hidden_states, next_cache


class TransformerForCausalLM(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.model = TransformerModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.2)

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, **kwargs):
        hidden_states, past_key_values = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                                    past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        logits = self.lm_head(hidden_states)
        return logits, past_key_values


# ---- greedy decoding with the cache (what GenerationMixin.generate does for this model: prefill the prompt, then
# one token per step with past_key_values)
@torch.no_grad()
def generate(model, input_ids, max_new_tokens):
    past_key_values = None
    logits, past_key_values = model(input_ids, past_key_values=past_key_values, use_cache=True)
    sequences = input_ids
    step_logits = []
    for _ in range(max_new_tokens):
        next_logits = logits[:, -1]
        step_logits.append(next_logits)
        next_token = next_logits.argmax(-1, keepdim=True)
        sequences = torch.cat([sequences, next_token], dim=1)
        logits, past_key_values = model(next_token, past_key_values=past_key_values, use_cache=True)
    return sequences, torch.stack(step_logits, 1), past_key_values


config = TransformerConfig(hidden_size=64, num_hidden_layers=3, num_heads=4, vocab_size=128,
                           max_position_embeddings=256)
model = TransformerForCausalLM(config).eval()

prompt = torch.randint(3, config.vocab_size, (2, 12))
sequences, step_logits, cache = generate(model, prompt, max_new_tokens=10)

print("generated:", sequences[:, prompt.shape[1]:].tolist())
print("cache seen tokens:", cache.get_seq_length(0), "cached keys per layer:",
      [s['attn_state'][0].shape[1] for s in cache.states])
print("last-step logits[0, :4]:", step_logits[:, -1, :4].tolist())
