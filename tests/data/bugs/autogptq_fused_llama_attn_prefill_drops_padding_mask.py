# Citation: AutoGPTQ/AutoGPTQ#483 (commit ccb6386ebfde63c17c45807d38779a93cd25846f,
#   "Fix compatibility with transformers 4.36"); the same pattern in fused_gptj_attn.py.
# Upstream: auto_gptq/nn_modules/fused_llama_attn.py,
#   FusedLlamaAttentionForQuantizedModel.forward (injected with inject_fused_attention=True).
# Bug: the fused attention decided `is_causal = past_key_value is None` and called
#   F.scaled_dot_product_attention(q, k, v, attn_mask=None if is_causal else attention_mask,
#   is_causal=is_causal). On the prompt pass (no cache yet) the 4-D mask that LlamaModel built
#   from the tokenizer's attention_mask (causal + left padding) is thrown away, so in a
#   left-padded batch the real tokens of the short prompt attend to its pad tokens; the pads'
#   keys/values then sit in the cache for every decode step.
# Fix: always pass the model's mask, attn_mask=attention_mask,
#   is_causal=attention_mask is None and q_len > 1.
#
# Tiny port: a Llama-style decoder built in plain torch (the transformers 4.35/4.36 mask
# preparation of LlamaModel is reproduced: causal mask + expanded padding mask, filled with
# finfo.min), the fused attention module as AutoGPTQ wrote it, and HF-style greedy generation
# with legacy tuple past_key_values and position_ids from attention_mask.cumsum.
import sys
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------- config / small modules
class LlamaConfig:
    vocab_size = 64
    hidden_size = 32
    intermediate_size = 64
    num_attention_heads = 4
    num_hidden_layers = 2
    max_position_embeddings = 64
    rms_norm_eps = 1e-6
    pad_token_id = 0


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings).float()
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len=None):
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    sin = sin[position_ids].unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


# ---------------------------------------------------------------- AutoGPTQ fused attention
class FusedLlamaAttentionForQuantizedModel(nn.Module):
    """Multi-headed attention from 'Attention Is All You Need' paper (AutoGPTQ fused qkv)."""

    def __init__(self, hidden_size, num_heads, qkv_proj, o_proj, rotary_emb):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv_proj = qkv_proj
        self.o_proj = o_proj
        self.rotary_emb = rotary_emb

    def forward(self, hidden_states, past_key_value=None, attention_mask=None, position_ids=None,
                output_attentions=False, use_cache=False, **kwargs):
        bsz, q_len, _ = hidden_states.size()

        qkv_states = self.qkv_proj(hidden_states)
        query_states, key_states, value_states = torch.split(qkv_states, self.hidden_size, dim=2)

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        is_causal = past_key_value is None
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)

        if use_cache:
            query_states = query_states.contiguous()
            key_states = key_states.contiguous()
            value_states = value_states.contiguous()

        past_key_value = (key_states, value_states) if use_cache else None

        if FIXED:
            attn_output = F.scaled_dot_product_attention(
                query_states, key_states, value_states,
                attn_mask=attention_mask,
                is_causal=attention_mask is None and q_len > 1,
            )
        else:
            attn_output = F.scaled_dot_product_attention(
                query_states, key_states, value_states,
                attn_mask=None if is_causal else attention_mask,
                is_causal=is_causal,
            )

        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        attn_output = self.o_proj(attn_output)
        return attn_output, None, past_key_value


