# Citation: unslothai/unsloth#4100 ("Fix/pr 3699 leftpad prefill main"), commit 26f23be370
#   ("Fix attention mask handling, padding_idx zeroing, and Mistral batched generation", item 4).
# Upstream: unsloth/models/mistral.py MistralForCausalLM_fast_forward (no-xformers branch that builds
#   the 4-D mask), consumed by unsloth/models/llama.py LlamaModel_fast_forward (eval path,
#   _prepare_4d_causal_attention_mask_for_sdpa) and unsloth/utils/attention_dispatch.py run_attention (SDPA).
# Bug: when xformers is absent and a 2-D tokenizer attention_mask (1 = token, 0 = pad) is given, the
#   forward expanded it to [bsz, 1, q, q] and simply ADDED it to the additive causal mask (0 / -inf), so
#   real keys carried +1 and pad keys 0; run_attention's SDPA branch then turns a 4-D float mask into a
#   keep mask with `.eq(0)`, keeping pads and dropping real keys (fully-dropped rows are re-opened).
# Fix: convert the 0/1 padding mask to additive form first (1 -> 0.0, 0 -> -inf) and add it to the causal
#   mask; also force the SDPA backend whenever an attention_mask is present.
import math
import sys
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention
from transformers import MistralConfig

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)

# CPU: no flash-attn, no xformers
HAS_FLASH_ATTENTION = False
HAS_XFORMERS = False
SDPA_HAS_GQA = "enable_gqa" in (scaled_dot_product_attention.__doc__ or "")

FLASH_VARLEN = "flash_varlen"
FLASH_DENSE = "flash_dense"
XFORMERS = "xformers"
SDPA = "sdpa"


def _get_dtype(dtype):
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, dtype)


def dtype_from_config(config):
    return getattr(config, "dtype", None) or torch.float32


# ---------------------------------------------------------------- unsloth/utils/packing.py
def get_packed_info_from_kwargs(kwargs, device):
    packed_seq_lengths = kwargs.get("packed_seq_lengths", None)
    if packed_seq_lengths is None:
        return None
    lengths = packed_seq_lengths.to(device=device, dtype=torch.int32)
    cu_seqlens = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return lengths, cu_seqlens, int(lengths.max().item())


# ---------------------------------------------------------------- unsloth/utils/attention_dispatch.py
@dataclass
class AttentionConfig:
    backend: str
    n_kv_heads: int
    n_groups: int
    flash_dense_kwargs: Optional[dict] = None
    flash_varlen_kwargs: Optional[dict] = None
    sdpa_kwargs: Optional[dict] = None
    xformers_kwargs: Optional[dict] = None


@dataclass
class AttentionContext:
    bsz: int
    q_len: int
    kv_seq_len: int
    n_heads: int
    head_dim: int
    requires_grad: bool
    seq_info: Optional[Tuple[torch.Tensor, torch.Tensor, int]]
    attention_mask: Optional[torch.Tensor]
    causal_mask: Optional[Any]
    sliding_window: Optional[int] = None


def select_attention_backend(use_varlen: bool = False) -> str:
    if HAS_FLASH_ATTENTION:
        return FLASH_VARLEN if use_varlen else FLASH_DENSE
    if HAS_XFORMERS:
        return XFORMERS
    return SDPA


