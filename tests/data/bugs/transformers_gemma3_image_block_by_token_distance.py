# Citation: huggingface/transformers, src/transformers/models/gemma3/modeling_gemma3.py
#   `token_type_ids_mask_function` as written by PR #38295 ("Fix image token mask in Gemma3") and
#   shipped in v4.53.0 .. v4.53.3; replaced in v4.54.0 by the `image_group_ids` version
#   (Gemma3Model.forward / create_masks_for_generate compute image_group_ids from token_type_ids).
#   Masks are built with src/transformers/masking_utils.py (create_causal_mask /
#   create_sliding_window_causal_mask with `or_mask_function`, eager_mask).
# Bug: the or-mask that gives image tokens bidirectional attention decided "same image" by the
#   distance |kv_idx - q_idx| <= mm_tokens_per_image, so an image token also sees the tokens of a
#   neighbouring image (a later one included) whenever the two images sit close in the prompt.
# Fix (v4.54.0): number each contiguous run of image tokens (image_group_ids, cumsum of run starts)
#   and unmask only when query and key carry the same group id.
import sys
import math
from typing import Callable, Optional

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ----------------------------------------------------------------------------- masking_utils
def and_masks(*mask_functions: Callable) -> Callable:
    def and_mask(batch_idx, head_idx, q_idx, kv_idx):
        result = q_idx.new_ones((), dtype=torch.bool)
        for mask in mask_functions:
            result = result & mask(batch_idx, head_idx, q_idx, kv_idx)
        return result

    return and_mask


def or_masks(*mask_functions: Callable) -> Callable:
    def or_mask(batch_idx, head_idx, q_idx, kv_idx):
        result = q_idx.new_zeros((), dtype=torch.bool)
        for mask in mask_functions:
            result = result | mask(batch_idx, head_idx, q_idx, kv_idx)
        return result

    return or_mask


