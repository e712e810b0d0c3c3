# Citation: NVIDIA/Megatron-LM commit 9ddbac6b53002ba5a5c429ca4401a598bf1af611 ("TE inference pass attn_mask_type
#   in forward", merged from branch 'te_infer_fix', merge 44f6b26e34); buggy code read at 9ddbac6b53^.
# Upstream: megatron/core/transformer/attention.py (Attention._adjust_key_value_for_inference, Attention.forward)
#   and megatron/core/transformer/custom_layers/transformer_engine.py (TEDotProductAttention, a subclass of
#   te.pytorch.DotProductAttention built once with attn_mask_type="causal").
# Bug: during KV-cache generation every decode step hands TE one query against all cached keys, but the core
#   attention still runs with the mask type it was built with ("causal"). The kernel aligns that causal mask
#   top-left (query i sees keys 0..i, as flash-attn 2.0.x did for sq != sk), so each new token only sees the
#   first cached token instead of the whole prefix.
# Fix: _adjust_key_value_for_inference returns attn_mask_type=AttnMaskType.no_mask once the KV cache exists
#   (decode steps), and Attention.forward passes attn_mask_type through to TEDotProductAttention.forward.
import enum
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3  # only used for TE


@dataclass
class TransformerConfig:
    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int = 4
    kv_channels: int = 8
    ffn_hidden_size: int = 64
    vocab_size: int = 64
    rotary_base: int = 10000


class InferenceParams:
    """megatron.core.InferenceParams"""

    def __init__(self, max_batch_size, max_sequence_length):
        self.max_sequence_length = max_sequence_length
        self.max_batch_size = max_batch_size
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict = {}


# ------------------------------------------------------------------ kernel stand-in
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """Plain-torch stand-in for flash_attn_func (flash-attn 2.0.x): q [b, sq, h, d], k/v [b, sk, h, d].
    causal=True masks keys j > i (top-left aligned, also when sq != sk)."""
    sq, sk = q.shape[1], k.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


class DotProductAttention(nn.Module):
    """te.pytorch.DotProductAttention (flash backend), qkv_format 'sbhd'."""

    def __init__(self, num_attention_heads, kv_channels, attention_dropout=0.0, attn_mask_type="causal", **kw):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = 1.0 / math.sqrt(kv_channels)

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, attn_mask_type=None):
        if attn_mask_type is None:
            attn_mask_type = self.attn_mask_type
        # sbhd -> bshd
        q, k, v = [x.transpose(0, 1) for x in (query_layer, key_layer, value_layer)]
        out = flash_attn_func(q, k, v, 0.0, softmax_scale=self.softmax_scale, causal=(attn_mask_type == "causal"))
        sq, b = query_layer.shape[0], query_layer.shape[1]
        return out.transpose(0, 1).reshape(sq, b, -1)


class TEDotProductAttention(DotProductAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type):
        self.config = config
        self.te_forward_mask_type = True  # te_version > 0.12.0
        super().__init__(
            num_attention_heads=config.num_attention_heads,
            kv_channels=config.kv_channels,
            attention_dropout=0.0,
            attn_mask_type=attn_mask_type.name,
            layer_number=layer_number,
        )

    if FIXED:

        def forward(self, query, key, value, attention_mask, attn_mask_type):
            if self.te_forward_mask_type:
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type.name)
            else:
                return super().forward(query, key, value, attention_mask)


# ------------------------------------------------------------------ rotary
class RotaryEmbedding(nn.Module):
    def __init__(self, kv_channels, rotary_base=10000):
        super().__init__()
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, kv_channels, 2, dtype=torch.float32) / kv_channels))

    def forward(self, max_seq_len, offset=0):
        seq = torch.arange(max_seq_len, dtype=torch.float32) + offset
        freqs = torch.outer(seq, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]  # [s, 1, 1, d]


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * freqs.cos()) + (_rotate_half(t) * freqs.sin())
    return torch.cat((t, t_pass), dim=-1)


