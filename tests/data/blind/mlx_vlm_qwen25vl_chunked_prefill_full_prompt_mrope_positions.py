"""mlx-vlm Qwen2.5-VL: chunked prefill hands the whole prompt's MRoPE position_ids to every chunk.

Citation: Blaizzy/mlx-vlm#1741 ("Fix chunked MRoPE positions across Qwen VL models", commit 24910756,
fixes #1737; symptom also reported in #1755). MLX code ported to torch.

Bug: `generate_step` (mlx_vlm/generate/ar.py) puts the request-owned `position_ids` / `rope_deltas`
returned by `Model.get_input_embeddings` (from `get_rope_index` over the full prompt) into `kwargs`
and passes them to every `model.language_model(...)` prefill chunk and to the final one-token
`_step`. `LanguageModel.__call__` forwarded an explicit `position_ids` unchanged, so a chunk of
`L` tokens was rotated with a `(3, B, full_len)` table. The fused MRoPE apply kernel indexes
`position_ids[(axis * q_bsz + b) * q_len + t]`, i.e. with the chunk's `q_len` as stride, so every
chunk got the prompt's first positions (and the h/w axes read other columns of the flat table):
later chunks' keys sit in the cache at the wrong rotary positions.

Fix: in `LanguageModel.__call__`, when `position_ids` is longer than the input, slice it to
`position_ids[..., cache_offset : cache_offset + seq_length]`.

Reproduction: Qwen2.5-VL's language model (q/k/v bias, chunked MRoPE section selector, KV cache with
an offset, causal mask aligned to the cache end) and `get_rope_index`, with the Metal MRoPE kernel
replaced by a torch function that indexes `position_ids` the way the kernel does. The vision tower is
replaced by fixed random features for the 4 merged image tokens. A 20-token prompt with an image is
prefilled in chunks of 8 (8 + 8 + 3, then the last token), then 6 tokens are decoded greedily.
"""
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ----------------------------------------------------------------------------------------------
# mlx_vlm/models/qwen2_5_vl/config.py (trimmed)
# ----------------------------------------------------------------------------------------------
@dataclass
class TextConfig:
    model_type: str = "qwen2_5_vl"
    hidden_size: int = 32
    num_hidden_layers: int = 2
    intermediate_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    vocab_size: int = 96
    max_position_embeddings: int = 128
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=lambda: {"type": "mrope", "mrope_section": [2, 1, 1]})
    tie_word_embeddings: bool = False


@dataclass
class VisionConfig:
    spatial_merge_size: int = 2


@dataclass
class ModelConfig:
    text_config: TextConfig
    vision_config: VisionConfig
    image_token_id: int = 90
    video_token_id: int = 91
    vision_start_token_id: int = 88
    vision_end_token_id: int = 89


# ----------------------------------------------------------------------------------------------
# mlx_vlm/models/cache.py KVCache, mlx_vlm/models/base.py (trimmed)
# ----------------------------------------------------------------------------------------------
class KVCache:
    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        self.offset += keys.shape[2]
        return self.keys, self.values

    @property
    def state(self):
        return self.keys, self.values


def make_prompt_cache(language_model):
    return [KVCache() for _ in language_model.layers]


def create_attention_mask(h, cache):
    T = h.shape[1]
    if T > 1:
        return "causal"
    return None


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask):
    # mx.fast.scaled_dot_product_attention: mask="causal" is aligned to the end of the keys
    n_rep = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(n_rep, dim=1)
    values = values.repeat_interleave(n_rep, dim=1)
    attn_mask = None
    if isinstance(mask, str) and mask == "causal":
        L, S = queries.shape[2], keys.shape[2]
        attn_mask = torch.arange(S)[None, :] <= (torch.arange(L)[:, None] + (S - L))
    elif mask is not None:
        attn_mask = mask
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=attn_mask, scale=scale)


# ----------------------------------------------------------------------------------------------
# mlx_vlm/models/rope_utils.py: MRoPERotaryEmbedding(style="chunked") and the fused apply kernel
# ----------------------------------------------------------------------------------------------
def compute_inv_freq(dim, base):
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def _chunked_position_selector(mrope_section, freq_dim):
    selector = [0] * freq_dim
    offset = mrope_section[0]
    for dim, length in enumerate(mrope_section[1:], start=1):
        for idx in range(offset, min(offset + length, freq_dim)):
            selector[idx] = dim
        offset += length
    return torch.tensor(selector, dtype=torch.long)