def run_attention(*, config, context, Q, K, V):
    backend = config.backend
    sdpa_kwargs = config.sdpa_kwargs or {}
    bsz = context.bsz
    n_heads = context.n_heads
    head_dim = context.head_dim
    kv_seq_len = context.kv_seq_len
    requires_grad = context.requires_grad
    sliding_window = context.sliding_window
    assert backend == SDPA  # CPU

    local_mask = context.attention_mask
    is_causal_local = False
    q_len_local = Q.shape[-2]
    k_len_local = K.shape[-2]
    # ---- SDPA mask normalization for left padding / 2D masks ----
    if local_mask is not None and isinstance(local_mask, torch.Tensor):
        local_mask = local_mask.to(device=Q.device)
        if local_mask.dim() == 2:
            key_keep = local_mask if local_mask.dtype == torch.bool else local_mask != 0
            past_len = k_len_local - q_len_local
            q_pos = torch.arange(past_len, past_len + q_len_local, device=Q.device)
            k_pos = torch.arange(k_len_local, device=Q.device)
            causal_keep = k_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                causal_keep &= k_pos[None, :] >= (q_pos[:, None] - (sliding_window - 1))
            local_mask = causal_keep[None, None, :, :] & key_keep[:, None, None, :]
        elif local_mask.dim() == 3:
            local_mask = local_mask[:, None, :, :]
        elif local_mask.dim() == 4:
            if local_mask.dtype != torch.bool:
                # Use boolean keep masks for better SDPA stability.
                local_mask = local_mask.eq(0)
        else:
            raise ValueError(f"Unsupported SDPA attention_mask rank: {local_mask.dim()}")

        # Avoid NaNs from fully-masked rows (common with left padding).
        if local_mask.dtype == torch.bool:
            no_allowed = ~local_mask.any(dim=-1, keepdim=True)
            local_mask = local_mask | no_allowed

    is_causal_local = local_mask is None and q_len_local == k_len_local

    kwargs = dict(sdpa_kwargs)
    kwargs.setdefault("attn_mask", local_mask)
    kwargs.setdefault("is_causal", is_causal_local)

    use_sdpa_gqa = SDPA_HAS_GQA and config.n_groups != 1
    if (
        use_sdpa_gqa
        and (not requires_grad)
        and isinstance(local_mask, torch.Tensor)
        and local_mask.dim() >= 3
        and local_mask.shape[0] > 1
    ):
        use_sdpa_gqa = False
    if use_sdpa_gqa:
        kwargs.setdefault("enable_gqa", True)
        out = scaled_dot_product_attention(Q, K, V, **kwargs)
        return out.transpose(1, 2)

    K_mod, V_mod = K, V
    if config.n_groups != 1:
        K_mod = K[:, :, None, :, :].expand(bsz, config.n_kv_heads, config.n_groups, kv_seq_len, head_dim)
        V_mod = V[:, :, None, :, :].expand(bsz, config.n_kv_heads, config.n_groups, kv_seq_len, head_dim)
        K_mod = K_mod.reshape(bsz, n_heads, kv_seq_len, head_dim)
        V_mod = V_mod.reshape(bsz, n_heads, kv_seq_len, head_dim)
    out = scaled_dot_product_attention(Q.contiguous(), K_mod.contiguous(), V_mod.contiguous(), **kwargs)
    return out.transpose(1, 2).contiguous()


# ---------------------------------------------------------------- transformers.modeling_attn_mask_utils
def _prepare_4d_causal_attention_mask_for_sdpa(attention_mask, input_shape, inputs_embeds,
                                                past_key_values_length, sliding_window=None):
    key_value_length = input_shape[-1] + past_key_values_length
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:
        expanded_4d_mask = attention_mask
    else:
        q_len = input_shape[-1]
        min_dtype = torch.finfo(inputs_embeds.dtype).min
        causal = torch.triu(torch.full((q_len, key_value_length), min_dtype), diagonal=1 + past_key_values_length)
        inverted = (1.0 - attention_mask[:, None, None, :].to(inputs_embeds.dtype)) * min_dtype
        expanded_4d_mask = (causal[None, None] + inverted).clamp(min=min_dtype)
    # _unmask_unattended only runs on CUDA tensors
    return expanded_4d_mask


