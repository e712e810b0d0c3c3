# Citation: VikParuchuri/surya commit 8b99566 ("Fix prefill attention when using flash",
#   2025-04-07); code read at 8b99566^ and in the 8b99566 diff.
# Upstream: surya/common/surya/decoder/__init__.py Qwen2Attention.forward (and
#   SuryaDecoderModel._update_causal_mask for flash_attention_2), surya/common/surya/
#   __init__.py SuryaModel.forward (unmask_image prefill path); the attention call is
#   transformers' flash_attention_forward, which passes `is_causal=module.is_causal`.
# Bug: with attn_implementation="flash_attention_2" a 4D mask cannot carry the
#   bidirectional image prefix. For an unpadded batch `_update_causal_mask` returns
#   None, SuryaModel skips the image unmasking, and flash attention runs the prefill
#   with `is_causal=True` (Qwen2Attention.is_causal is fixed to True), so image and
#   prompt tokens only see earlier positions, unlike training.
# Fix: in Qwen2Attention.forward, under flash_attention_2, set self.is_causal = False
#   for the prefill (q_len > 1 and an empty cache) and True for decode steps.
# flash_attn_func is replaced by a plain-torch stand-in with the same signature and
#   semantics (causal mask aligned to the bottom-right corner, as flash-attn >= 2.1).
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- flash_attn stand-in ------------------------------------------------------
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kw):
    # q: (B, Lq, H, D), k/v: (B, Lk, Hkv, D)
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    if Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=2)
        v = v.repeat_interleave(H // Hkv, dim=2)
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        keep = torch.ones(Lq, Lk, dtype=torch.bool).tril(diagonal=Lk - Lq)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


# transformers.modeling_flash_attention_utils._flash_attention_forward (no-padding branch)
def _flash_attention_forward(query_states, key_states, value_states, attention_mask,
                             query_length, is_causal, dropout=0.0, softmax_scale=None, **kw):
    if attention_mask is not None:
        raise NotImplementedError("varlen path not exercised: the batch is unpadded")
    return flash_attn_func(query_states, key_states, value_states, dropout,
                           softmax_scale=softmax_scale, causal=is_causal)


# transformers.integrations.flash_attention.flash_attention_forward
def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                            scaling=None, sliding_window=None, **kwargs):
    seq_len = query.shape[2]
    query = query.transpose(1, 2)
    key = key.transpose(1, 2)
    value = value.transpose(1, 2)
    attn_output = _flash_attention_forward(query, key, value, attention_mask,
                                           query_length=seq_len, is_causal=module.is_causal,
                                           dropout=dropout, softmax_scale=scaling)
    return attn_output, None


ALL_ATTENTION_FUNCTIONS = {"flash_attention_2": flash_attention_forward}


# ---- a minimal DynamicCache ---------------------------------------------------
class DynamicCache:
    def __init__(self):
        self.k, self.v = {}, {}

    def get_seq_length(self, layer_idx=0):
        return self.k[layer_idx].shape[-2] if layer_idx in self.k else 0

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if layer_idx in self.k:
            self.k[layer_idx] = torch.cat([self.k[layer_idx], key_states], dim=-2)
            self.v[layer_idx] = torch.cat([self.v[layer_idx], value_states], dim=-2)
        else:
            self.k[layer_idx], self.v[layer_idx] = key_states, value_states
        return self.k[layer_idx], self.v[layer_idx]


# ---- surya/common/surya/decoder/__init__.py -------------------------------------
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class Qwen2RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class Qwen2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)