def _mrope_apply_kernel(x, position_ids, inv_freq, position_selector, rotary_dim):
    """What `_mrope_apply_kernel` (Metal, half-split pairing) computes, element by element:
    pos = position_ids[(axis * q_bsz + b) * q_len + t] (3-D ids) or position_ids[b * q_len + t]."""
    q_bsz, q_heads, q_len, q_dim = x.shape
    half_dim = rotary_dim // 2
    flat = position_ids.reshape(-1).to(torch.float32)
    b_idx = torch.arange(q_bsz)[:, None, None]
    t_idx = torch.arange(q_len)[None, :, None]
    if position_ids.dim() == 2:
        pos = flat[(b_idx * q_len + t_idx).expand(q_bsz, q_len, half_dim)]
    else:
        axis = position_selector[None, None, :]
        pos = flat[(axis * q_bsz + b_idx) * q_len + t_idx]
    angle = pos * inv_freq  # [b, t, half]
    c, s = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
    xv, xp = x[..., :half_dim].float(), x[..., half_dim:rotary_dim].float()
    out = x.clone()
    out[..., :half_dim] = (xv * c - xp * s).to(x.dtype)
    out[..., half_dim:rotary_dim] = (xp * c + xv * s).to(x.dtype)
    return out


class MRoPERotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, *, rope_scaling=None,
                 style="chunked"):
        super().__init__()
        self.dim = dim
        self.style = style
        self._inv_freq = compute_inv_freq(dim, base)
        self._mrope_section = list(rope_scaling["mrope_section"])
        self._position_selector = _chunked_position_selector(self._mrope_section,
                                                             self._inv_freq.shape[0])
        self.fused_apply = True

    def apply_rotary(self, q, k, position_ids, *, unsqueeze_dim=1):
        return (_mrope_apply_kernel(q, position_ids, self._inv_freq, self._position_selector,
                                    self.dim),
                _mrope_apply_kernel(k, position_ids, self._inv_freq, self._position_selector,
                                    self.dim))


class Qwen2RotaryEmbedding(MRoPERotaryEmbedding):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, rope_scaling=None):
        super().__init__(dim, max_position_embeddings=max_position_embeddings, base=base,
                         rope_scaling=rope_scaling, style="chunked")
        self.attention_scaling = 1.0


# ----------------------------------------------------------------------------------------------
# mlx_vlm/models/qwen2_5_vl/language.py
# ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dims, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, args: TextConfig):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.hidden_size // n_heads
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=True)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=True)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=True)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.rope_scaling = args.rope_scaling
        self.rotary_emb = Qwen2RotaryEmbedding(head_dim,
                                               max_position_embeddings=args.max_position_embeddings,
                                               base=args.rope_theta, rope_scaling=args.rope_scaling)

    def forward(self, x, mask=None, cache: Optional[KVCache] = None, position_ids=None,
                position_embeddings=None):
        B, L, D = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        keys = keys.reshape(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = keys.shape[-2]
        if position_ids is None:
            kv_seq_len += cache.offset + 1
            position_ids = torch.arange(cache.offset, cache.offset + L)
            position_ids = position_ids[None].expand(3, 1, L)
        else:
            kv_seq_len += cache.offset + 1 if cache is not None else 0

        queries, keys = self.rotary_emb.apply_rotary(queries, keys, position_ids, unsqueeze_dim=1)

        if mask is not None and isinstance(mask, torch.Tensor):
            mask = mask[..., : keys.shape[-2]]
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = scaled_dot_product_attention(queries, keys, values, cache, scale=self.scale,
                                              mask=mask)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class Qwen2VLDecoderLayer(nn.Module):
    def __init__(self, args: TextConfig):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None, position_ids=None, position_embeddings=None):
        r = self.self_attn(self.input_layernorm(x), mask=mask, cache=cache,
                           position_ids=position_ids, position_embeddings=position_embeddings)
        h = x + r
        r = self.mlp(self.post_attention_layernorm(h))
        return h + r


class Qwen2Model(nn.Module):
    def __init__(self, args: TextConfig):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Qwen2VLDecoderLayer(args)
                                    for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, inputs_embeds=None, mask=None, cache=None, position_ids=None):
        h = self.embed_tokens(inputs) if inputs_embeds is None else inputs_embeds
        if cache is None:
            cache = [None] * len(self.layers)
        if mask is None:
            mask = create_attention_mask(h, cache)
        position_embeddings = None  # rotary_emb.fused_apply: rotated inside each layer
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c, position_ids, position_embeddings)
        return self.norm(h)


