"""mlx-vlm continuous batching, Qwen2-VL: a decoding request reads the MRoPE delta of a newer request.

Citation: Blaizzy/mlx-vlm#1143 (commit 3fb553d4, "Fix Qwen MRoPE rope_deltas kwarg precedence in
decode"), mlx_vlm/models/qwen2_vl/language.py ``LanguageModel.__call__`` (same change in qwen2_5_vl and
qwen3_5); the engine side is mlx_vlm/generate.py ``GenerationBatch._step`` / ``_capture_rope_deltas``
read at 3fb553d4^. MLX ported to torch.

The bug: each ``GenerationBatch`` captures its rows' ``rope_deltas`` after prefill and hands them to
every decode step as the ``rope_deltas`` kwarg. In the scalar-offset decode branch (a batch whose cache
offset is one number) ``LanguageModel.__call__`` ignored the kwarg and built the decode positions as
``cache_offset + self._rope_deltas``: the model-wide attribute, which the prefill of any newer request
(a different image prompt) had just overwritten. Request A then decodes at positions shifted by
request B's delta while its cache holds keys rotated with its own.

The fix: ``rope_deltas_src = rope_deltas_kw if rope_deltas_kw is not None else self._rope_deltas`` and
``delta = cache_offset + rope_deltas_src`` in that branch too.

Toy sizes, random weights: TextConfig / ModelConfig dataclasses as in mlx-vlm's qwen2_vl/config.py,
the Qwen2 decoder with the MRoPE rotary (``apply_mrope`` over ``mrope_section``), a per-request KVCache
with an integer ``offset``, ``create_attention_mask`` giving the causal mask at prefill, and a vision
tower replaced by a fixed projection of ``pixel_values``. Request A (one image) starts decoding; request
B (another image, other grid) is prefilled while A is in flight; both then decode in turn.
"""

import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class VisionConfig:
    spatial_merge_size: int = 2
    in_dim: int = 12


@dataclass
class TextConfig:
    model_type: str = "qwen2_vl"
    hidden_size: int = 32
    num_hidden_layers: int = 2
    intermediate_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    vocab_size: int = 64
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=lambda: {"type": "mrope", "mrope_section": [1, 1, 2]})
    tie_word_embeddings: bool = False


@dataclass
class ModelConfig:
    text_config: TextConfig
    vision_config: VisionConfig
    image_token_id: int = 60
    video_token_id: int = 59
    vision_start_token_id: int = 61
    vision_end_token_id: int = 62


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


def create_attention_mask(h, cache):
    T = h.shape[1]
    if T > 1:
        offset = cache[0].offset if cache is not None and cache[0] is not None else 0
        rinds = torch.arange(offset + T)
        linds = torch.arange(offset, offset + T)
        return linds[:, None] >= rinds[None]
    return None


class Qwen2RotaryEmbedding:
    def __init__(self, dim, max_position_embeddings=2048, base=10000, rope_scaling=None):
        self.dim = dim
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.attention_scaling = 1.0
        self.mrope_section = rope_scaling.get("mrope_section", [24, 20, 20])

    def apply_mrope(self, freqs, mrope_section):
        freqs_t = freqs[0].clone()  # just overwrite the first dimension T
        offset = mrope_section[0]
        for dim, length in enumerate(mrope_section[1:], start=1):  # H, W
            idx = slice(offset, offset + length)
            freqs_t[..., idx] = freqs[dim, ..., idx]
            offset += length
        return freqs_t

    def __call__(self, x, position_ids):
        if position_ids.ndim == 2:
            position_ids = position_ids[None].expand(3, *position_ids.shape)
        inv_freq_expanded = self.inv_freq[None, None, :, None].expand(3, position_ids.shape[1], -1, 1)
        position_ids_expanded = position_ids[:, :, None, :].float()
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(2, 3)
        freqs = self.apply_mrope(freqs, self.mrope_section)
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat([-x2, x1], dim=-1)