# ---------------------------------------------------------------- unsloth kernels (plain torch)
def fast_rms_layernorm(layernorm, X, gemma=False):
    var = X.float().pow(2).mean(-1, keepdim=True)
    return (X.float() * torch.rsqrt(var + layernorm.variance_epsilon)).to(X.dtype) * layernorm.weight


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def fast_rope_embedding(Q, K, cos, sin, position_ids=None):
    if position_ids is None:
        cos_, sin_ = cos[: Q.shape[2]][None, None], sin[: Q.shape[2]][None, None]
    else:
        cos_, sin_ = cos[position_ids.long()][:, None], sin[position_ids.long()][:, None]
    return Q * cos_ + rotate_half(Q) * sin_, K * cos_ + rotate_half(K) * sin_


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings, base):
        super().__init__()
        self.dim, self.base = dim, base
        self.current_rope_size = 0
        self._set_cos_sin_cache(max_position_embeddings)

    def _set_cos_sin_cache(self, seq_len):
        self.current_rope_size = seq_len
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float() / self.dim))
        t = torch.arange(seq_len).float()
        emb = torch.cat([torch.outer(t, inv_freq)] * 2, dim=-1)
        self.cos_cached, self.sin_cached = emb.cos(), emb.sin()

    def extend_rope_embedding(self, x, seq_len):
        if seq_len > self.current_rope_size:
            self._set_cos_sin_cache(math.ceil(seq_len / 8192) * 8192)

    def get_cached(self, seq_len=None, device_index=None):
        return self.cos_cached, self.sin_cached


def original_apply_qkv(self, X):
    return self.q_proj(X), self.k_proj(X), self.v_proj(X)


def original_apply_o(self, X):
    return self.o_proj(X)


# ---------------------------------------------------------------- unsloth/models/mistral.py
def MistralAttention_fast_forward(self, hidden_states, causal_mask=None, attention_mask=None,
                                  position_ids=None, past_key_value=None, output_attentions=False,
                                  use_cache=False, padding_mask=None, position_embeddings=None,
                                  *args, **kwargs):
    bsz, q_len, _ = hidden_states.size()
    n_heads = self.config.num_attention_heads
    n_groups = self.num_key_value_groups
    n_kv_heads = self.config.num_key_value_heads
    head_dim = self.head_dim
    assert n_kv_heads * n_groups == n_heads

    Q, K, V = self.apply_qkv(self, hidden_states)
    Q = Q.view(bsz, q_len, n_heads, head_dim).transpose(1, 2)
    K = K.view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)
    V = V.view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)
    seq_info = get_packed_info_from_kwargs(kwargs, Q.device)

    kv_seq_len = K.shape[-2]
    if past_key_value is not None:
        kv_seq_len += past_key_value[0].shape[-2]

    self.rotary_emb.extend_rope_embedding(V, seq_len=kv_seq_len)
    cos, sin = self.rotary_emb.get_cached(kv_seq_len, Q.device.index)
    rope_position_ids = position_ids if position_ids is not None else kwargs.get("position_ids")
    Q, K = fast_rope_embedding(Q, K, cos, sin, rope_position_ids)

    if past_key_value is not None:
        K = torch.cat([past_key_value[0], K], dim=2)
        V = torch.cat([past_key_value[1], V], dim=2)
    past_key_value = (K, V) if use_cache else None

    sw_cfg = getattr(self.config, "sliding_window", None)
    sw = kv_seq_len if (sw_cfg is None or sw_cfg == "null") else sw_cfg
    window_size = (-1, -1) if (kv_seq_len <= sw) else (sw, sw)

    use_varlen = seq_info is not None and past_key_value is None and window_size == (-1, -1)
    if FIXED:
        backend = SDPA if attention_mask is not None else select_attention_backend(use_varlen)
    else:
        backend = select_attention_backend(use_varlen)
    attention_config = AttentionConfig(
        backend=backend,
        n_kv_heads=n_kv_heads,
        n_groups=n_groups,
        flash_dense_kwargs={"causal": True, "window_size": window_size},
        flash_varlen_kwargs={"dropout_p": 0.0, "causal": True,
                             "softmax_scale": getattr(self, "softmax_scale", None)},
    )
    context = AttentionContext(
        bsz=bsz, q_len=q_len, kv_seq_len=kv_seq_len, n_heads=n_heads, head_dim=head_dim,
        requires_grad=hidden_states.requires_grad, seq_info=seq_info,
        attention_mask=attention_mask, causal_mask=causal_mask,
    )
    A = run_attention(config=attention_config, context=context, Q=Q, K=K, V=V)
    attn_output = A.reshape(bsz, q_len, n_heads * head_dim)
    attn_output = self.apply_o(self, attn_output)
    return attn_output, None, past_key_value


