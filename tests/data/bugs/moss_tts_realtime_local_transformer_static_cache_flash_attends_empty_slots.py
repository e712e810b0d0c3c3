# OpenMOSS/MOSS-TTS#52 (commit b56a287, "Fix `dynamic_cache` when using flash_attention_2 in moss_tts_realtime"):
# MOSS-TTS-Realtime decodes each audio frame's 16 RVQ codebooks with a small "local transformer", one codebook per
# step, under a KV cache built in MossTTSRealtimeInference.generate_local_transformer (moss_tts_realtime/inferencer.py)
# as StaticCache(max_cache_len=channels). With attn_implementation="flash_attention_2" the causal mask is None and
# flash-attn gets the whole preallocated cache, so at codebook i the step also attends the channels - i - 1 empty
# (zero) slots of the static cache. The fix builds a DynamicCache for the local transformer when the model runs with
# flash_attention_2 (`_build_local_past_key_values`), so the kernel only sees the codebooks already decoded.
# Tiny sizes; the flash-attn kernel is replaced by a CPU function with its semantics (no mask argument, causal
# aligned bottom-right).
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.configuration_utils import PretrainedConfig
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

FIXED = "--fixed" in sys.argv


class MossTTSRealtimeLocalTransformerConfig(PretrainedConfig):
    model_type = "moss_tts_realtime_local_transformer"

    def __init__(
        self,
        head_dim: int = 16,
        use_cache: bool = True,
        hidden_size: int = 64,
        rms_norm_eps: float = 1e-6,
        num_hidden_layers: int = 2,
        intermediate_size: int = 128,
        num_attention_heads: int = 4,
        initializer_range: float = 0.02,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        max_position_embeddings: int = 33,
        num_key_value_heads: int = 2,
        hidden_act: str = "silu",
        rope_theta: int = 1000000,
        rope_type: str = "linear",
        pad_token_id: int = 64,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.head_dim = head_dim
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.hidden_act = hidden_act
        self.rope_theta = rope_theta
        self.rope_type = rope_type
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.num_key_value_heads = num_key_value_heads
        self.max_position_embeddings = max_position_embeddings
        self.pad_token_id = pad_token_id

        self.audio_pad_token = 64
        self.audio_vocab_size = 67
        self.rvq = 8


class MossTTSRealtimeConfig(PretrainedConfig):
    model_type = "moss_tts_realtime"

    def __init__(self, local_config=None, rvq: int = 8, audio_pad_token: int = 64, audio_vocab_size: int = 67, **kwargs):
        super().__init__(**kwargs)
        self.rvq = rvq
        self.audio_pad_token = audio_pad_token
        self.audio_vocab_size = audio_vocab_size
        self.local_config = local_config if local_config is not None else MossTTSRealtimeLocalTransformerConfig()
        attn_impl = self._attn_implementation
        self.local_config._attn_implementation = attn_impl


# --- attention kernels -------------------------------------------------------------------------------------------

def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """CPU stand-in for flash_attn.flash_attn_func: (B, L, H, D) layout, MQA/GQA by head groups, no mask argument,
    causal aligned to the bottom-right corner of the score matrix when seqlen_q != seqlen_k."""
    b, lq, hq, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = d**-0.5
    k = k.repeat_interleave(hq // hk, dim=2)
    v = v.repeat_interleave(hq // hk, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * softmax_scale
    if causal:
        keep = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(q.dtype)


def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, **kwargs):
    # transformers/integrations/flash_attention.py: (B, H, L, D) -> (B, L, H, D); the padding mask is only used to
    # unpad, and it is None when the batch has no padding.
    query = query.transpose(1, 2)
    key = key.transpose(1, 2)
    value = value.transpose(1, 2)
    is_causal = kwargs.pop("is_causal", None)
    if is_causal is None:
        is_causal = module.is_causal
    attn_output = flash_attn_func(query, key, value, dropout, softmax_scale=scaling, causal=is_causal)
    return attn_output, None


def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    causal_mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask is not None else None
    attn_output = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_mask, dropout_p=dropout,
                                                 scale=scaling, is_causal=False)
    return attn_output.transpose(1, 2).contiguous(), None


ALL_ATTENTION_FUNCTIONS = {"flash_attention_2": flash_attention_forward, "sdpa": sdpa_attention_forward}


def create_causal_mask(config, input_embeds, attention_mask, cache_position, past_key_values, position_ids=None):
    # transformers.masking_utils.create_causal_mask (5.0): no mask at all for flash_attention_2 when there is no
    # padding; otherwise a (B, 1, q, kv_length) mask over the cache's full length (a static cache's max_cache_len).
    if config._attn_implementation == "flash_attention_2":
        return None
    if past_key_values is not None and isinstance(past_key_values, StaticCache):
        kv_length = past_key_values.get_max_length()
    else:
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        kv_length = past + input_embeds.shape[1]
    kv_idx = torch.arange(kv_length)
    allowed = kv_idx[None, :] <= cache_position[:, None]
    mask = torch.zeros(allowed.shape, dtype=input_embeds.dtype).masked_fill(~allowed, torch.finfo(input_embeds.dtype).min)
    return mask[None, None].expand(input_embeds.shape[0], 1, -1, -1)


# --- modeling_mossttsrealtime_local.py ---------------------------------------------------------------------------

class MossTTSRealtimeLocalTransformerRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class MossTTSRealtimeLocalTransformerMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


class MossTTSRealtimeLocalTransformerAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = MossTTSRealtimeLocalTransformerRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = MossTTSRealtimeLocalTransformerRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.sliding_window = None

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values: Optional[Cache] = None,
                cache_position=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings

        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_values is not None:
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx, cache_kwargs)

        attention_interface = eager_attention_forward
        if self.config._attn_implementation != "eager":
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]

        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class MossTTSRealtimeLocalTransformerDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = MossTTSRealtimeLocalTransformerAttention(config=config, layer_idx=layer_idx)
        self.mlp = MossTTSRealtimeLocalTransformerMLP(config)
        self.input_layernorm = MossTTSRealtimeLocalTransformerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MossTTSRealtimeLocalTransformerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                cache_position=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            cache_position=cache_position,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class MossTTSRealtimeLocalTransformerRotaryEmbedding(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        self.config = config
        # rope_type "linear" with factor 1.0
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class MossTTSRealtimeLocalTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.ModuleList(
            [nn.Embedding(config.audio_vocab_size, config.hidden_size, config.audio_pad_token) for _ in range(config.rvq - 1)]
        )
        self.layers = nn.ModuleList(
            [MossTTSRealtimeLocalTransformerDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = MossTTSRealtimeLocalTransformerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MossTTSRealtimeLocalTransformerRotaryEmbedding(config=config)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, cache_position=None, codebook_idx=None, **kwargs):
        if use_cache and past_key_values is None:
            past_key_values = StaticCache(config=self.config, max_cache_len=self.config.rvq)

        if cache_position is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            inputs_seq_length = inputs_embeds.shape[1] if inputs_embeds is not None else input_ids.shape[1]
            cache_position = torch.arange(past_seen_tokens, past_seen_tokens + inputs_seq_length)

        if inputs_embeds is None:
            if input_ids.ndim == 1:
                input_ids = input_ids.unsqueeze(1)
            token_emb = self.embed_tokens[codebook_idx - 1](input_ids[:, 0]).unsqueeze(1)  # [B,1,H]
            inputs_embeds = token_emb

        causal_mask = create_causal_mask(
            config=self.config,
            input_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache_position=cache_position,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )

        hidden_states = inputs_embeds
        position_ids = cache_position.unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                cache_position=cache_position,
                position_embeddings=position_embeddings,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states,
                                       past_key_values=past_key_values if use_cache else None)


class MossTTSRealtimeLocalTransformerForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = MossTTSRealtimeLocalTransformer(config)
        self.local_lm_heads = nn.ModuleList(
            [nn.Linear(config.hidden_size, config.audio_vocab_size, bias=False) for _ in range(config.rvq)]
        )

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache_position=None, codebook_idx=None, logits_to_keep=0, **kwargs):
        outputs = self.model(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            cache_position=cache_position,
            codebook_idx=codebook_idx,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if logits_to_keep else slice(0, None)
        hs = hidden_states[:, slice_indices, :]
        logits = self.local_lm_heads[codebook_idx](hs[:, 0, :]).unsqueeze(1)
        return CausalLMOutputWithPast(logits=logits.contiguous(), past_key_values=outputs.past_key_values)


class MossTTSRealtime(nn.Module):
    """The parts of MossTTSRealtime the codebook loop reads (the Qwen3 backbone is left out: its last hidden state
    per frame is the loop's input)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.local_transformer = MossTTSRealtimeLocalTransformerForCausalLM(config.local_config)


# --- inferencer.py -----------------------------------------------------------------------------------------------

class MossTTSRealtimeInference:
    def __init__(self, model, channels=8):
        self.model = model
        self.channels = channels
        self._use_dynamic_local_cache = self.model.config._attn_implementation == "flash_attention_2"

    def _build_local_past_key_values(self):
        if FIXED and self._use_dynamic_local_cache:
            return DynamicCache()
        return StaticCache(config=self.model.local_transformer.config, max_cache_len=self.channels)

    @torch.no_grad()
    def generate_local_transformer(self, hidden_states, temperature, top_p, top_k, do_sample, repetition_penalty,
                                   repetition_window, generated_tokens, gen_step):
        batch_size = hidden_states.shape[0]
        device = hidden_states.device
        local_inputs = hidden_states.reshape(-1, 1, self.model.config.local_config.hidden_size)
        output_token = torch.empty(batch_size, self.channels, dtype=torch.long, device=device)
        self.last_logits = []

        past_key_values = self._build_local_past_key_values()
        local_token = None

        cache_pos_t = torch.zeros(1, dtype=torch.long, device=device)

        for i in range(self.channels):
            cache_pos_t.fill_(i)

            local_outputs = self.model.local_transformer(
                input_ids=local_token,
                inputs_embeds=local_inputs,
                past_key_values=past_key_values,
                cache_position=cache_pos_t,
                codebook_idx=i,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = local_outputs.logits
            self.last_logits.append(logits[:, -1])

            local_token = self.sample_token(logits=logits, temperature=temperature, top_p=top_p, top_k=top_k,
                                            do_sample=do_sample)
            output_token[:, i] = local_token.squeeze(-1)

            if i == 0:
                local_inputs = None
        return output_token

    def sample_token(self, logits, temperature, top_p=0.6, top_k=30, do_sample=True):
        if not do_sample or temperature == 0:
            return torch.argmax(logits, dim=-1)
        raise NotImplementedError


def main():
    torch.manual_seed(0)
    local_config = MossTTSRealtimeLocalTransformerConfig()
    config = MossTTSRealtimeConfig(local_config=local_config, rvq=local_config.rvq)
    # MossTTSRealtime.from_pretrained(..., attn_implementation="flash_attention_2"), as app.py loads it
    config._attn_implementation = "flash_attention_2"
    config.local_config._attn_implementation = "flash_attention_2"
    model = MossTTSRealtime(config).eval()
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.3)

    inferencer = MossTTSRealtimeInference(model, channels=config.rvq)
    # the backbone's last hidden state for the current frame of two streaming sessions
    backbone_hidden = torch.randn(2, 1, local_config.hidden_size)
    codes = inferencer.generate_local_transformer(
        hidden_states=backbone_hidden, temperature=0.0, top_p=0.6, top_k=30, do_sample=False,
        repetition_penalty=None, repetition_window=None, generated_tokens=None, gen_step=0,
    )
    logits = torch.stack(inferencer.last_logits, dim=1)
    print("fixed" if FIXED else "buggy")
    print("RVQ codes of the frame:", codes.tolist())
    print("top logit per codebook:", [[round(float(v), 4) for v in row] for row in logits.max(dim=-1).values])


if __name__ == "__main__":
    main()
