# Citation: NVIDIA-NeMo/Automodel#1891, fixed by PR #1905 (commit d593fa819737e36f6cca882c7f44a2126e9713fb,
#   "fix(gemma4_moe): vision-aware mask when use_bidirectional_attention==vision").
# Upstream: nemo_automodel/components/models/gemma4_moe/model.py, Gemma4MoETextModelBackend.forward and
#   Gemma4ForConditionalGeneration.forward (MoE path); the fixed path calls transformers 5.5.0
#   models/gemma4/modeling_gemma4.py create_causal_mask_mapping / token_type_ids_mask_function, whose
#   mask helpers (create_causal_mask, create_sliding_window_causal_mask, or_masks, padding) are ported below.
# Bug: for checkpoints with text_config.use_bidirectional_attention == "vision" (gemma-4-26B-A4B-it), the
#   MoE text backend always built plain causal + sliding-window causal masks and never received
#   mm_token_type_ids, so the image tokens of one image stayed causal among themselves, unlike HF's
#   Gemma4Model where they see each other bidirectionally.
# Fix: plumb mm_token_type_ids / pixel_values down to the backend and, when use_bidirectional_attention
#   == "vision", build the masks with create_causal_mask_mapping (vision-group OR mask).
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Gemma4TextConfig:
    vocab_size: int = 96
    hidden_size: int = 32
    intermediate_size: int = 48
    moe_intermediate_size: int = 16
    num_experts: int = 4
    top_k_experts: int = 2
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    sliding_window: int = 4
    layer_types: list = field(default_factory=lambda: ["sliding_attention"] * 3 + ["full_attention"])
    rope_theta: dict = field(default_factory=lambda: {"sliding_attention": 10000.0, "full_attention": 1000000.0})
    pad_token_id: int = 0
    enable_moe_block: bool = True
    use_bidirectional_attention: str = "vision"
    final_logit_softcapping: float = 30.0
    is_causal: bool = True

    def get_text_config(self):
        return self


@dataclass
class Gemma4Config:
    text_config: Gemma4TextConfig = field(default_factory=Gemma4TextConfig)
    image_token_id: int = 90
    vision_hidden_size: int = 24


# ---------------------------------------------------------------------------------------------
# transformers.masking_utils (5.5.0), the parts used here: mask functions and the sdpa mask builder
# ---------------------------------------------------------------------------------------------
def and_masks(*mask_functions):
    def and_mask(batch_idx, head_idx, q_idx, kv_idx):
        result = q_idx.new_ones((), dtype=torch.bool)
        for mask in mask_functions:
            result = result & mask(batch_idx, head_idx, q_idx, kv_idx)
        return result

    return and_mask


def or_masks(*mask_functions):
    def or_mask(batch_idx, head_idx, q_idx, kv_idx):
        result = q_idx.new_zeros((), dtype=torch.bool)
        for mask in mask_functions:
            result = result | mask(batch_idx, head_idx, q_idx, kv_idx)
        return result

    return or_mask