# ---------------------------------------------------------------- unsloth/models/llama.py
def LlamaDecoderLayer_fast_forward(self, hidden_states, causal_mask=None, attention_mask=None,
                                   position_ids=None, past_key_value=None, output_attentions=False,
                                   use_cache=False, padding_mask=None, position_embeddings=None,
                                   *args, **kwargs):
    residual = hidden_states
    hidden_states = fast_rms_layernorm(self.input_layernorm, hidden_states)
    hidden_states, self_attn_weights, present_key_value = self.self_attn(
        hidden_states=hidden_states, causal_mask=causal_mask, attention_mask=attention_mask,
        position_ids=position_ids, past_key_value=past_key_value,
        output_attentions=output_attentions, use_cache=use_cache, padding_mask=padding_mask,
        position_embeddings=position_embeddings, **kwargs,
    )
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = fast_rms_layernorm(self.post_attention_layernorm, hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    outputs = (hidden_states,)
    if use_cache:
        outputs += (present_key_value,)
    return outputs


def LlamaModel_fast_forward(self, input_ids=None, causal_mask=None, attention_mask=None,
                            position_ids=None, past_key_values=None, inputs_embeds=None,
                            use_cache=None, output_attentions=None, output_hidden_states=None,
                            return_dict=None, *args, **kwargs):
    batch_size, seq_length = input_ids.shape
    past_key_values_length = 0

    if position_ids is not None:
        position_ids = position_ids.view(-1, seq_length).to(torch.int32)
        if position_ids.shape[0] != batch_size:
            position_ids = position_ids.repeat((batch_size, 1))

    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)
    inputs_embeds = inputs_embeds.to(_get_dtype(dtype_from_config(self.config)))
    train_embed_tokens = self.embed_tokens.weight.requires_grad

    # Fix up attention mask by setting elements to 0 -- Specifically for DPO
    if (getattr(self, "_has_no_labels", False) is True and (attention_mask is not None)
            and (past_key_values is None) and (not train_embed_tokens) and self.training):
        attention_mask = attention_mask[:, : self.max_seq_length]
        inputs_embeds = inputs_embeds * attention_mask.unsqueeze(0).transpose(0, 1).transpose(1, 2)

    # Ignore attention_mask
    if attention_mask is None:
        padding_mask = None
    elif self.training:
        attention_mask = None
        padding_mask = None
    else:
        padding_mask = None
        attention_mask = _prepare_4d_causal_attention_mask_for_sdpa(
            attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length,
            sliding_window=getattr(self.config, "sliding_window", None),
        )

    hidden_states = inputs_embeds
    for idx, decoder_layer in enumerate(self.layers):
        layer_outputs = decoder_layer(
            hidden_states, causal_mask=causal_mask, attention_mask=attention_mask,
            position_ids=position_ids, past_key_value=None, output_attentions=False,
            use_cache=False, padding_mask=padding_mask, position_embeddings=None, **kwargs,
        )
        hidden_states = layer_outputs[0]
    hidden_states = fast_rms_layernorm(self.norm, hidden_states)
    return (hidden_states,)


