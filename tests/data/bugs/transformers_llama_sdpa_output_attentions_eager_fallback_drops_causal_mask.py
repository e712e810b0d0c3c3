# huggingface/transformers#30652 (Llama / CodeLlama modeling_llama.py, v4.40): with attn_implementation="sdpa",
# _update_causal_mask returns None when the padding mask is all ones, but output_attentions=True makes
# LlamaSdpaAttention fall back to the eager LlamaAttention.forward, which then runs with no causal mask at all.
import sys
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LlamaConfig:  # CodeLlama-style config, tiny
    vocab_size = 64
    hidden_size = 64
    intermediate_size = 128
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 1000000.0
    rms_norm_eps = 1e-5
    _attn_implementation = "sdpa"


class AttentionMaskConverter:
    @staticmethod
    def _ignore_causal_mask_sdpa(attention_mask, inputs_embeds, past_key_values_length, sliding_window=None, is_training=False):
        batch_size, query_length = inputs_embeds.shape[0], inputs_embeds.shape[1]
        key_value_length = query_length + past_key_values_length
        is_tracing = torch.jit.is_tracing() or isinstance(inputs_embeds, torch.fx.Proxy)
        ignore_causal_mask = False
        if attention_mask is None:
            if (is_training or not is_tracing) and (query_length == 1 or key_value_length == query_length):
                ignore_causal_mask = True
        elif sliding_window is None or key_value_length < sliding_window:
            if len(attention_mask.shape) == 4:
                return False
            elif (is_training or not is_tracing) and torch.all(attention_mask == 1):
                if query_length == 1 or key_value_length == query_length:
                    ignore_causal_mask = True
        return ignore_causal_mask


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))

    def forward(self, x, position_ids):
        freqs = (self.inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    b, kvh, s, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    return hidden_states[:, :, None, :, :].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.is_causal = True
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, config.rope_theta)

    def _qkv(self, hidden_states, position_ids):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, repeat_kv(k, self.num_key_value_groups), repeat_kv(v, self.num_key_value_groups)

    # eager path
    def forward(self, hidden_states, attention_mask=None, position_ids=None, output_attentions=False):
        bsz, q_len, _ = hidden_states.size()
        query_states, key_states, value_states = self._qkv(hidden_states, position_ids)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:  # no matter the length, we just slice it
            causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
            attn_weights = attn_weights + causal_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), (attn_weights if output_attentions else None)


class LlamaSdpaAttention(LlamaAttention):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, output_attentions=False):
        if output_attentions:
            # "LlamaModel is using LlamaSdpaAttention, but ... does not support output_attentions=True.
            #  Falling back to the manual attention implementation"
            return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   output_attentions=output_attentions)
        bsz, q_len, _ = hidden_states.size()
        query_states, key_states, value_states = self._qkv(hidden_states, position_ids)
        causal_mask = attention_mask
        if attention_mask is not None:
            causal_mask = causal_mask[:, :, :, : key_states.shape[-2]]
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=causal_mask, dropout_p=0.0,
            is_causal=causal_mask is None and q_len > 1,
        )
        attn_output = attn_output.transpose(1, 2).contiguous().view(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaSdpaAttention(config, layer_idx)
        self.mlp_gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.mlp_up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.mlp_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, output_attentions):
        residual = hidden_states
        h, w = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids, output_attentions)
        hidden_states = residual + h
        x = self.post_attention_layernorm(hidden_states)
        return hidden_states + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x)), w


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, attention_mask=None, output_attentions=False):
        inputs_embeds = self.embed_tokens(input_ids)
        cache_position = torch.arange(0, inputs_embeds.shape[1])
        position_ids = cache_position.unsqueeze(0)
        if FIXED:
            causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position, None, output_attentions)
        else:
            causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position, None)
        hidden_states = inputs_embeds
        all_attns = ()
        for layer in self.layers:
            hidden_states, w = layer(hidden_states, causal_mask, position_ids, output_attentions)
            all_attns += (w,)
        return self.norm(hidden_states), all_attns

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position, past_key_values, output_attentions=False):
        past_seen_tokens = 0
        if FIXED:
            if self.config._attn_implementation == "sdpa" and not output_attentions:
                if AttentionMaskConverter._ignore_causal_mask_sdpa(
                    attention_mask, inputs_embeds=input_tensor, past_key_values_length=past_seen_tokens,
                    is_training=self.training,
                ):
                    return None
        else:
            if self.config._attn_implementation == "sdpa":
                if AttentionMaskConverter._ignore_causal_mask_sdpa(
                    attention_mask, inputs_embeds=input_tensor, past_key_values_length=past_seen_tokens,
                    is_training=self.training,
                ):
                    return None
        dtype = input_tensor.dtype
        min_dtype = torch.finfo(dtype).min
        sequence_length = input_tensor.shape[1]
        target_length = attention_mask.shape[-1] if attention_mask is not None else past_seen_tokens + sequence_length + 1
        causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
        if sequence_length != 1:
            causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask *= torch.arange(target_length) > cache_position.reshape(-1, 1)
        causal_mask = causal_mask[None, None, :, :].expand(input_tensor.shape[0], 1, -1, -1)
        if attention_mask is not None:
            causal_mask = causal_mask.clone()
            mask_length = attention_mask.shape[-1]
            padding_mask = causal_mask[..., :mask_length].eq(0.0) * attention_mask[:, None, None, :].eq(0.0)
            causal_mask[..., :mask_length] = causal_mask[..., :mask_length].masked_fill(padding_mask, min_dtype)
        return causal_mask


model = LlamaModel(LlamaConfig()).eval()
input_ids = torch.randint(0, 64, (2, 12))
attention_mask = torch.ones(2, 12, dtype=torch.long)  # equal-length code prompts, no padding
with torch.no_grad():
    ref, _ = model(input_ids, attention_mask=attention_mask, output_attentions=False)
    out, attns = model(input_ids, attention_mask=attention_mask, output_attentions=True)
future_mass = max(torch.triu(a, diagonal=1).sum(-1).max().item() for a in attns)
print(f"max attention weight on future tokens with output_attentions=True = {future_mass:.6f}")
print(f"max |hidden(output_attentions=True) - hidden(sdpa)| = {(out - ref).abs().max().item():.6f}")