def causal_mask_function(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx <= q_idx


def sliding_window_overlay(sliding_window: int) -> Callable:
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > q_idx - sliding_window

    return inner_mask


def sliding_window_causal_mask_function(sliding_window: int) -> Callable:
    return and_masks(sliding_window_overlay(sliding_window), causal_mask_function)


def padding_mask_function(padding_mask: torch.Tensor) -> Callable:
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return padding_mask[batch_idx, kv_idx]

    return inner_mask


def sdpa_mask(batch_size, cache_position, kv_length, mask_function, attention_mask=None):
    # same result as masking_utils.sdpa_mask_recent_torch (allow_is_causal_skip=False): the mask
    # function is evaluated on every (b, h, q, kv) index, broadcast instead of vmap
    q_length = cache_position.shape[0]
    padding_mask = attention_mask.bool() if attention_mask is not None else None
    if padding_mask is not None:
        mask_function = and_masks(mask_function, padding_mask_function(padding_mask))
    batch_arange = torch.arange(batch_size)[:, None, None, None]
    head_arange = torch.arange(1)[None, :, None, None]
    q_idx = cache_position[None, None, :, None]
    kv_idx = torch.arange(kv_length)[None, None, None, :]
    causal_mask = mask_function(batch_arange, head_arange, q_idx, kv_idx)
    return causal_mask.expand(batch_size, 1, q_length, kv_length)


def eager_mask(batch_size, cache_position, kv_length, mask_function, attention_mask=None, dtype=torch.float32):
    mask = sdpa_mask(batch_size, cache_position, kv_length, mask_function, attention_mask)
    min_dtype = torch.finfo(dtype).min
    return torch.where(mask, torch.tensor(0.0, dtype=dtype), min_dtype)


def create_causal_mask(config, input_embeds, attention_mask, cache_position, or_mask_function=None):
    mask_factory_function = causal_mask_function
    if or_mask_function is not None:
        mask_factory_function = or_masks(mask_factory_function, or_mask_function)
    return eager_mask(input_embeds.shape[0], cache_position, attention_mask.shape[-1],
                      mask_factory_function, attention_mask, dtype=input_embeds.dtype)


def create_sliding_window_causal_mask(config, input_embeds, attention_mask, cache_position, or_mask_function=None):
    mask_factory_function = sliding_window_causal_mask_function(config.sliding_window)
    if or_mask_function is not None:
        mask_factory_function = or_masks(mask_factory_function, or_mask_function)
    return eager_mask(input_embeds.shape[0], cache_position, attention_mask.shape[-1],
                      mask_factory_function, attention_mask, dtype=input_embeds.dtype)


# ----------------------------------------------------------------------------- gemma3 mask fn
if not FIXED:

    def token_type_ids_mask_function(token_type_ids: Optional[torch.Tensor], tokens_per_image: int) -> Optional[Callable]:
        """
        This function adds the correct offsets to the `q_idx` and `kv_idx` as the torch API can only accept lengths,
        not start and end indices.
        """
        # Do not return an additional mask in this case
        if token_type_ids is None:
            return None

        def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
            # If the difference is less than image size, both are part of the same image block
            same_image_block = torch.abs(kv_idx - q_idx) <= tokens_per_image
            # If it's 1 for both query and key/value, we are in an image block
            is_image_block = (token_type_ids[batch_idx, q_idx] == 1) & (token_type_ids[batch_idx, kv_idx] == 1)

            # This is bidirectional attention whenever we are dealing with image tokens
            return is_image_block & same_image_block

        return inner_mask

else:

    def token_type_ids_mask_function(
        token_type_ids: Optional[torch.Tensor],
        image_group_ids: Optional[torch.Tensor],
        tokens_per_image: int,
    ) -> Optional[Callable]:
        """
        This function adds the correct offsets to the `q_idx` and `kv_idx` as the torch API can only accept lengths,
        not start and end indices.
        """
        # Do not return an additional mask in this case
        if token_type_ids is None:
            return None

        def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
            # If it's 1 for both query and key/value, we are in an image block
            # NOTE: static cache shape goes beyond input seq length, while token_type_ids.shape[1] == input seq length
            # Since vmap doesn't support `if statement` we workaround it with `torch.where`
            safe_idx = torch.where(kv_idx < token_type_ids.shape[1], kv_idx, 0)
            token_type_ids_at_kv_idx = token_type_ids[batch_idx, safe_idx]
            token_type_ids_at_kv_idx = torch.where(kv_idx < token_type_ids.shape[1], token_type_ids_at_kv_idx, 0)

            image_group_ids_at_kv_idx = image_group_ids[batch_idx, safe_idx]
            image_group_ids_at_kv_idx = torch.where(kv_idx < image_group_ids.shape[1], image_group_ids_at_kv_idx, -1)

            is_image_block = (token_type_ids[batch_idx, q_idx] == 1) & (token_type_ids_at_kv_idx == 1)
            same_image_block = image_group_ids[batch_idx, q_idx] == image_group_ids_at_kv_idx

            # This is bidirectional attention whenever we are dealing with image tokens
            return is_image_block & same_image_block

        return inner_mask


# ----------------------------------------------------------------------------- tiny Gemma3 text model
class Cfg:
    vocab_size = 40
    hidden_size = 32
    intermediate_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 8
    num_hidden_layers = 4
    sliding_window = 8
    sliding_window_pattern = 2  # every 2nd layer is global
    query_pre_attn_scalar = 8
    rms_norm_eps = 1e-6
    rope_theta = 10000.0
    rope_local_base_freq = 10000.0
    mm_tokens_per_image = 4
    image_token_id = 39
    boi_token_id = 37
    eoi_token_id = 38
    pad_token_id = 0


class Gemma3RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out * (1.0 + self.weight)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope(position_ids, dim, base):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, None], emb.sin()[:, None]


def repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.is_sliding = bool((layer_idx + 1) % config.sliding_window_pattern)
        self.head_dim = config.head_dim
        self.n_rep = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.query_pre_attn_scalar ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=False)
        self.q_norm = Gemma3RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        # eager_attention_forward
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask[:, :, :, : k.shape[-2]]
        attn_weights = torch.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class Gemma3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.is_sliding = self.self_attn.is_sliding
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings_global, position_embeddings_local, attention_mask):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        pe = position_embeddings_local if self.is_sliding else position_embeddings_global
        hidden_states = self.self_attn(hidden_states, pe, attention_mask)
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return residual + self.post_feedforward_layernorm(hidden_states)


class Gemma3TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds, attention_mask, position_ids):
        hidden_states = inputs_embeds * (self.config.hidden_size ** 0.5)
        pe_global = rope(position_ids, self.config.head_dim, self.config.rope_theta)
        pe_local = rope(position_ids, self.config.head_dim, self.config.rope_local_base_freq)
        for layer in self.layers:
            mask = attention_mask["sliding_attention"] if layer.is_sliding else attention_mask["full_attention"]
            hidden_states = layer(hidden_states, pe_global, pe_local, mask)
        return self.norm(hidden_states)