def apply_multimodal_rotary_pos_emb(q, k, cos, sin, unqueeze_dim=1):
    cos, sin = cos.unsqueeze(unqueeze_dim), sin.unsqueeze(unqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class Attention(nn.Module):
    def __init__(self, args: TextConfig):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.hidden_size // n_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=True)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=True)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=True)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.rotary_emb = Qwen2RotaryEmbedding(
            head_dim, max_position_embeddings=args.max_position_embeddings,
            base=args.rope_theta, rope_scaling=args.rope_scaling,
        )

    def forward(self, x, mask=None, cache: Optional[KVCache] = None, position_ids=None):
        B, L, D = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)

        if position_ids is None:
            position_ids = torch.arange(cache.offset, cache.offset + L)[None]
            position_ids = position_ids[None].expand(3, 1, L)

        cos, sin = self.rotary_emb(values, position_ids)
        if mask is not None:
            mask = mask[..., : cache.offset + L if cache is not None else L]
        queries, keys = apply_multimodal_rotary_pos_emb(queries, keys, cos, sin, unqueeze_dim=1)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        rep = self.n_heads // self.n_kv_heads
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        output = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        return self.o_proj(output.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2VLDecoderLayer(nn.Module):
    def __init__(self, args: TextConfig):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None, position_ids=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache, position_ids)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2Model(nn.Module):
    def __init__(self, args: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([Qwen2VLDecoderLayer(args) for _ in range(args.num_hidden_layers)])
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, inputs_embeds=None, mask=None, cache=None, position_ids=None):
        h = self.embed_tokens(inputs) if inputs_embeds is None else inputs_embeds
        if cache is None:
            cache = [None] * len(self.layers)
        if mask is None:
            mask = create_attention_mask(h, cache)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c, position_ids)
        return self.norm(h)


