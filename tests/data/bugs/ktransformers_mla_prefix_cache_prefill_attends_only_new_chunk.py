# ktransformers server prefix cache + KDeepseekV2Attention.forward_linux_flashinfer (MLA, paged latent cache).
#
# Citation: kvcache-ai/ktransformers commit 2ffb43f9 ("fix: adapt prefix cache in `forward_linux_flashinfer`",
# merged with the server prefix cache in PR #382, merge cf4da5fd).
#
# The server's TransformersInterface.prefill keeps the StaticCache of the previous turn, finds the common prefix with
# the new prompt, calls cache.remove_suffix(same_prefix) and prefills only the new tokens with
# cache_position = arange(same_prefix, seq_length).  Before the fix, the prefill branch (q_len > 1) of
# forward_linux_flashinfer wrote the new latent KV into the paged cache but then threw away what update() returned
# and built keys/values from the new tokens only (k_pe[:, :q_len]), so flash_attn_func(causal=True) ran the new
# chunk against itself: the cached prefix was never attended.  The fix computes kv_seq_len = q_len +
# get_usable_length(), takes the latent KV of all kv_seq_len positions out of the paged cache, and runs
# flash_attn_func with q_len queries over kv_seq_len keys.
#
# flash_attn is CUDA-only: flash_attn_func below is a plain-torch stand-in with flash-attn's own semantics
# ((b, s, h, d) layout, causal aligned to the bottom-right corner when seqlen_q != seqlen_k).
import math
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from transformers import DeepseekV2Config

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    # q: (b, sq, h, d), k/v: (b, sk, h, d)
    sq, sk = q.shape[1], k.shape[1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * softmax_scale
    if causal:
        row = torch.arange(sq)[:, None]
        col = torch.arange(sk)[None, :]
        scores = scores.masked_fill(col > row + (sk - sq), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.float()).to(q.dtype)


# --- ktransformers/models/custom_cache.py (MLA / paged part) ---------------------------------------------------
class StaticCache:
    def __init__(self, config, max_batch_size: int, max_cache_len: int, device, dtype=None) -> None:
        self.max_batch_size = max_batch_size
        self.max_cache_len = config.max_position_embeddings if max_cache_len is None else max_cache_len
        self.dtype = dtype if dtype is not None else torch.float32
        self.key_cache: List[torch.Tensor] = []
        self.value_cache: List[Optional[torch.Tensor]] = []
        if config.architectures[0] == "DeepseekV2ForCausalLM" or config.architectures[0] == "DeepseekV3ForCausalLM":
            self.page_size = 64
            self.max_pages = (self.max_cache_len + self.page_size - 1) // self.page_size
            latent_shape = (self.max_pages, self.page_size, 1, config.kv_lora_rank + config.qk_rope_head_dim)
            self.kv_lora_rank = config.kv_lora_rank
            self.qk_rope_head_dim = config.qk_rope_head_dim
            self.page_table_list = []
            page_table = torch.zeros((max_batch_size, self.max_pages), dtype=torch.int32, device=device)
            for seq_id in range(max_batch_size):
                page_table[seq_id, :] = torch.arange(seq_id * self.max_pages, seq_id * self.max_pages + self.max_pages,
                                                     dtype=torch.int32, device=device)
            for idx in range(config.num_hidden_layers):
                self.page_table_list.append(page_table)
            self.is_MLA = True
            self.is_page = True
        self.past_tokens = []
        self.num_hidden_layers = config.num_hidden_layers
        for idx in range(self.num_hidden_layers):
            self.key_cache.append(torch.zeros(latent_shape, dtype=self.dtype, device=device))
            self.value_cache.append(None)
            self.past_tokens.append(0)

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs: Optional[Dict[str, Any]] = None):
        cache_position = cache_kwargs.get("cache_position")
        k_out = self.key_cache[layer_idx]
        self.past_tokens[layer_idx] += cache_position.size(0)
        page_idx = cache_position // self.page_size
        page_offset = cache_position % self.page_size
        # key shape (self.max_pages, self.page_size, 1, config.kv_lora_rank + config.qk_rope_head_dim)
        k_out[page_idx, page_offset, :, :self.kv_lora_rank] = key_states
        k_out[page_idx, page_offset, :, self.kv_lora_rank:] = value_states
        return k_out, self.page_table_list[layer_idx]

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        return self.past_tokens[layer_idx]

    def get_max_length(self) -> Optional[int]:
        return self.max_cache_len

    def get_usable_length(self, new_seq_length: int, layer_idx: Optional[int] = 0) -> int:
        # transformers.Cache.get_usable_length (v4.4x)
        max_length = self.get_max_length()
        previous_seq_length = self.get_seq_length(layer_idx)
        if max_length is not None and previous_seq_length + new_seq_length > max_length:
            return max_length - new_seq_length
        return previous_seq_length

    def remove_suffix(self, start_pos):
        for layer_idx in range(len(self.key_cache)):
            k_cache = self.key_cache[layer_idx]
            k_cache.view(-1, k_cache.shape[-1])[start_pos:].zero_()
            self.past_tokens[layer_idx] = start_pos