def MistralForCausalLM_fast_forward(self, input_ids=None, causal_mask=None, attention_mask=None,
                                    position_ids=None, past_key_values=None, inputs_embeds=None,
                                    labels=None, use_cache=None, output_attentions=None,
                                    output_hidden_states=None, return_dict=None,
                                    num_logits_to_keep=0, logits_to_keep=0, *args, **kwargs):
    if causal_mask is None and past_key_values is None:
        bsz, q_len = input_ids.shape
        sliding_window = getattr(self.config, "sliding_window", None)

        if HAS_XFORMERS:
            raise RuntimeError("xformers path not ported (CPU run)")
        else:
            # Not using xformers - need to create attention masks
            if (sliding_window is None or sliding_window == "null" or sliding_window <= 0
                    or q_len <= sliding_window):
                causal_mask_values = torch.triu(
                    torch.full((q_len, q_len), -torch.inf, device=input_ids.device), diagonal=1,
                )
            else:
                q_indices = torch.arange(q_len, device=input_ids.device).view(-1, 1)
                k_indices = torch.arange(q_len, device=input_ids.device).view(1, -1)
                causal_bool_mask = k_indices <= q_indices
                window_bool_mask = (q_indices - k_indices) < sliding_window
                causal_mask_values = torch.where(causal_bool_mask & window_bool_mask, 0.0, -torch.inf)

            if attention_mask is None:
                attention_mask = causal_mask_values[None, None, :, :].expand(bsz, 1, q_len, q_len)
            elif FIXED:
                if attention_mask.dim() == 2:
                    # Convert 0/1 padding mask to additive format: 1->0 (keep), 0->-inf (mask)
                    padding_mask = torch.where(attention_mask[:, None, None, :].bool(), 0.0, -torch.inf)
                    attention_mask = causal_mask_values[None, None, :, :] + padding_mask
                else:
                    attention_mask = attention_mask + causal_mask_values[None, None, :, :]
            else:
                # attention_mask should be [bsz, 1, q_len, q_len] or broadcastable
                # Add causal mask to existing attention mask
                if attention_mask.dim() == 2:
                    # [bsz, seq_len] -> [bsz, 1, 1, seq_len]
                    attention_mask = attention_mask[:, None, None, :]
                    attention_mask = attention_mask.expand(bsz, 1, q_len, q_len)
                attention_mask = attention_mask + causal_mask_values[None, None, :, :]

            attention_mask = attention_mask.to(dtype=_get_dtype(dtype_from_config(self.config)))

    self.model._has_no_labels = labels is None
    outputs = self.model(
        input_ids=input_ids, causal_mask=causal_mask, attention_mask=attention_mask,
        position_ids=position_ids, past_key_values=past_key_values, inputs_embeds=inputs_embeds,
        use_cache=use_cache, **kwargs,
    )
    hidden_states = outputs[0]
    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        # stand-in for unsloth_fused_ce_loss: mean CE over shifted labels != -100
        shift_logits = logits[:, :-1, :].reshape(-1, logits.shape[-1]).float()
        shift_labels = labels[:, 1:].reshape(-1)
        loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
    return loss, logits


# ---------------------------------------------------------------- module containers (patched forwards)
class RMSNorm(nn.Module):
    def __init__(self, hidden, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden) + 0.1 * torch.randn(hidden))
        self.variance_epsilon = eps


class MistralMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MistralAttention(nn.Module):
    forward = MistralAttention_fast_forward

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, config.max_position_embeddings, config.rope_theta)
        self.apply_qkv = original_apply_qkv
        self.apply_o = original_apply_o


class MistralDecoderLayer(nn.Module):
    forward = LlamaDecoderLayer_fast_forward

    def __init__(self, config):
        super().__init__()
        self.self_attn = MistralAttention(config)
        self.mlp = MistralMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MistralModel(nn.Module):
    forward = LlamaModel_fast_forward

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([MistralDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.max_seq_length = config.max_position_embeddings


class MistralForCausalLM(nn.Module):
    forward = MistralForCausalLM_fast_forward

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = MistralModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


def main():
    config = MistralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=32, rope_theta=10000.0, rms_norm_eps=1e-6,
    )
    config.rope_theta = 10000.0
    model = MistralForCausalLM(config)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()

    pad_id = 0
    # Left-padded batch of prompts, as for batched generation (tokenizer.padding_side = "left").
    prompts = [[5, 17, 33, 9, 41, 12, 7, 28, 3, 60], [8, 22, 19, 44, 2, 71], [13, 50, 26, 31, 66, 18, 4, 90]]
    L = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, L - len(p):] = torch.tensor(p)
        attention_mask[i, L - len(p):] = 1
    # generate()'s position ids for left padding
    position_ids = attention_mask.cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)

    with torch.no_grad():
        loss, logits = model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, labels=labels)
    next_logits = logits[:, -1, :]
    print("eval loss on real tokens: %.6f" % loss.item())
    print("next-token argmax per prompt:", next_logits.argmax(-1).tolist())
    print("next-token logit norms:", [round(v, 5) for v in next_logits.norm(dim=-1).tolist()])
    print("last-position logits[:, :4]:\n", next_logits[:, :4])


if __name__ == "__main__":
    main()