class LanguageModel(nn.Module):
    def __init__(self, args: TextConfig, config: ModelConfig):
        super().__init__()
        self.args = args
        self.config = config
        self.model = Qwen2Model(args)
        self._rope_deltas = None
        self._position_ids = None
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def get_rope_index(self, input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
        batch_size, seq_length = input_ids.shape
        spatial_merge_size = self.config.vision_config.spatial_merge_size
        image_token_id = self.config.image_token_id
        vision_start_token_id = self.config.vision_start_token_id
        mrope_position_deltas = []
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        position_ids = torch.ones(3, batch_size, seq_length, dtype=input_ids.dtype)
        image_index = 0
        for i, ids in enumerate(input_ids):
            ids = torch.where(attention_mask[i] == 1, ids, torch.zeros_like(ids))
            vision_start_indices = torch.nonzero(ids == vision_start_token_id).flatten()
            image_nums = int((ids[vision_start_indices + 1] == image_token_id).sum())
            input_tokens = ids.tolist()
            llm_pos_ids_list = []
            st = 0
            for _ in range(image_nums):
                ed = input_tokens.index(image_token_id, st)
                t, h, w = image_grid_thw[image_index].tolist()
                image_index += 1
                llm_grid_t, llm_grid_h, llm_grid_w = t, h // spatial_merge_size, w // spatial_merge_size
                text_len = ed - st
                st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
                t_index = torch.arange(llm_grid_t).view(-1, 1).expand(-1, llm_grid_h * llm_grid_w).flatten()
                h_index = torch.arange(llm_grid_h).view(1, -1, 1).expand(llm_grid_t, -1, llm_grid_w).flatten()
                w_index = torch.arange(llm_grid_w).view(1, 1, -1).expand(llm_grid_t, llm_grid_h, -1).flatten()
                llm_pos_ids_list.append(torch.stack([t_index, h_index, w_index]) + text_len + st_idx)
                st = ed + llm_grid_t * llm_grid_h * llm_grid_w
            if st < len(input_tokens):
                st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                text_len = len(input_tokens) - st
                llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
            llm_positions = torch.cat(llm_pos_ids_list, dim=1).reshape(3, -1)
            position_ids[:, i, attention_mask[i] == 1] = llm_positions
            mrope_position_deltas.append(int(llm_positions.max()) + 1 - len(input_tokens))
        return position_ids, torch.tensor(mrope_position_deltas).reshape(-1, 1)

    def forward(self, inputs, inputs_embeds=None, mask=None, cache=None, **kwargs):
        position_ids = kwargs.pop("position_ids", None)
        pixel_values = kwargs.pop("pixel_values", None)
        image_grid_thw = kwargs.pop("image_grid_thw", None)
        video_grid_thw = kwargs.pop("video_grid_thw", None)
        rope_deltas_kw = kwargs.pop("rope_deltas", None)
        # reset rope_deltas and position_ids when processing a new image/video
        if pixel_values is not None:
            self._rope_deltas = None
            self._position_ids = None

        cache_offset = 0
        if cache and cache[0] is not None:
            cache_offset = cache[0].offset

        rope_mask = mask
        if mask is not None and mask.shape[-1] != inputs.shape[-1]:
            rope_mask = None

        if position_ids is None and (rope_mask is None or rope_mask.ndim == 2):
            # Calculate RoPE index once per generation in the pre-fill stage only
            if (
                (cache is not None and cache[0] is not None and (cache_offset == 0))
                or self._rope_deltas is None
                or cache is None
            ):
                if self._position_ids is not None:
                    seq_length = inputs.shape[1]
                    position_ids = self._position_ids[:, :, cache_offset : cache_offset + seq_length]
                else:
                    position_ids, rope_deltas = self.get_rope_index(
                        inputs, image_grid_thw, video_grid_thw, rope_mask
                    )
                    self._rope_deltas = rope_deltas
                    self._position_ids = position_ids
            else:
                batch_size, seq_length = inputs.shape
                if FIXED:
                    rope_deltas_src = rope_deltas_kw if rope_deltas_kw is not None else self._rope_deltas
                    delta = torch.as_tensor(cache_offset + rope_deltas_src if cache is not None else 0)
                else:
                    delta = torch.as_tensor(cache_offset + self._rope_deltas if cache is not None else 0)
                if delta.ndim == 0:
                    delta = delta.unsqueeze(0)
                if delta.shape[0] < batch_size:
                    delta = delta.repeat(batch_size, 1)
                else:
                    delta = delta[:batch_size]

                position_ids = torch.arange(seq_length).reshape(1, -1).expand(batch_size, seq_length)
                position_ids = (position_ids + delta)[None, ...].expand(3, batch_size, seq_length)

        out = self.model(inputs, cache=cache, inputs_embeds=inputs_embeds, position_ids=position_ids)
        return self.lm_head(out)


class Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.vision_tower = nn.Linear(config.vision_config.in_dim, config.text_config.hidden_size)
        self.language_model = LanguageModel(config.text_config, config)

    def get_input_embeddings(self, input_ids, pixel_values):
        inputs_embeds = self.language_model.model.embed_tokens(input_ids)
        image_mask = (input_ids == self.config.image_token_id)[..., None].expand_as(inputs_embeds)
        return inputs_embeds.masked_scatter(image_mask, self.vision_tower(pixel_values))

    def forward(self, input_ids, pixel_values, image_grid_thw, cache):
        inputs_embeds = self.get_input_embeddings(input_ids, pixel_values)
        return self.language_model(
            input_ids, inputs_embeds=inputs_embeds, cache=cache,
            pixel_values=pixel_values, image_grid_thw=image_grid_thw,
        )


class GenerationBatch:
    def __init__(self, language_model, uids, inputs, prompt_cache):
        self._language_model = language_model
        self.uids = uids
        self.prompt_cache = prompt_cache
        self._next_tokens = inputs
        self.tokens = [[] for _ in uids]
        self.first_decode_logits = None
        # Per-sequence MRoPE delta
        self._rope_deltas = None

    def _step(self):
        inputs = self._next_tokens
        for i, t in enumerate(inputs.tolist()):
            self.tokens[i].append(t)
        fwd_kwargs = {}
        if self._rope_deltas is not None:
            fwd_kwargs["rope_deltas"] = self._rope_deltas
        logits = self._language_model(inputs[:, None], cache=self.prompt_cache, **fwd_kwargs)
        logits = logits[:, -1, :]
        if self.first_decode_logits is None:
            self.first_decode_logits = logits
        self._next_tokens = logits.argmax(-1)


def _capture_rope_deltas(language_model, B):
    if not hasattr(language_model, "_rope_deltas"):
        return None
    rope_deltas = language_model._rope_deltas
    if rope_deltas is None:
        return torch.zeros(B, 1, dtype=torch.long)
    if rope_deltas.ndim == 0:
        rope_deltas = rope_deltas.reshape(1, 1)
    elif rope_deltas.ndim == 1:
        rope_deltas = rope_deltas[:, None]
    if rope_deltas.shape[0] == 1 and B > 1:
        rope_deltas = rope_deltas.expand(B, 1)
    return rope_deltas


@torch.no_grad()
def prefill(model, uid, input_ids, pixel_values, image_grid_thw):
    prompt_cache = [KVCache() for _ in model.language_model.model.layers]
    logits = model(input_ids, pixel_values, image_grid_thw, prompt_cache)
    gen_batch = GenerationBatch(model.language_model, [uid], logits[:, -1, :].argmax(-1), prompt_cache)
    gen_batch._rope_deltas = _capture_rope_deltas(model.language_model, 1)
    return gen_batch


def build_prompt(config, pre, grid_thw, post):
    m = config.vision_config.spatial_merge_size
    n_img = grid_thw[0] * (grid_thw[1] // m) * (grid_thw[2] // m)
    ids = pre + [config.vision_start_token_id] + [config.image_token_id] * n_img + [config.vision_end_token_id] + post
    return torch.tensor([ids]), torch.randn(n_img, config.vision_config.in_dim), torch.tensor([grid_thw])


def main():
    torch.manual_seed(0)
    config = ModelConfig(text_config=TextConfig(), vision_config=VisionConfig())
    model = Model(config).eval()
    with torch.no_grad():
        model.language_model.model.embed_tokens.weight.mul_(4.0)
        for layer in model.language_model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)

    req_a = build_prompt(config, [1, 5, 6, 7], [1, 8, 8], [8, 9, 10])
    req_b = build_prompt(config, [1, 11], [1, 4, 12], [12, 13, 14, 15, 16, 17])

    with torch.no_grad():
        batch_a = prefill(model, "A", *req_a)
        batch_a._step()
        batch_a._step()
        # a new request arrives while A is decoding: its prefill runs on the same model
        batch_b = prefill(model, "B", *req_b)
        for _ in range(4):
            batch_a._step()
            batch_b._step()

    print("rope_deltas captured: A", batch_a._rope_deltas.flatten().tolist(),
          "B", batch_b._rope_deltas.flatten().tolist(),
          "model attribute", model.language_model._rope_deltas.flatten().tolist())
    print("A tokens:", batch_a.tokens[0])
    print("B tokens:", batch_b.tokens[0])
    print("A cache offset:", batch_a.prompt_cache[0].offset, "B cache offset:", batch_b.prompt_cache[0].offset)
    with torch.no_grad():
        logits = model.language_model(
            batch_a._next_tokens[:, None], cache=batch_a.prompt_cache, rope_deltas=batch_a._rope_deltas
        )
    print("A next-step logits[:6]:", [round(v, 4) for v in logits[0, -1, :6].tolist()])


if __name__ == "__main__":
    main()