# --- modeling_deepseek pieces ----------------------------------------------------------------------------------
class DeepseekV2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class DeepseekV2RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


# --- ktransformers/operators/attention.py: KDeepseekV2Attention.forward_linux_flashinfer ----------------------
class KDeepseekV2Attention(nn.Module):
    def __init__(self, config: DeepseekV2Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.v_head_dim = config.v_head_dim
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.q_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(self.hidden_size, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = DeepseekV2RMSNorm(config.kv_lora_rank)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank,
                                   self.num_heads * (self.q_head_dim - self.qk_rope_head_dim + self.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, self.hidden_size, bias=False)
        self.rotary_emb = DeepseekV2RotaryEmbedding(self.qk_rope_head_dim)
        self.softmax_scale = self.q_head_dim ** (-0.5)

    def forward_linux_flashinfer(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                                 output_attentions=False, use_cache=False, cache_position=None, **kwargs):
        bsz, q_len, _ = hidden_states.size()

        q = self.q_proj(hidden_states)
        q = q.view(bsz, q_len, self.num_heads, self.q_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        compressed_kv, k_pe = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        compressed_kv = self.kv_a_layernorm(compressed_kv)
        k_pe = k_pe.view(bsz, q_len, 1, self.qk_rope_head_dim)
        compressed_kv = compressed_kv.view(bsz, q_len, 1, self.kv_lora_rank)

        if FIXED:
            kv_seq_len = q_len
            if past_key_value is not None:
                kv_seq_len += past_key_value.get_usable_length(kv_seq_len, self.layer_idx)

        cos, sin = self.rotary_emb(q_pe, position_ids)
        q_pe, k_pe = apply_rotary_pos_emb(q_pe, k_pe, cos, sin, unsqueeze_dim=2)

        # prefill (q_len > 1); the decode branch goes through the flashinfer MLA wrapper
        if not FIXED:
            if past_key_value is not None:
                cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}  # Specific to RoPE models
                k_pe.squeeze(0)
                compressed_kv.squeeze(0)
                past_key_value.update(compressed_kv, k_pe, self.layer_idx, cache_kwargs)
                k_pe.unsqueeze(0)
                compressed_kv.unsqueeze(0)

            k_pe = k_pe[:, :q_len]
            compressed_kv = compressed_kv[:, :q_len]
            kv = (
                self.kv_b_proj(compressed_kv)
                .view(bsz, q_len, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
            )
            k_nope, value_states = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            query_states = k_pe.new_empty(bsz, q_len, self.num_heads, self.q_head_dim)
            query_states[:, :, :, : self.qk_nope_head_dim] = q_nope
            query_states[:, :, :, self.qk_nope_head_dim:] = q_pe

            key_states = k_pe.new_empty(bsz, q_len, self.num_heads, self.q_head_dim)
            key_states[:, :, :, :self.qk_nope_head_dim] = k_nope
            key_states[:, :, :, self.qk_nope_head_dim:] = k_pe

            value_states = value_states.view(bsz, q_len, self.num_heads, self.v_head_dim)
        else:
            if past_key_value is not None:
                cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}  # Specific to RoPE models
                k_pe.squeeze(0)
                compressed_kv.squeeze(0)
                compressed_kv_with_k_pe, _ = past_key_value.update(compressed_kv, k_pe, self.layer_idx, cache_kwargs)
                compressed_kv, k_pe = torch.split(
                    compressed_kv_with_k_pe, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
                )
            k_pe = k_pe.view(bsz, -1, self.qk_rope_head_dim)
            k_pe = k_pe[:, :kv_seq_len]
            compressed_kv = compressed_kv.view(bsz, -1, self.kv_lora_rank)
            compressed_kv = compressed_kv[:, :kv_seq_len]
            kv = (
                self.kv_b_proj(compressed_kv)
                .view(bsz, kv_seq_len, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
            )
            k_nope, value_states = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            query_states = k_pe.new_empty(bsz, q_len, self.num_heads, self.q_head_dim)
            query_states[:, :, :, : self.qk_nope_head_dim] = q_nope
            query_states[:, :, :, self.qk_nope_head_dim:] = q_pe

            key_states = k_pe.new_empty(bsz, kv_seq_len, self.num_heads, self.q_head_dim)
            key_states[:, :, :, :self.qk_nope_head_dim] = k_nope
            key_states[:, :, :, self.qk_nope_head_dim:] = k_pe.view(bsz, kv_seq_len, 1, -1)

            value_states = value_states.view(bsz, kv_seq_len, self.num_heads, self.v_head_dim)

        value_states_padded = torch.nn.functional.pad(value_states, [0, query_states.shape[-1] - value_states.shape[-1]],
                                                      value=0)

        attn_output = flash_attn_func(
            query_states,
            key_states,
            value_states_padded,
            softmax_scale=self.softmax_scale,
            causal=True,
        )

        if self.q_head_dim != self.v_head_dim:
            attn_output = attn_output[:, :, :, : self.v_head_dim]

        attn_output = attn_output.reshape(bsz, q_len, self.num_heads * self.v_head_dim).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, None, past_key_value

    forward = forward_linux_flashinfer


class DeepseekV2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = KDeepseekV2Attention(config, layer_idx)
        self.mlp = DeepseekV2MLP(config)
        self.input_layernorm = DeepseekV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                cache_position=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                             position_ids=position_ids, past_key_value=past_key_value,
                                             use_cache=True, cache_position=cache_position)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class DeepseekV2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DeepseekV2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DeepseekV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs_embeds, attention_mask=None, past_key_values=None, cache_position=None):
        position_ids = cache_position.unsqueeze(0)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  past_key_value=past_key_values, cache_position=cache_position)
        return self.norm(hidden_states)


