"""mlx-vlm Qwen3-Omni thinker: every decode step handed the language model RoPE position 0.

Citation: Blaizzy/mlx-vlm#1983, fixed by Blaizzy/mlx-vlm#1993 (commit 7f10c856),
mlx_vlm/models/qwen3_omni_moe/thinker.py (Thinker.__call__, get_input_embeddings) and
language.py (LanguageModel.get_rope_index, LanguageModel.__call__, Attention).

The bug: ``Thinker.__call__`` ran ``get_input_embeddings`` on every call, which computes
``position_ids, rope_deltas = language_model.get_rope_index(input_ids, ...)``. For a text-only
prompt that is ``arange(seq_length)``, restarting at 0 on each call, and the thinker forwarded
it to the language model on every step. During cached decode (seq_length 1) each generated
token was rotated at position 0 while its keys went into the cache beside the prompt's.

The fix: when the cache already holds tokens (offset > 0) the thinker drops ``position_ids``
and ``rope_deltas`` from the kwargs, so ``LanguageModel.__call__`` continues the positions from
the cache offset plus the ``rope_deltas`` it stored at prefill.

A torch port of the MLX code at toy sizes with random weights: dense MLP in place of the MoE
block, the text-only branch of get_rope_index, a concatenating KVCache with ``offset``, and a
greedy prefill + decode loop calling the thinker.
"""

import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class VisionConfig:
    spatial_merge_size: int = 2


@dataclass
class TextConfig:
    model_type: str = "qwen3_omni_moe_thinker"
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    vocab_size: int = 97
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 256
    rope_scaling: dict = field(
        default_factory=lambda: {"mrope_section": [2, 3, 3], "mrope_interleaved": True}
    )
    tie_word_embeddings: bool = False


@dataclass
class ThinkerConfig:
    text_config: TextConfig = field(default_factory=TextConfig)
    vision_config: VisionConfig = field(default_factory=VisionConfig)
    image_token_id: int = 90
    video_token_id: int = 91
    vision_start_token_id: int = 92


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


def create_attention_mask(h, cache=None):
    if h.shape[1] > 1:
        return "causal"
    return None


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask):
    n_rep = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(n_rep, dim=1)
    values = values.repeat_interleave(n_rep, dim=1)
    if isinstance(mask, str) and mask == "causal":
        L, S = queries.shape[2], keys.shape[2]
        m = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=m, scale=scale)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)


class Qwen3OmniMoeThinkerTextRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, rope_scaling=None):
        super().__init__()
        self.dim = dim
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.mrope_section = list(rope_scaling["mrope_section"])
        self.attention_scaling = 1.0
        self.fused_apply = False

    def __call__(self, x, position_ids):
        if position_ids.ndim == 2:
            freqs = position_ids.float()[..., None] * self.inv_freq
        else:
            # interleaved layout: frequency j takes axis j % 3 within its section
            sel = torch.zeros(self.inv_freq.shape[0], dtype=torch.long)
            for axis, n in ((1, self.mrope_section[1]), (2, self.mrope_section[2])):
                sel[axis : n * 3 : 3] = axis
            pos = position_ids.float()[..., None] * self.inv_freq  # (3, B, L, D/2)
            freqs = pos.gather(0, sel.view(1, 1, 1, -1).expand(1, *pos.shape[1:])).squeeze(0)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def apply_rotary(self, q, k, position_ids, unsqueeze_dim=1):
        cos, sin = self(q, position_ids)
        return apply_multimodal_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_multimodal_rotary_pos_emb(q, k, cos, sin, unqueeze_dim=1):
    cos = cos.unsqueeze(unqueeze_dim)
    sin = sin.unsqueeze(unqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(nn.Module):
    def __init__(self, args: TextConfig):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.rotary_emb = Qwen3OmniMoeThinkerTextRotaryEmbedding(
            head_dim,
            max_position_embeddings=args.max_position_embeddings,
            base=args.rope_theta,
            rope_scaling=args.rope_scaling,
        )

    def forward(self, x, mask=None, cache=None, position_ids=None, position_embeddings=None):
        B, L, D = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = self.q_norm(queries.reshape(B, L, self.n_heads, self.head_dim)).transpose(1, 2)
        keys = self.k_norm(keys.reshape(B, L, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = keys.shape[-2]
        if position_ids is None:
            kv_seq_len += cache.offset + 1
            position_ids = torch.arange(cache.offset, cache.offset + L)
            position_ids = position_ids[None].expand(3, 1, L)
        else:
            kv_seq_len += cache.offset + 1 if cache is not None else 0

        if position_embeddings is None:
            queries, keys = self.rotary_emb.apply_rotary(queries, keys, position_ids, 1)
        else:
            cos, sin = position_embeddings
            queries, keys = apply_multimodal_rotary_pos_emb(queries, keys, cos, sin)

        if mask is not None and isinstance(mask, torch.Tensor):
            mask = mask[..., : int(kv_seq_len)]

        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)

        output = scaled_dot_product_attention(queries, keys, values, cache, scale=self.scale, mask=mask)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3OmniMoEThinkerTextDecoderLayer(nn.Module):
    def __init__(self, args: TextConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def forward(self, x, mask=None, cache=None, position_ids=None, position_embeddings=None):
        r = self.self_attn(self.input_layernorm(x), mask=mask, cache=cache,
                           position_ids=position_ids, position_embeddings=position_embeddings)
        h = x + r
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3VLMoEModel(nn.Module):
    def __init__(self, args: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen3OmniMoEThinkerTextDecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        )
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, inputs_embeds=None, mask=None, cache=None, position_ids=None):
        h = self.embed_tokens(inputs) if inputs_embeds is None else inputs_embeds
        if cache is None:
            cache = [None] * len(self.layers)
        if mask is None:
            mask = create_attention_mask(h, cache[0] if cache and cache[0] is not None else cache)
        position_embeddings = None
        if position_ids is not None and not self.layers[0].self_attn.rotary_emb.fused_apply:
            position_embeddings = self.layers[0].self_attn.rotary_emb(h, position_ids)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c, position_ids, position_embeddings)
        return self.norm(h)


class LanguageModel(nn.Module):
    def __init__(self, args: TextConfig, config: ThinkerConfig = None):
        super().__init__()
        self.args = args
        self.config = config
        self.model = Qwen3VLMoEModel(args)
        self._rope_deltas = None
        self._position_ids = None
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def make_cache(self):
        return [KVCache() for _ in self.model.layers]

    def get_rope_index(self, input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
        batch_size, seq_length = input_ids.shape
        position_ids = torch.arange(seq_length, dtype=torch.int32)
        position_ids = position_ids[None, :].expand(batch_size, seq_length)
        # (the image / video branch is not reached by a text-only prompt)
        if attention_mask is not None:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids = torch.where(attention_mask == 0, torch.ones_like(position_ids), position_ids)
            max_position_ids = position_ids.max(dim=-1, keepdim=True).values
            position_ids = position_ids[None].expand(3, *position_ids.shape)
            mrope_position_deltas = max_position_ids + 1 - attention_mask.shape[-1]
        else:
            position_ids = torch.arange(input_ids.shape[1]).reshape(1, -1)
            position_ids = position_ids.expand(3, input_ids.shape[0], input_ids.shape[1])
            mrope_position_deltas = torch.zeros(input_ids.shape[0], 1, dtype=input_ids.dtype)
        return position_ids, mrope_position_deltas

    def forward(self, inputs, inputs_embeds=None, mask=None, cache=None, **kwargs):
        position_ids = kwargs.pop("position_ids", None)
        image_grid_thw = kwargs.pop("image_grid_thw", None)
        video_grid_thw = kwargs.pop("video_grid_thw", None)
        rope_deltas_kw = kwargs.pop("rope_deltas", None)
        if rope_deltas_kw is not None:
            self._rope_deltas = rope_deltas_kw

        cache_offset = 0
        if cache and cache[0] is not None:
            cache_offset = cache[0].offset

        # Chunked prefill passes the full-prompt position_ids to every chunk
        if position_ids is not None:
            seq_length = inputs.shape[-1]
            if position_ids.shape[-1] > seq_length:
                position_ids = position_ids[..., cache_offset : cache_offset + seq_length]

        rope_mask = mask
        if mask is not None and mask.shape[-1] != inputs.shape[-1]:
            rope_mask = None

        if position_ids is None and (rope_mask is None or rope_mask.ndim == 2):
            recalc_condition = (
                (cache is not None and cache[0] is not None and cache_offset == 0)
                or (self._rope_deltas is None and rope_deltas_kw is None)
                or cache is None
            )
            if recalc_condition:
                position_ids, rope_deltas = self.get_rope_index(inputs, image_grid_thw, video_grid_thw, rope_mask)
                self._rope_deltas = rope_deltas
                self._position_ids = position_ids
            else:
                batch_size, seq_length = inputs.shape
                rope_deltas_src = rope_deltas_kw if rope_deltas_kw is not None else self._rope_deltas
                delta = torch.as_tensor(cache_offset + rope_deltas_src if cache is not None else 0)
                if delta.ndim == 0:
                    delta = delta[None]
                if delta.shape[0] < batch_size:
                    delta = delta.repeat(batch_size, 1)
                else:
                    delta = delta[:batch_size]
                position_ids = torch.arange(seq_length).reshape(1, -1).expand(batch_size, seq_length)
                position_ids = (position_ids + delta)[None, ...]
                position_ids = position_ids.expand(3, batch_size, seq_length)

        out = self.model(inputs, cache=cache, inputs_embeds=inputs_embeds, position_ids=position_ids)
        return self.lm_head(out)


class Thinker(nn.Module):
    def __init__(self, config: ThinkerConfig):
        super().__init__()
        self.config = config
        self.language_model = LanguageModel(config.text_config, config)

    def get_input_embeddings(self, input_ids, image_grid_thw=None, video_grid_thw=None, mask=None):
        inputs_embeds = self.language_model.model.embed_tokens(input_ids)
        position_ids, rope_deltas = self.language_model.get_rope_index(
            input_ids, image_grid_thw, video_grid_thw, mask
        )
        if image_grid_thw is None and video_grid_thw is None and position_ids.ndim == 3:
            position_ids = position_ids[0]
        return dict(inputs_embeds=inputs_embeds, position_ids=position_ids, rope_deltas=rope_deltas)

    def forward(self, input_ids, mask=None, cache=None, **kwargs):
        image_grid_thw = kwargs.pop("image_grid_thw", None)
        video_grid_thw = kwargs.pop("video_grid_thw", None)
        feats = self.get_input_embeddings(input_ids, image_grid_thw, video_grid_thw, mask=mask)
        kwargs = {"image_grid_thw": image_grid_thw, "video_grid_thw": video_grid_thw, **feats, **kwargs}

        if FIXED:
            c0 = cache[0] if cache else None
            if c0 is not None:
                offset = getattr(c0, "_idx", None)
                if offset is None:
                    offset = getattr(c0, "offset", 0)
                offset = int(offset.max().item()) if isinstance(offset, torch.Tensor) else int(offset)
                if offset > 0:
                    kwargs.pop("position_ids", None)
                    kwargs.pop("rope_deltas", None)

        return self.language_model(input_ids, mask=mask, cache=cache, **kwargs)


@torch.no_grad()
def generate(thinker, prompt, max_tokens):
    cache = thinker.language_model.make_cache()
    logits = thinker(prompt, cache=cache)
    y = logits[:, -1].argmax(-1, keepdim=True)
    tokens, last_logits = [y.item()], [logits[:, -1]]
    for _ in range(max_tokens - 1):
        logits = thinker(y, cache=cache)
        y = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(y.item())
        last_logits.append(logits[:, -1])
    return tokens, torch.cat(last_logits)


def main():
    torch.manual_seed(0)
    config = ThinkerConfig()
    thinker = Thinker(config).eval()
    for p in thinker.parameters():
        p.data.normal_(0, 0.3)
    prompt = torch.randint(0, 90, (1, 40))
    tokens, logits = generate(thinker, prompt, max_tokens=10)
    print("fixed" if FIXED else "buggy", "generated:", tokens)
    print("decode logits checksum: %.4f" % logits.sum().item())


if __name__ == "__main__":
    main()