class Gemma3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.language_model = Gemma3TextModel(config)
        self.multi_modal_projector = nn.Linear(16, config.hidden_size, bias=False)

    def get_image_features(self, pixel_values):
        # stand-in for SigLIP + Gemma3MultiModalProjector: mm_tokens_per_image soft tokens per image
        return self.multi_modal_projector(pixel_values)

    def forward(self, input_ids, pixel_values, attention_mask, token_type_ids):
        inputs_embeds = self.language_model.embed_tokens(input_ids)
        cache_position = torch.arange(input_ids.shape[1])
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)

        image_features = self.get_image_features(pixel_values)
        special_image_mask = (input_ids == self.config.image_token_id).unsqueeze(-1).expand_as(inputs_embeds)
        inputs_embeds = inputs_embeds.masked_scatter(special_image_mask, image_features.to(inputs_embeds.dtype))

        mask_kwargs = {
            "config": self.config,
            "input_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            "cache_position": cache_position,
        }
        if token_type_ids is not None and inputs_embeds.shape[1] != 1:
            # We need to pass an additional mask function to account for token type ids, and it needs to be an `or`
            if not FIXED:
                mask_kwargs["or_mask_function"] = token_type_ids_mask_function(
                    token_type_ids, self.config.mm_tokens_per_image
                )
            else:
                # First find where a new image block starts: 1 if image and previous not image
                # The images cannot attend to future images, but can attend to all prev images and to itself
                # bidirectionally
                is_image = token_type_ids == 1
                new_image_start = is_image & ~nn.functional.pad(is_image, (1, 0), value=0)[:, :-1]
                image_group_ids = torch.cumsum(new_image_start.int(), dim=1) - 1
                image_group_ids = torch.where(is_image, image_group_ids, torch.full_like(token_type_ids, -1))
                mask_kwargs["or_mask_function"] = token_type_ids_mask_function(
                    token_type_ids, image_group_ids, self.config.mm_tokens_per_image
                )

        causal_mask_mapping = {
            "full_attention": create_causal_mask(**mask_kwargs),
            "sliding_attention": create_sliding_window_causal_mask(**mask_kwargs),
        }
        return self.language_model(inputs_embeds, causal_mask_mapping, position_ids)


# ----------------------------------------------------------------------------- run
cfg = Cfg()
model = Gemma3Model(cfg).eval()
lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

IMG = [cfg.image_token_id] * cfg.mm_tokens_per_image
NL = 5  # "\n\n"
# processor layout: ... <start_of_image> image tokens <end_of_image> \n\n <start_of_image> ... <end_of_image> question
row_a = [2, 11, 12, cfg.boi_token_id] + IMG + [cfg.eoi_token_id, NL, cfg.boi_token_id] + IMG + [cfg.eoi_token_id, 21, 22, 23]
row_b = [2, 13, cfg.boi_token_id] + IMG + [cfg.eoi_token_id, NL, cfg.boi_token_id] + IMG + [cfg.eoi_token_id, 24, 25]
max_len = max(len(row_a), len(row_b))
# padding_side="left", as for generation
input_ids = torch.tensor([[cfg.pad_token_id] * (max_len - len(r)) + r for r in (row_a, row_b)])
attention_mask = torch.tensor([[0] * (max_len - len(r)) + [1] * len(r) for r in (row_a, row_b)])
token_type_ids = (input_ids == cfg.image_token_id).long()
pixel_values = torch.randn(4, cfg.mm_tokens_per_image, 16)  # 2 images per row

with torch.no_grad():
    hidden = model(input_ids, pixel_values, attention_mask, token_type_ids)
    logits = lm_head(hidden)

labels = torch.roll(input_ids, -1, dims=1)
loss_mask = attention_mask.clone()
loss_mask[:, -1] = 0
loss_mask &= (token_type_ids == 0).long()
ce = nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="none")
loss = (ce * loss_mask.reshape(-1)).sum() / loss_mask.sum()

print("input_ids shape:", tuple(input_ids.shape))
print("image-token hidden sum per row:", [round(v, 4) for v in hidden[token_type_ids == 1].reshape(2, -1).sum(dim=-1).tolist()])
print("last-token logits[:5] row0:", [round(v, 4) for v in logits[0, -1, :5].tolist()])
print("loss: %.6f" % loss.item())