def causal_mask_function(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx <= q_idx


def sliding_window_overlay(sliding_window):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > q_idx - sliding_window

    return inner_mask


def sliding_window_causal_mask_function(sliding_window):
    return and_masks(sliding_window_overlay(sliding_window), causal_mask_function)


def padding_mask_function(padding_mask):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return padding_mask[batch_idx, kv_idx]

    return inner_mask


def sdpa_mask(batch_size, q_length, kv_length, mask_function, attention_mask=None, **kwargs):
    # non-vmap expansion: broadcast index tensors through the mask function
    if attention_mask is not None:
        mask_function = and_masks(mask_function, padding_mask_function(attention_mask.bool()))
    batch_arange = torch.arange(batch_size)[:, None, None, None]
    head_arange = torch.arange(1)[None, :, None, None]
    cache_position = torch.arange(q_length)[None, None, :, None]
    kv_arange = torch.arange(kv_length)[None, None, None, :]
    return mask_function(batch_arange, head_arange, cache_position, kv_arange).expand(batch_size, 1, q_length, kv_length)


def create_causal_mask(config, inputs_embeds, attention_mask, cache_position=None, *, past_key_values=None,
                       position_ids=None, or_mask_function=None, and_mask_function=None):
    mask_factory_function = causal_mask_function
    if or_mask_function is not None:
        mask_factory_function = or_masks(mask_factory_function, or_mask_function)
    if and_mask_function is not None:
        mask_factory_function = and_masks(mask_factory_function, and_mask_function)
    b, q = inputs_embeds.shape[:2]
    return sdpa_mask(b, q, q, mask_factory_function, attention_mask=attention_mask)


def create_sliding_window_causal_mask(config, inputs_embeds, attention_mask, cache_position=None, *,
                                      past_key_values=None, position_ids=None, or_mask_function=None,
                                      and_mask_function=None):
    mask_factory_function = sliding_window_causal_mask_function(config.sliding_window)
    if or_mask_function is not None:
        mask_factory_function = or_masks(mask_factory_function, or_mask_function)
    if and_mask_function is not None:
        mask_factory_function = and_masks(mask_factory_function, and_mask_function)
    b, q = inputs_embeds.shape[:2]
    return sdpa_mask(b, q, q, mask_factory_function, attention_mask=attention_mask)


# ---------------------------------------------------------------------------------------------
# transformers 5.5.0 models/gemma4/modeling_gemma4.py
# ---------------------------------------------------------------------------------------------
def token_type_ids_mask_function(token_type_ids, image_group_ids):
    if token_type_ids is None:
        return None

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        seq_length = image_group_ids.shape[-1]
        q_idx_clamped = q_idx.clamp(max=seq_length - 1)
        kv_idx_clamped = kv_idx.clamp(max=seq_length - 1)
        q_group = image_group_ids[batch_idx, q_idx_clamped]
        kv_group = image_group_ids[batch_idx, kv_idx_clamped]
        q_group = torch.where(q_idx < seq_length, q_group, -1)
        kv_group = torch.where(kv_idx < seq_length, kv_group, -1)
        return (q_group == kv_group) & (q_group >= 0)

    return inner_mask


def create_causal_mask_mapping(config, inputs_embeds, attention_mask, past_key_values, position_ids,
                               mm_token_type_ids=None, pixel_values=None, is_training=False,
                               is_first_iteration=None, **kwargs):
    if is_training and mm_token_type_ids is None:
        raise ValueError("`mm_token_type_ids` is required as a model input when training")
    mask_kwargs = {
        "config": config.get_text_config(),
        "inputs_embeds": inputs_embeds,
        "attention_mask": attention_mask,
        "past_key_values": past_key_values,
        "position_ids": position_ids,
    }
    sliding_mask_kwargs = mask_kwargs.copy()
    is_first_iteration = (
        is_first_iteration if is_first_iteration is not None else (past_key_values is None or pixel_values is not None)
    )
    if mm_token_type_ids is not None and is_first_iteration:
        is_vision = (mm_token_type_ids == 1) | (mm_token_type_ids == 2)
        is_prev_vision = torch.roll(is_vision, shifts=1, dims=-1)
        is_prev_vision[..., 0] = False
        new_vision_starts = is_vision & ~is_prev_vision
        vision_group_ids = torch.cumsum(new_vision_starts.int(), dim=1) - 1
        vision_group_ids = torch.where(is_vision, vision_group_ids, -1)
        sliding_mask_kwargs["or_mask_function"] = token_type_ids_mask_function(
            mm_token_type_ids.to(inputs_embeds.device), vision_group_ids
        )
    return {
        "full_attention": create_causal_mask(**mask_kwargs),
        "sliding_attention": create_sliding_window_causal_mask(**sliding_mask_kwargs),
    }


class Gemma4RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, with_scale=True):
        super().__init__()
        self.eps = eps
        self.with_scale = with_scale
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        out = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return out * self.weight if self.with_scale else out


class Gemma4TextScaledWordEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, padding_idx, embed_scale=1.0):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.embed_scale = embed_scale

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale


class Gemma4RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta

    def forward(self, x, position_ids, layer_type):
        inv_freq = 1.0 / (self.theta[layer_type] ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = position_ids[:, :, None].float() * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Gemma4Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.head_dim = config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.v_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False)
        self.scaling = 1.0

    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        b, s, _ = hidden_states.shape
        q = self.q_norm(self.q_proj(hidden_states).view(b, s, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(b, s, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_norm(self.v_proj(hidden_states).view(b, s, self.n_kv, self.head_dim)).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), None


class Gemma4MLP(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


# ---------------------------------------------------------------------------------------------
# nemo_automodel/components/models/gemma4_moe/model.py (GroupedExperts replaced by a plain loop)
# ---------------------------------------------------------------------------------------------
class Gemma4Gate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.topk = config.top_k_experts
        self.norm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.register_buffer("root_size", torch.tensor(config.hidden_size**-0.5), persistent=False)

    def forward(self, x, token_mask=None, cp_mesh=None):
        x_norm = self.norm(x) * self.root_size * self.scale
        expert_scores = self.proj(x_norm)
        router_probs = F.softmax(expert_scores, dim=-1)
        _, indices = torch.topk(expert_scores, k=self.topk, dim=-1)
        weights = router_probs.gather(-1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=1e-20)
        return weights, indices, None


class GroupedExperts(nn.Module):
    def __init__(self, config):
        super().__init__()
        E, D, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_and_up_projs = nn.Parameter(torch.randn(E, D, 2 * I) * 0.1)
        self.down_projs = nn.Parameter(torch.randn(E, I, D) * 0.1)

    def forward(self, x, token_mask, weights, indices):
        y = torch.zeros_like(x)
        for e in range(self.gate_and_up_projs.shape[0]):
            sel = (indices == e) & token_mask[:, None]
            rows = sel.any(-1)
            if not rows.any():
                continue
            gu = x[rows] @ self.gate_and_up_projs[e]
            g, u = gu.chunk(2, dim=-1)
            out = (F.gelu(g, approximate="tanh") * u) @ self.down_projs[e]
            w = (weights * sel).sum(-1)[rows][:, None]
            y[rows] += w * out
        return y


class Gemma4MoE(nn.Module):
    def __init__(self, text_config):
        super().__init__()
        self.dim = text_config.hidden_size
        self.gate = Gemma4Gate(text_config)
        self.experts = GroupedExperts(text_config)

    def forward(self, x, padding_mask=None, cp_mesh=None, *, gate_input=None):
        shape = x.size()
        x = x.view(-1, self.dim)
        if padding_mask is not None:
            token_mask = (~padding_mask).flatten()
        else:
            token_mask = torch.ones(x.size(0), dtype=torch.bool, device=x.device)
        g = gate_input.reshape(-1, self.dim) if gate_input is not None else x
        weights, indices, aux_loss = self.gate(g, token_mask, cp_mesh)
        y = self.experts(x, token_mask, weights, indices)
        return y.view(shape)


class Gemma4MoEDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        h = config.hidden_size
        self.self_attn = Gemma4Attention(config=config, layer_idx=layer_idx)
        self.mlp = Gemma4MLP(config, layer_idx)
        self.input_layernorm = Gemma4RMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm_1 = Gemma4RMSNorm(h, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps=config.rms_norm_eps)
        self.moe = Gemma4MoE(config)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x, *, position_embeddings, attention_mask=None, position_ids=None, padding_mask=None, **kwargs):
        residual = x
        x = self.input_layernorm(x)
        x, _ = self.self_attn(hidden_states=x, position_embeddings=position_embeddings, attention_mask=attention_mask)
        x = self.post_attention_layernorm(x)
        x = residual + x

        residual = x
        dense_out = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        moe_input = self.pre_feedforward_layernorm_2(x)
        moe_out = self.moe(moe_input, padding_mask, gate_input=x)
        moe_out = self.post_feedforward_layernorm_2(moe_out)
        x = self.post_feedforward_layernorm(dense_out + moe_out)
        x = residual + x
        return x * self.layer_scalar


class Gemma4MoETextModelBackend(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = Gemma4TextScaledWordEmbedding(
            config.vocab_size, config.hidden_size, config.pad_token_id, embed_scale=config.hidden_size**0.5
        )
        self.layers = nn.ModuleDict({str(i): Gemma4MoEDecoderLayer(config, i) for i in range(config.num_hidden_layers)})
        self.norm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Gemma4RotaryEmbedding(config)

    def forward(self, input_ids=None, *, inputs_embeds=None, attention_mask=None, position_ids=None,
                cache_position=None, padding_mask=None, mm_token_type_ids=None, pixel_values=None,
                past_key_values=None, use_cache=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if cache_position is None:
            cache_position = torch.arange(0, inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        if padding_mask is None and attention_mask is not None:
            padding_mask = attention_mask.bool().logical_not()

        hidden_states = inputs_embeds

        if FIXED and getattr(self.config, "use_bidirectional_attention", None) == "vision":
            causal_mask_mapping = create_causal_mask_mapping(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                position_ids=position_ids,
                mm_token_type_ids=mm_token_type_ids,
                pixel_values=pixel_values,
                is_training=self.training,
            )
        else:
            mask_kwargs = {
                "config": self.config,
                "inputs_embeds": inputs_embeds,
                "attention_mask": attention_mask,
                "cache_position": cache_position,
                "past_key_values": past_key_values,
                "position_ids": position_ids,
            }
            causal_mask_mapping = {
                "full_attention": create_causal_mask(**mask_kwargs),
                "sliding_attention": create_sliding_window_causal_mask(**mask_kwargs),
            }

        position_embeddings = {}
        for layer_type in set(self.config.layer_types):
            position_embeddings[layer_type] = self.rotary_emb(hidden_states, position_ids, layer_type)

        for decoder_layer in self.layers.values():
            hidden_states = decoder_layer(
                hidden_states,
                position_embeddings=position_embeddings[decoder_layer.attention_type],
                attention_mask=causal_mask_mapping[decoder_layer.attention_type],
                position_ids=position_ids,
                padding_mask=padding_mask,
                **kwargs,
            )
        return self.norm(hidden_states)


class Gemma4VisionStandIn(nn.Module):
    """get_image_features stand-in: one soft token per patch row, projected into the text width."""

    def __init__(self, config):
        super().__init__()
        self.proj = nn.Linear(config.vision_hidden_size, config.text_config.hidden_size, bias=False)

    def forward(self, pixel_values, image_position_ids=None):
        return self.proj(pixel_values).flatten(0, 1)


class Gemma4ForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.vision = Gemma4VisionStandIn(config)
        self.language_model = Gemma4MoETextModelBackend(config.text_config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)

    def forward(self, input_ids=None, *, position_ids=None, attention_mask=None, padding_mask=None,
                inputs_embeds=None, cache_position=None, pixel_values=None, image_position_ids=None,
                mm_token_type_ids=None, **kwargs):
        text_config = self.config.text_config
        if cache_position is None and input_ids is not None:
            cache_position = torch.arange(input_ids.shape[-1], device=input_ids.device)
        if input_ids is not None and inputs_embeds is None:
            llm_ids = input_ids.masked_fill(input_ids == self.config.image_token_id, text_config.pad_token_id)
            inputs_embeds = self.language_model.embed_tokens(llm_ids)
        if pixel_values is not None:
            image_features = self.vision(pixel_values, image_position_ids).to(inputs_embeds.dtype)
            if mm_token_type_ids is not None:
                special_image_mask = mm_token_type_ids == 1
            else:
                special_image_mask = input_ids == self.config.image_token_id
            image_mask = special_image_mask.unsqueeze(-1).expand_as(inputs_embeds)
            inputs_embeds = inputs_embeds.masked_scatter(image_mask, image_features)

        extra = dict(mm_token_type_ids=mm_token_type_ids, pixel_values=pixel_values) if FIXED else {}
        hidden_states = self.language_model(
            input_ids=None,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache_position=cache_position,
            padding_mask=padding_mask,
            **extra,
            **kwargs,
        )
        logits = self.lm_head(hidden_states)
        if (cap := getattr(text_config, "final_logit_softcapping", None)) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def build_batch(config):
    """Right-padded multimodal SFT batch: BOS, prompt, <boi>, 6 soft image tokens, <eoi>, answer."""
    IMG, BOI, EOI, PAD = config.image_token_id, 91, 92, config.text_config.pad_token_id
    rows = [
        [2, 10, 11, BOI] + [IMG] * 6 + [EOI, 30, 31, 32, 33, 1],
        [2, 12, BOI] + [IMG] * 6 + [EOI, 34, 35, 1],
    ]
    L = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [PAD] * (L - len(r)) for r in rows])
    attention_mask = (input_ids != PAD).long()
    mm_token_type_ids = (input_ids == IMG).long()
    labels = input_ids.clone()
    labels[(mm_token_type_ids == 1) | (attention_mask == 0)] = -100
    pixel_values = torch.randn(2, 6, config.vision_hidden_size)
    return input_ids, attention_mask, mm_token_type_ids, labels, pixel_values


def main():
    config = Gemma4Config()
    model = Gemma4ForConditionalGeneration(config)
    model.train()
    input_ids, attention_mask, mm_token_type_ids, labels, pixel_values = build_batch(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        logits = model(input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                       mm_token_type_ids=mm_token_type_ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.6f}")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                       mm_token_type_ids=mm_token_type_ids)
    logp = F.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    print("sum logprob of real tokens per row:", [round(v, 4) for v in (logp * attention_mask[:, 1:]).sum(-1).tolist()])


if __name__ == "__main__":
    main()