# ------------------------------------------------------------------ megatron/core/transformer/attention.py
class SelfAttention(nn.Module):
    def __init__(self, config, layer_number, attn_mask_type=AttnMaskType.causal):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_query_groups
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.num_query_groups_per_partition = config.num_query_groups
        self.core_attention = TEDotProductAttention(config, layer_number, attn_mask_type, "self")
        self.linear_qkv = nn.Linear(config.hidden_size, self.query_projection_size + 2 * self.kv_projection_size)
        self.linear_proj = nn.Linear(self.query_projection_size, config.hidden_size)

    def _allocate_memory(self, inference_max_sequence_length, batch_size, dtype):
        return torch.empty(
            inference_max_sequence_length, batch_size, self.num_query_groups_per_partition,
            self.hidden_size_per_attention_head, dtype=dtype,
        )

    def _adjust_key_value_for_inference(self, inference_params, key, value, rotary_pos_emb):
        attn_mask_type = self.attn_mask_type
        if inference_params is None:
            return key, value, rotary_pos_emb, attn_mask_type

        is_first_step = False
        if self.layer_number not in inference_params.key_value_memory_dict:
            inf_max_seq_length = inference_params.max_sequence_length
            inf_max_batch_size = inference_params.max_batch_size
            inference_key_memory = self._allocate_memory(inf_max_seq_length, inf_max_batch_size, key.dtype)
            inference_value_memory = self._allocate_memory(inf_max_seq_length, inf_max_batch_size, value.dtype)
            inference_params.key_value_memory_dict[self.layer_number] = (inference_key_memory, inference_value_memory)
            is_first_step = True
        else:
            inference_key_memory, inference_value_memory = inference_params.key_value_memory_dict[self.layer_number]
            if FIXED:
                attn_mask_type = AttnMaskType.no_mask

        batch_start = inference_params.batch_size_offset
        batch_end = batch_start + key.size(1)
        sequence_start = inference_params.sequence_len_offset
        sequence_end = sequence_start + key.size(0)
        inference_key_memory[sequence_start:sequence_end, batch_start:batch_end, ...] = key
        inference_value_memory[sequence_start:sequence_end, batch_start:batch_end, ...] = value
        key = inference_key_memory[:sequence_end, batch_start:batch_end, ...]
        value = inference_value_memory[:sequence_end, batch_start:batch_end, ...]

        if rotary_pos_emb is not None:
            q_pos_emb, k_pos_emb = rotary_pos_emb
            if not is_first_step:
                q_pos_emb = q_pos_emb[sequence_end - 1 : sequence_end]
            else:
                q_pos_emb = q_pos_emb[:sequence_end, :, :, :]
            k_pos_emb = k_pos_emb[:sequence_end, :, :, :]
            rotary_pos_emb = (q_pos_emb, k_pos_emb)

        return key, value, rotary_pos_emb, attn_mask_type

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None):
        mixed_qkv = self.linear_qkv(hidden_states)
        sq, b = mixed_qkv.shape[:2]
        q, k, v = torch.split(
            mixed_qkv, [self.query_projection_size, self.kv_projection_size, self.kv_projection_size], dim=-1
        )
        q = q.view(sq, b, self.num_attention_heads_per_partition, self.hidden_size_per_attention_head)
        k = k.view(sq, b, self.num_query_groups_per_partition, self.hidden_size_per_attention_head)
        v = v.view(sq, b, self.num_query_groups_per_partition, self.hidden_size_per_attention_head)
        return q, k, v

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_params=None,
                rotary_pos_emb=None):
        if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb,) * 2
        query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
        key, value, rotary_pos_emb, attn_mask_type = self._adjust_key_value_for_inference(
            inference_params, key, value, rotary_pos_emb
        )
        if rotary_pos_emb is not None:
            q_pos_emb, k_pos_emb = rotary_pos_emb
            query = apply_rotary_pos_emb(query, q_pos_emb)
            key = apply_rotary_pos_emb(key, k_pos_emb)
        if FIXED:
            core_attn_out = self.core_attention(query, key, value, attention_mask, attn_mask_type=attn_mask_type)
        else:
            core_attn_out = self.core_attention(query, key, value, attention_mask)
        return self.linear_proj(core_attn_out)


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.self_attention = SelfAttention(config, layer_number, attn_mask_type=AttnMaskType.causal)
        self.pre_mlp_layernorm = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, config.ffn_hidden_size), nn.GELU(),
            nn.Linear(config.ffn_hidden_size, config.hidden_size),
        )

    def forward(self, hidden_states, attention_mask, inference_params=None, rotary_pos_emb=None):
        hidden_states = hidden_states + self.self_attention(
            self.input_layernorm(hidden_states), attention_mask, inference_params=inference_params,
            rotary_pos_emb=rotary_pos_emb,
        )
        return hidden_states + self.mlp(self.pre_mlp_layernorm(hidden_states))


class GPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, config.rotary_base)
        self.layers = nn.ModuleList([TransformerLayer(config, i + 1) for i in range(config.num_layers)])
        self.final_layernorm = nn.LayerNorm(config.hidden_size)
        self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, position_ids, attention_mask, inference_params=None):
        decoder_input = self.embedding(input_ids).transpose(0, 1).contiguous()  # [s, b, h]
        if inference_params is not None:
            rotary_seq_len = inference_params.max_sequence_length
        else:
            rotary_seq_len = decoder_input.size(0)
        rotary_pos_emb = self.rotary_pos_emb(rotary_seq_len)
        hidden_states = decoder_input
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, inference_params, rotary_pos_emb)
        logits = self.output_layer(self.final_layernorm(hidden_states))
        return logits.transpose(0, 1).contiguous()  # [b, s, v]


# ------------------------------------------------------------------ greedy generation with the KV cache
@torch.no_grad()
def generate(model, prompts, tokens_to_generate):
    batch_size, prompt_len = prompts.shape
    max_len = prompt_len + tokens_to_generate
    tokens = torch.cat([prompts, torch.zeros(batch_size, tokens_to_generate, dtype=torch.long)], dim=1)
    position_ids = torch.arange(max_len).unsqueeze(0).expand(batch_size, -1)
    attention_mask = torch.tril(torch.ones(1, 1, max_len, max_len)) < 0.5
    inference_params = InferenceParams(batch_size, max_len)
    prev_context_length = 0
    step_logits = []
    for context_length in range(prompt_len, max_len):
        tokens2use = tokens[:, prev_context_length:context_length]
        positions2use = position_ids[:, prev_context_length:context_length]
        attention_mask2use = attention_mask[..., prev_context_length:context_length, :context_length]
        logits = model(tokens2use, positions2use, attention_mask2use, inference_params=inference_params)
        inference_params.sequence_len_offset += tokens2use.size(1)
        last = logits[:, -1, :]
        step_logits.append(last)
        tokens[:, context_length] = last.argmax(dim=-1)
        prev_context_length = context_length
    return tokens, torch.stack(step_logits, dim=1)


def main():
    config = TransformerConfig()
    model = GPTModel(config).eval()
    prompts = torch.randint(1, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    tokens, step_logits = generate(model, prompts, tokens_to_generate=6)
    print("prompts  :", prompts.tolist())
    print("generated:", tokens[:, prompts.shape[1]:].tolist())
    print("per-step logit norm:", [round(x, 4) for x in step_logits.norm(dim=-1).mean(0).tolist()])
    # teacher-forced check of the generated text with one full (no-cache) forward
    full = model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), None)
    logp = F.log_softmax(full[:, prompts.shape[1] - 1 : -1], dim=-1)
    nll = -logp.gather(-1, tokens[:, prompts.shape[1]:].unsqueeze(-1)).mean()
    print(f"full-forward NLL of generated tokens: {nll.item():.4f}")


if __name__ == "__main__":
    main()