class Qwen2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = 0.0
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask,
                past_key_value=None, cache_position=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if FIXED:
            # IMPORTANT: Do not use causal mask for prefill; Matches training
            # This is required for flash attn, which doesn't support a 4D mask as input
            if self.config._attn_implementation == "flash_attention_2":
                is_prefill = all((
                    input_shape[1] > 1,
                    (past_key_value is None) or (past_key_value.get_seq_length(self.layer_idx) == 0),
                ))
                if is_prefill:
                    self.is_causal = False
                else:
                    self.is_causal = True

        if past_key_value is not None:
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, cache_kwargs)

        attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0, scaling=self.scaling, sliding_window=None, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Qwen2Attention(config, layer_idx)
        self.mlp = Qwen2MLP(config)
        self.input_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, past_key_value, cache_position, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states, position_embeddings, attention_mask,
                                          past_key_value=past_key_value, cache_position=cache_position)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class SuryaDecoderModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen2RotaryEmbedding(config)

    def forward(self, inputs_embeds, attention_mask=None, position_ids=None, past_key_values=None):
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        cache_position = torch.arange(past_seen_tokens, past_seen_tokens + inputs_embeds.shape[1])
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position, past_key_values)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask, past_key_values, cache_position,
                                          position_embeddings)
        return self.norm(hidden_states)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position, past_key_values,
                            output_attentions=False):
        if self.config._attn_implementation == "flash_attention_2":
            if attention_mask is not None and 0.0 in attention_mask:
                return attention_mask
            return None
        raise NotImplementedError


# ---- surya/common/surya/__init__.py SuryaModel.forward (prefill unmask path) -------
class SuryaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.decoder = SuryaDecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bbox_head = nn.Linear(config.hidden_size, 6)

    def create_eoi_mask(self, input_ids):
        tensor = input_ids
        eoi_token = self.config.eoi_token_id
        positions = (tensor == eoi_token).nonzero(as_tuple=True)
        eoi_indices = positions[1].unsqueeze(1)
        col_indices = torch.arange(tensor.shape[1]).expand_as(tensor)
        mask = col_indices <= eoi_indices
        mask[tensor == self.config.pad_token_id] = False
        return mask

    def forward(self, input_ids, inputs_embeds, attention_mask=None, position_ids=None, past_key_values=None):
        if self.config.unmask_image and inputs_embeds.shape[1] != 1:
            cache_position = torch.arange(0, inputs_embeds.shape[1])
            causal_mask = self.decoder._update_causal_mask(attention_mask, inputs_embeds, cache_position,
                                                           past_key_values)
            expanded_eoi_mask = self.create_eoi_mask(input_ids)
            # If we use flash attention, the mask will be 2d, not 4d
            if causal_mask is None:
                pass
            elif causal_mask.dim() == 4:
                expanded_eoi_mask = expanded_eoi_mask.unsqueeze(1).unsqueeze(1)
                causal_mask.masked_fill_(expanded_eoi_mask, 0)
            else:
                raise RuntimeError("Cannot unmask image with flash attention.")
            attention_mask = causal_mask
        hidden_states = self.decoder(inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                                     past_key_values=past_key_values)
        return torch.sigmoid(self.bbox_head(hidden_states)), self.lm_head(hidden_states)


config = SimpleNamespace(
    vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    _attn_implementation="flash_attention_2", unmask_image=True,
    image_token_id=3, eoi_token_id=4, bos_token_id=5, pad_token_id=0,
)
model = SuryaModel(config).eval()

# Two text-line crops, each 6 image tokens then <eoi>, <bos> and a 2-token task prompt;
# same length, so the 2-D attention mask is all ones (no padding).
B, n_img = 2, 6
input_ids = torch.tensor([[3] * n_img + [4, 5, 11, 12]] * B)
attention_mask = torch.ones_like(input_ids)
image_embeds = torch.randn(B, n_img, config.hidden_size)  # stand-in for the vision encoder output
inputs_embeds = model.embed_tokens(input_ids).detach()
inputs_embeds[:, :n_img] = image_embeds

with torch.no_grad():
    cache = DynamicCache()
    bbox, logits = model(input_ids, inputs_embeds, attention_mask, past_key_values=cache)
    print("prefill last-token logits[0, :5]:", [round(x, 4) for x in logits[0, -1, :5].tolist()])
    print("prefill image-token bbox mean:", round(bbox[:, :n_img].mean().item(), 6))
    generated = [logits[:, -1].argmax(-1)]
    for step in range(4):
        tok = generated[-1][:, None]
        pos = torch.full((B, 1), input_ids.shape[1] + step)
        bbox, logits = model(tok, model.embed_tokens(tok), None, position_ids=pos, past_key_values=cache)
        generated.append(logits[:, -1].argmax(-1))
    print("generated ids:", torch.stack(generated, dim=1).tolist())
    print("last decode logit sum:", round(logits.sum().item(), 4))
