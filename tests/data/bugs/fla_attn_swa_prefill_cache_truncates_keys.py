# flash-linear-attention (fla-org/flash-linear-attention#183, commit c9ea83c): fla.layers.attn.Attention with a sliding
# window replaced the prompt's keys/values by what Cache.update returned, which the cache had already cut to the last
# `window_size` tokens, so a prefill longer than the window attends to a truncated key set (early queries see nothing).
import sys
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def rearrange_split(x, d):
    # einops: '... (h d) -> ... h d'
    return x.view(*x.shape[:-1], x.shape[-1] // d, d)


# ---- CPU stand-in for flash_attn.flash_attn_func with its documented semantics: causal mask aligned to the
# bottom-right corner when seqlen_k != seqlen_q, window_size=(left, right), rows with no key give 0.
def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1)):
    B, Tq, H, D = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    if Hk != H:
        k = k.repeat_interleave(H // Hk, dim=2)
        v = v.repeat_interleave(H // Hk, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
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
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


# ---- fla.modules.rotary.RotaryEmbedding (non-interleaved, reference path)
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def forward(self, q, k, seqlen_offset=0, max_seqlen=None, cu_seqlens=None):
        T = q.shape[1]
        t = torch.arange(seqlen_offset, seqlen_offset + T, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        cos = torch.cat([freqs.cos(), freqs.cos()], -1)[None, :, None, :]
        sin = torch.cat([freqs.sin(), freqs.sin()], -1)[None, :, None, :]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# ---- fla.models.utils.Cache (attention part)
class Cache:
    def __init__(self, seen_tokens=0):
        self.states = []
        self._seen_tokens = seen_tokens

    def update(self, recurrent_state=None, attn_state=None, conv_state=None, ffn_state=None,
               layer_idx=0, offset=1, cache_kwargs=None):
        if layer_idx == 0:
            self._seen_tokens += offset

        if attn_state is not None:
            input_size = attn_state[0].shape[-2]
            window_size = cache_kwargs.get('window_size', None)
        if len(self.states) <= layer_idx:
            if attn_state is not None:
                if window_size is not None and input_size > window_size:
                    attn_state = (attn_state[0][..., -window_size:, :].contiguous(),
                                  attn_state[1][..., -window_size:, :].contiguous())
            state = dict(recurrent_state=recurrent_state, attn_state=attn_state,
                         conv_state=conv_state, ffn_state=ffn_state)
            self.states.append(state)
        else:
            state = self.states[layer_idx]
            if attn_state is not None:
                key_state, value_state = state['attn_state']
                if window_size is not None and key_state.shape[-2] == window_size:
                    key_state = key_state.roll(-input_size, -2)
                    value_state = value_state.roll(-input_size, -2)
                    key_state[..., -input_size:, :] = attn_state[0]
                    value_state[..., -input_size:, :] = attn_state[1]
                    attn_state = (key_state, value_state)
                else:
                    attn_state = (torch.cat([key_state, attn_state[0]], -2),
                                  torch.cat([value_state, attn_state[1]], -2),)
                state['attn_state'] = attn_state
        return state

    def get_seq_length(self, layer_idx=0):
        if len(self.states) <= layer_idx:
            return 0
        return self._seen_tokens


# ---- fla.layers.attn.Attention
class Attention(nn.Module):
    def __init__(self, hidden_size=64, num_heads=4, num_kv_heads=None, window_size=None,
                 rope_theta=10000., max_position_embeddings=None, layer_idx=None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.hidden_size = hidden_size
        self.head_dim = hidden_size // num_heads
        self.kv_dim = self.num_kv_heads * self.head_dim
        self.window_size = window_size
        self.max_position_embeddings = max_position_embeddings
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.kv_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.kv_dim, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.rotary = RotaryEmbedding(dim=self.head_dim, base=rope_theta)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, output_attentions=False,
                use_cache=False, **kwargs):
        batch_size, q_len, _ = hidden_states.size()
        q = rearrange_split(self.q_proj(hidden_states), self.head_dim)
        k = rearrange_split(self.k_proj(hidden_states), self.head_dim)
        v = rearrange_split(self.v_proj(hidden_states), self.head_dim)

        seqlen_offset, max_seqlen = 0, q_len
        if past_key_values is not None:
            seqlen_offset = past_key_values.get_seq_length(self.layer_idx)
            max_seqlen = q.shape[1] + seqlen_offset
        q, k = self.rotary(q, k, seqlen_offset=seqlen_offset, max_seqlen=max_seqlen)

        if past_key_values is not None:
            if not FIXED:
                k, v = past_key_values.update(
                    attn_state=(k.flatten(-2, -1), v.flatten(-2, -1)),
                    layer_idx=self.layer_idx,
                    offset=q_len,
                    cache_kwargs=dict(window_size=self.window_size)
                )['attn_state']
                k = rearrange_split(k, self.head_dim)
                v = rearrange_split(v, self.head_dim)
            else:
                cache_has_content = past_key_values.get_seq_length(self.layer_idx) > 0
                k_cached, v_cached = past_key_values.update(
                    attn_state=(k.flatten(-2, -1), v.flatten(-2, -1)),
                    layer_idx=self.layer_idx,
                    offset=q_len,
                    cache_kwargs=dict(window_size=self.window_size)
                )['attn_state']
                if cache_has_content:
                    k, v = k_cached, v_cached
                    k = rearrange_split(k, self.head_dim)
                    v = rearrange_split(v, self.head_dim)

        o = flash_attn_func(
            q, k, v,
            causal=True,
            window_size=(-1, -1) if self.window_size is None else (self.window_size - 1, 0)
        )
        o = o.reshape(batch_size, q_len, -1)
        o = self.o_proj(o)
        return o, None, past_key_values


# ---- fla.models.transformer (TransformerBlock / TransformerModel / TransformerForCausalLM), trimmed
class TransformerMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size * 2, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, y = self.gate_proj(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * y)


class TransformerBlock(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg["hidden_size"], eps=1e-6)
        self.attn = Attention(hidden_size=cfg["hidden_size"], num_heads=cfg["num_heads"],
                              num_kv_heads=cfg["num_kv_heads"], window_size=cfg["window_size"], layer_idx=layer_idx)
        self.mlp_norm = nn.RMSNorm(cfg["hidden_size"], eps=1e-6)
        self.mlp = TransformerMLP(cfg["hidden_size"], cfg["hidden_size"] * 2)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False):
        residual = hidden_states
        hidden_states = self.attn_norm(hidden_states)
        hidden_states, attentions, past_key_values = self.attn(
            hidden_states=hidden_states, attention_mask=attention_mask,
            past_key_values=past_key_values, use_cache=use_cache)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.mlp_norm(hidden_states))
        return residual + hidden_states, past_key_values


class TransformerForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList([TransformerBlock(cfg, i) for i in range(cfg["num_hidden_layers"])])
        self.norm = nn.RMSNorm(cfg["hidden_size"], eps=1e-6)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and not isinstance(past_key_values, Cache):
            past_key_values = Cache()
        hidden_states = self.embeddings(input_ids)
        for layer in self.layers:
            hidden_states, past_key_values = layer(hidden_states, past_key_values=past_key_values,
                                                   use_cache=use_cache)
        return self.lm_head(self.norm(hidden_states)), (past_key_values if use_cache else None)


cfg = dict(vocab_size=50, hidden_size=64, num_heads=4, num_kv_heads=2, window_size=4, num_hidden_layers=2)
model = TransformerForCausalLM(cfg).eval()
for p in model.parameters():
    nn.init.normal_(p, std=0.2)

input_ids = torch.randint(0, cfg["vocab_size"], (2, 12))  # prompt (12) longer than the window (4)

with torch.no_grad():
    # reference: the same prompt without a cache (full keys, flash-attn sliding window)
    ref_logits, _ = model(input_ids, use_cache=False)
    # the prefill step of generate(): use_cache=True with an empty fla Cache
    cached_logits, cache = model(input_ids, use_cache=True)

diff_all = (cached_logits - ref_logits).abs().max().item()
diff_last = (cached_logits[:, -1] - ref_logits[:, -1]).abs().max().item()
print(f"fixed={FIXED} window=4 prompt=12: max |prefill logits with cache - without cache| "
      f"all positions={diff_all:.6f}, next-token logits={diff_last:.6f}")