# ---------------------------------------------------------------- Llama model (HF 4.35 flow)
class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        # what inject_to_model does: q/k/v merged into one qkv_proj
        self.self_attn = FusedLlamaAttentionForQuantizedModel(
            h, config.num_attention_heads,
            qkv_proj=nn.Linear(h, 3 * h, bias=False),
            o_proj=nn.Linear(h, h, bias=False),
            rotary_emb=LlamaRotaryEmbedding(h // config.num_attention_heads, config.max_position_embeddings),
        )
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                use_cache=False):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _, present_key_value = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
            past_key_value=past_key_value, use_cache=use_cache)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + self.mlp(hidden_states)
        return hidden_states, present_key_value


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, inputs_embeds, past_key_values_length):
    """transformers 4.35/4.36 AttentionMaskConverter.to_4d (causal + padding, finfo.min fill)."""
    bsz, tgt_len = input_shape
    dtype = inputs_embeds.dtype
    min_val = torch.finfo(dtype).min
    src_len = past_key_values_length + tgt_len
    causal = torch.full((tgt_len, tgt_len), min_val)
    cond = torch.arange(tgt_len)
    causal.masked_fill_(cond < (cond + 1).view(tgt_len, 1), 0)
    causal = causal.to(dtype)
    if past_key_values_length > 0:
        causal = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype), causal], dim=-1)
    causal_4d = causal[None, None, :, :].expand(bsz, 1, tgt_len, src_len)
    expanded = attention_mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted = 1.0 - expanded
    expanded_attn_mask = inverted.masked_fill(inverted.to(torch.bool), min_val)
    expanded_attn_mask = causal_4d.masked_fill(expanded_attn_mask.bool(), min_val)
    return expanded_attn_mask


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True):
        bsz, seq_length = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        inputs_embeds = self.embed_tokens(input_ids)
        attention_mask = _prepare_4d_causal_attention_mask(
            attention_mask, (bsz, seq_length), inputs_embeds, past_len)
        hidden_states = inputs_embeds
        next_cache = []
        for idx, layer in enumerate(self.layers):
            pkv = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = layer(hidden_states, attention_mask=attention_mask,
                                           position_ids=position_ids, past_key_value=pkv,
                                           use_cache=use_cache)
            next_cache.append(present)
        logits = self.lm_head(self.norm(hidden_states))
        return logits, tuple(next_cache)


@torch.no_grad()
def greedy_generate(model, input_ids, attention_mask, max_new_tokens):
    """GenerationMixin.greedy_search + LlamaForCausalLM.prepare_inputs_for_generation."""
    past_key_values = None
    step_logits = []
    for _ in range(max_new_tokens):
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        if past_key_values is not None:
            model_ids = input_ids[:, -1:]
            position_ids = position_ids[:, -1:]
        else:
            model_ids = input_ids
        logits, past_key_values = model(model_ids, attention_mask, position_ids, past_key_values)
        next_logits = logits[:, -1, :]
        step_logits.append(next_logits)
        next_tokens = next_logits.argmax(-1)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
    return input_ids, torch.stack(step_logits, 1)


config = LlamaConfig()
model = LlamaForCausalLM(config).eval()
with torch.no_grad():
    for p in model.parameters():
        p.mul_(2.0)

# tokenizer(padding_side="left") output for two prompts of length 9 and 4
long_prompt = torch.randint(1, config.vocab_size, (9,))
short_prompt = torch.randint(1, config.vocab_size, (4,))
pad = config.pad_token_id
input_ids = torch.stack([long_prompt, torch.cat([torch.full((5,), pad), short_prompt])])
attention_mask = torch.stack([torch.ones(9, dtype=torch.long),
                              torch.cat([torch.zeros(5, dtype=torch.long), torch.ones(4, dtype=torch.long)])])

out_ids, logits = greedy_generate(model, input_ids, attention_mask, max_new_tokens=6)
print("mode:", "fixed" if FIXED else "buggy")
print("generated row 0:", out_ids[0, 9:].tolist())
print("generated row 1:", out_ids[1, 9:].tolist())
print("first-step logits row 1 [:5]:", [round(v, 4) for v in logits[1, 0, :5].tolist()])
print("sum |logits| row 1:", round(logits[1].abs().sum().item(), 4))

# the short prompt alone, no padding
ids_alone, logits_alone = greedy_generate(model, short_prompt[None], torch.ones(1, 4, dtype=torch.long), 6)
print("row 1 generated alone:", ids_alone[0, 4:].tolist())
print("max |batched - alone| logits row 1:", round((logits[1] - logits_alone[0]).abs().max().item(), 6))