class DeepseekV2ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = DeepseekV2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, inputs_embeds, cache_position, past_key_values, return_dict=False, use_cache=True,
                attention_mask=None):
        hidden = self.model(inputs_embeds, attention_mask=attention_mask, past_key_values=past_key_values,
                            cache_position=cache_position)
        return (self.lm_head(hidden).float(),)


# --- ktransformers/server/backend/interfaces/transformers.py: TransformersInterface.prefill (prefix reuse) --------
class TransformersInterface:
    def __init__(self, model, cache, max_new_tokens=4):
        self.model = model
        self.cache = cache
        self.max_new_tokens = max_new_tokens
        self.batch_size = 1
        self.generated_ids = None
        self.seq_length = 1

    def append_new_tokens(self, new_tokens):
        self.generated_ids[0, self.seq_length] = new_tokens
        self.seq_length += 1
        return new_tokens

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, is_new: bool):
        if is_new:
            same_prefix = 0
            flat_input_ids = input_ids.flatten()
            if self.generated_ids is None:
                self.generated_ids = torch.zeros(self.batch_size, input_ids.shape[-1] + self.max_new_tokens + 1,
                                                 dtype=torch.int)
                self.seq_length = 1
            flat_prev_ids = self.generated_ids.flatten()
            for i in range(min(self.seq_length, flat_input_ids.shape[0]) - 1):
                if flat_input_ids[i] == flat_prev_ids[i]:
                    same_prefix += 1
                else:
                    break
            self.cache.remove_suffix(same_prefix)
            self.seq_length = same_prefix
            self.generated_ids = self.generated_ids[..., :same_prefix]
            input_ids = input_ids[..., same_prefix:]
        input_ids_length = input_ids.shape[-1]

        former_seq_length = self.seq_length
        self.seq_length += input_ids_length
        expected_length = self.seq_length + self.max_new_tokens + 1
        delta_length = expected_length - self.generated_ids.shape[-1]
        if delta_length > 0:
            self.generated_ids = torch.cat(
                [self.generated_ids, torch.zeros(self.batch_size, delta_length, dtype=torch.int)], dim=-1)
        cache_position = torch.arange(former_seq_length, self.seq_length)
        self.generated_ids[:, cache_position] = input_ids.to(torch.int)

        mask = torch.ones((1, self.seq_length))
        inputs_embeds = self.model.model.embed_tokens(input_ids)
        logits = self.model(inputs_embeds=inputs_embeds, cache_position=cache_position, past_key_values=self.cache,
                            return_dict=False, use_cache=True, attention_mask=mask)[0]
        next_token = int(torch.argmax(logits[0, -1, :]))
        self.append_new_tokens(next_token)
        return logits, next_token, former_seq_length


def main():
    config = DeepseekV2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6,
        architectures=["DeepseekV2ForCausalLM"],
    )
    model = DeepseekV2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    cache = StaticCache(config, max_batch_size=1, max_cache_len=128, device="cpu")
    interface = TransformersInterface(model, cache)

    turn1 = torch.randint(0, config.vocab_size, (1, 12))
    logits1, tok1, start1 = interface.prefill(turn1, is_new=True)
    print(f"turn 1: prefilled positions {start1}..{interface.seq_length - 2}, next token {tok1}")

    # second turn of the same conversation: the first turn, its answer token, then new user tokens
    turn2 = torch.cat([turn1, torch.tensor([[tok1]]), torch.randint(0, config.vocab_size, (1, 7))], dim=-1)
    logits2, tok2, start2 = interface.prefill(turn2, is_new=True)
    print(f"turn 2: prefix reused up to {start2}, prefilled {turn2.shape[-1] - start2} new tokens, next token {tok2}")
    print("turn 2 last-position logits[:6]:", [round(x, 4) for x in logits2[0, -1, :6].tolist()])
    print("turn 2 logits sum: %.5f" % logits2.sum().item())


if __name__ == "__main__":
    main()