class LanguageModel(nn.Module):
    def __init__(self, args: TextConfig, config: ModelConfig):
        super().__init__()
        self.args = args
        self.config = config
        self.model = Qwen2Model(args)
        self._rope_deltas = None
        self._position_ids = None
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def get_rope_index(self, input_ids, image_grid_thw=None, video_grid_thw=None,
                       attention_mask=None):
        batch_size, seq_length = input_ids.shape
        position_ids = torch.arange(seq_length)[None].expand(batch_size, seq_length)
        spatial_merge_size = self.config.vision_config.spatial_merge_size
        image_token_id = self.config.image_token_id
        video_token_id = self.config.video_token_id
        vision_start_token_id = self.config.vision_start_token_id
        mrope_position_deltas = []
        if image_grid_thw is not None or video_grid_thw is not None:
            position_ids = torch.ones(3, batch_size, seq_length, dtype=torch.long)
            image_index = 0
            for i, ids in enumerate(input_ids):
                input_tokens = ids.tolist()
                vision_tokens = [input_tokens[idx + 1] for idx, tok in enumerate(input_tokens[:-1])
                                 if tok == vision_start_token_id]
                image_nums = sum(tok == image_token_id for tok in vision_tokens)
                llm_pos_ids_list: list = []
                st = 0
                for _ in range(image_nums):
                    ed = input_tokens.index(image_token_id, st)
                    t, h, w = image_grid_thw[image_index].tolist()
                    image_index += 1
                    llm_grid_t, llm_grid_h, llm_grid_w = (t, h // spatial_merge_size,
                                                          w // spatial_merge_size)
                    text_len = ed - st
                    st_idx = llm_pos_ids_list[-1].max() + 1 if llm_pos_ids_list else 0
                    llm_pos_ids_list.append(torch.arange(text_len).expand(3, text_len) + st_idx)
                    t_index = torch.arange(llm_grid_t).view(-1, 1).expand(
                        llm_grid_t, llm_grid_h * llm_grid_w).flatten()
                    h_index = torch.arange(llm_grid_h).view(1, -1, 1).expand(
                        llm_grid_t, llm_grid_h, llm_grid_w).flatten()
                    w_index = torch.arange(llm_grid_w).view(1, 1, -1).expand(
                        llm_grid_t, llm_grid_h, llm_grid_w).flatten()
                    llm_pos_ids_list.append(torch.stack([t_index, h_index, w_index])
                                            + text_len + st_idx)
                    st = ed + llm_grid_t * llm_grid_h * llm_grid_w
                if st < len(input_tokens):
                    st_idx = llm_pos_ids_list[-1].max() + 1 if llm_pos_ids_list else 0
                    text_len = len(input_tokens) - st
                    llm_pos_ids_list.append(torch.arange(text_len).expand(3, text_len) + st_idx)
                llm_positions = torch.cat(llm_pos_ids_list, dim=1).reshape(3, -1)
                position_ids[:, i, :] = llm_positions
                mrope_position_deltas.append(int(llm_positions.max()) + 1 - len(input_tokens))
            return position_ids, torch.tensor(mrope_position_deltas).reshape(-1, 1)
        return position_ids, torch.zeros(batch_size, 1, dtype=torch.long)

    def forward(self, inputs, inputs_embeds=None, mask=None, cache=None, **kwargs):
        position_ids = kwargs.pop("position_ids", None)
        pixel_values = kwargs.pop("pixel_values", None)
        image_grid_thw = kwargs.pop("image_grid_thw", None)
        video_grid_thw = kwargs.pop("video_grid_thw", None)
        rope_deltas_kw = kwargs.pop("rope_deltas", None)
        if pixel_values is not None:
            self._rope_deltas = None
            self._position_ids = None
        if rope_deltas_kw is not None:
            self._rope_deltas = rope_deltas_kw

        cache_offset = 0
        cache_offsets = None
        if cache and cache[0] is not None:
            c0 = cache[0]
            cache_offset = c0._idx if hasattr(c0, "_idx") else c0.offset

        if FIXED:
            if position_ids is not None and cache_offsets is None:
                seq_length = inputs.shape[-1]
                if position_ids.shape[-1] > seq_length:
                    position_ids = position_ids[..., cache_offset: cache_offset + seq_length]

        rope_mask = mask
        if mask is not None and mask.shape[-1] != inputs.shape[-1]:
            rope_mask = None

        if position_ids is None and (rope_mask is None or rope_mask.ndim == 2):
            if ((cache is not None and cache[0] is not None and cache_offset == 0)
                    or self._rope_deltas is None or cache is None):
                if self._position_ids is not None:
                    seq_length = inputs.shape[1]
                    position_ids = self._position_ids[..., cache_offset: cache_offset + seq_length]
                else:
                    position_ids, rope_deltas = self.get_rope_index(inputs, image_grid_thw,
                                                                    video_grid_thw, rope_mask)
                    self._rope_deltas = rope_deltas
                    self._position_ids = position_ids
            else:
                batch_size, seq_length = inputs.shape
                rope_deltas_src = rope_deltas_kw if rope_deltas_kw is not None else self._rope_deltas
                delta = torch.as_tensor(cache_offset + rope_deltas_src if cache is not None else 0)
                if delta.dim() == 0:
                    delta = delta[None]
                if delta.shape[0] < batch_size:
                    delta = delta.repeat(batch_size, 1)
                else:
                    delta = delta[:batch_size]
                position_ids = torch.arange(seq_length).reshape(1, -1).expand(batch_size, seq_length)
                position_ids = position_ids + delta
                if (rope_deltas_kw is not None
                        or self._position_ids is not None and self._position_ids.dim() == 3):
                    position_ids = position_ids[None].expand(3, batch_size, seq_length)

        out = self.model(inputs, cache=cache, inputs_embeds=inputs_embeds,
                         position_ids=position_ids)
        if self.args.tie_word_embeddings:
            return out @ self.model.embed_tokens.weight.T  # embed_tokens.as_linear
        return self.lm_head(out)

    @property
    def layers(self):
        return self.model.layers


# ----------------------------------------------------------------------------------------------
# mlx_vlm/models/qwen2_5_vl/qwen2_5_vl.py Model.get_input_embeddings (vision tower stubbed)
# ----------------------------------------------------------------------------------------------
class Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.language_model = LanguageModel(config.text_config, config)
        self.image_features = nn.Parameter(torch.randn(4, config.text_config.hidden_size))

    def get_input_embeddings(self, input_ids, pixel_values=None, image_grid_thw=None, mask=None):
        inputs_embeds = self.language_model.model.embed_tokens(input_ids)
        image_mask = input_ids == self.config.image_token_id
        inputs_embeds = inputs_embeds.clone()
        inputs_embeds[image_mask] = self.image_features  # stands in for self.vision_tower(...)
        position_ids, rope_deltas = self.language_model.get_rope_index(input_ids, image_grid_thw,
                                                                       None, mask)
        return dict(inputs_embeds=inputs_embeds, position_ids=position_ids,
                    rope_deltas=rope_deltas)


# ----------------------------------------------------------------------------------------------
# mlx_vlm/generate/ar.py generate_step (chunked prefill + greedy decode, trimmed)
# ----------------------------------------------------------------------------------------------
def generate_step(input_ids, model, pixel_values, image_grid_thw, max_tokens=6,
                  prefill_step_size=8):
    prompt_cache = make_prompt_cache(model.language_model)
    kwargs = {}

    def _step(y, inputs_embeds=None):
        nonlocal kwargs
        logits = model.language_model(y, inputs_embeds=inputs_embeds, cache=prompt_cache,
                                      **kwargs)[:, -1, :]
        kwargs = {}
        return logits.argmax(-1, keepdim=True), logits

    embedding_output = model.get_input_embeddings(input_ids, pixel_values,
                                                  image_grid_thw=image_grid_thw)
    inputs_embeds = embedding_output["inputs_embeds"]
    kwargs.update({k: v for k, v in embedding_output.items()
                   if k != "inputs_embeds" and v is not None})
    if prefill_step_size is not None and inputs_embeds.shape[1] > prefill_step_size:
        while inputs_embeds.shape[1] > 1:
            n_to_process = min(prefill_step_size, inputs_embeds.shape[1] - 1)
            model.language_model(inputs=input_ids[:, :n_to_process],
                                 inputs_embeds=inputs_embeds[:, :n_to_process],
                                 cache=prompt_cache, n_to_process=n_to_process, **kwargs)
            inputs_embeds = inputs_embeds[:, n_to_process:]
            input_ids = input_ids[:, n_to_process:]
        input_ids = input_ids[:, -1:]

    y, logits = _step(input_ids, inputs_embeds=inputs_embeds)
    first_logits = logits
    tokens = [int(y)]
    for _ in range(max_tokens - 1):
        y, logits = _step(y)
        tokens.append(int(y))
    return tokens, first_logits


def main():
    config = ModelConfig(text_config=TextConfig(), vision_config=VisionConfig())
    model = Model(config).eval()
    prompt = ([1, 14, 27, config.vision_start_token_id] + [config.image_token_id] * 4
              + [config.vision_end_token_id, 33, 8, 61, 5, 19, 42, 70, 12, 3, 55, 21])
    input_ids = torch.tensor([prompt])
    image_grid_thw = torch.tensor([[1, 4, 4]])
    pixel_values = torch.zeros(16, 8)
    with torch.no_grad():
        tokens, first_logits = generate_step(input_ids, model, pixel_values, image_grid_thw)
    print("prompt length:", len(prompt))
    print("first-token logits[:6]:", first_logits[0, :6].numpy().round(4))
    print("generated:", tokens)


if __name__ == "__main__":
    main()
