"""AI Edge Torch PaliGemma2 re-authoring: the image + prompt prefix was prefilled with a causal mask.

Citation: google-ai-edge/ai-edge-torch commit 45f18d2 "Fix broken PaliGemma2"
("PaliGemma2 doesn't use diagonal mask any more"), in
ai_edge_torch/generative/examples/paligemma/decoder2.py (and paligemma.py, verify.py).

The bug: ``Decoder2.forward`` (the Gemma2 decoder of PaliGemma2, re-authored in torch for
on-device TFLite export) took ``called_by_generate: bool = True``. When it was true (the
default, used by generation), a prefill with ``input_embeds`` (image embeddings followed by
the text prompt) used the per-layer diagonal causal masks from ``get_attention_mask``, so
image patches and prompt tokens could not see later prefix positions. PaliGemma is a
prefix-LM: the whole image + prompt prefix attends bidirectionally. Only the
``called_by_generate=False`` branch built that mask.

The fix: remove ``called_by_generate``; whenever ``mask is None`` and ``input_embeds`` is
given, ``mask = torch.zeros(embeds_len, kv_cache_max); mask[:, embeds_len:] = -inf``.

This program keeps the re-authored structure (ModelConfig / AttentionConfig with per-layer
attn_type, a KVCache of per-layer entries updated at ``input_pos``, mask caches indexed with
``index_select(2, input_pos)``, Gemma2's logit softcap attention, PaliGemma merging image
embeddings by concatenation) at toy sizes with random weights. The SigLIP image encoder is
reduced to a patch embedding, which does not touch the decoder masks. One prefill of 4 image
patches + 4 prompt tokens, then 3 greedy decode steps.
"""

import dataclasses
import enum
import math
import sys
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


# ---- model_config.py ---------------------------------------------------------------------------
class AttentionType(enum.Enum):
    GLOBAL = enum.auto()
    LOCAL_SLIDING = enum.auto()


@dataclasses.dataclass
class AttentionConfig:
    num_heads: int
    head_dim: int
    num_query_groups: int
    rotary_base: int = 10000
    rotary_percentage: float = 1.0
    logit_softcap: Optional[float] = None
    sliding_window_size: Optional[int] = None
    attn_type: Optional[AttentionType] = None


@dataclasses.dataclass
class TransformerBlockConfig:
    attn_config: AttentionConfig
    intermediate_size: int


@dataclasses.dataclass
class ModelConfig:
    vocab_size: int
    num_layers: int
    max_seq_len: int
    embedding_dim: int
    kv_cache_max_len: int
    block_configs: List[TransformerBlockConfig]
    embedding_scale: Optional[float] = None
    final_logit_softcap: Optional[float] = None

    @property
    def kv_cache_max(self) -> int:
        return self.kv_cache_max_len

    def block_config(self, idx: int) -> TransformerBlockConfig:
        return self.block_configs[idx]


# ---- kv_cache.py -------------------------------------------------------------------------------
@dataclasses.dataclass
class KVCacheEntry:
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @classmethod
    def from_model_config(cls, kv_cache_max, config: AttentionConfig, batch_size=1):
        shape = (batch_size, kv_cache_max, config.num_query_groups, config.head_dim)
        return cls(torch.zeros(shape), torch.zeros(shape))


@dataclasses.dataclass
class KVCache:
    caches: Tuple[KVCacheEntry, ...]

    @classmethod
    def from_model_config(cls, config: ModelConfig):
        return cls(tuple(KVCacheEntry.from_model_config(config.kv_cache_max, config.block_config(i).attn_config)
                         for i in range(config.num_layers)))


def update(cache: KVCacheEntry, input_pos, k_slice, v_slice) -> KVCacheEntry:
    k = cache.k_cache.index_copy(1, input_pos.to(torch.long), k_slice)
    v = cache.v_cache.index_copy(1, input_pos.to(torch.long), v_slice)
    return KVCacheEntry(k, v)


# ---- attention_utils.py / rotary_pos_emb.py ----------------------------------------------------
def build_causal_mask_cache(size: int, dtype=torch.float32) -> torch.Tensor:
    mask = torch.full((size, size), float('-inf'), dtype=dtype)
    return torch.triu(mask, diagonal=1).unsqueeze(0).unsqueeze(0)


def build_sliding_window_mask_cache(size: int, window_size: int, dtype=torch.float32) -> torch.Tensor:
    mask = build_causal_mask_cache(size, dtype)
    all_ones = torch.ones_like(mask)
    window_size = min(size, window_size)
    sliding_mask = torch.triu(all_ones, -1 * window_size + 1) * torch.tril(all_ones, window_size - 1)
    return torch.where(sliding_mask == 1, mask, float('-inf'))


def build_rope(input_pos, n_elem, base=10000):
    freq_exponents = (2.0 / n_elem) * torch.arange(n_elem // 2, dtype=torch.float32)
    timescale = float(base) ** freq_exponents
    radians = input_pos.clone().unsqueeze(0).unsqueeze(-1) / timescale.unsqueeze(0).unsqueeze(0)
    return torch.cos(radians), torch.sin(radians)


def apply_rope(x, cos, sin):
    x = x.transpose(1, 2)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.transpose(1, 2).type_as(x)


# ---- scaled_dot_product_attention.py -----------------------------------------------------------
def scaled_dot_product_attention(q, k, v, head_size, mask=None, scale=None, softcap=None):
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if q.size() != k.size():
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if softcap is None:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=mask is None,
                                           scale=scale)
    else:
        q = q * scale
        scores = q @ k.transpose(-1, -2)
        scores = scores / softcap
        scores = torch.tanh(scores)
        scores = scores * softcap
        scores = scores + mask
        out = F.softmax(scores.float(), dim=-1).type_as(q)
        y = torch.matmul(out, v)
    return y.transpose(1, 2)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, config: AttentionConfig):
        super().__init__()
        self.config = config
        qkv_shape = (config.num_heads + 2 * config.num_query_groups) * config.head_dim
        self.qkv_projection = nn.Linear(dim, qkv_shape, bias=False)
        self.output_projection = nn.Linear(config.num_heads * config.head_dim, dim, bias=False)

    def forward(self, x, rope=None, mask=None, input_pos=None, kv_cache=None):
        B, T, E = x.size()
        qkv = self.qkv_projection(x)
        q_per_kv = self.config.num_heads // self.config.num_query_groups
        qkv = qkv.view(B, T, self.config.num_query_groups, -1)
        q, k, v = qkv.split((q_per_kv * self.config.head_dim, self.config.head_dim, self.config.head_dim), dim=-1)
        q = q.reshape(B, T, -1, self.config.head_dim)
        k = k.reshape(B, T, -1, self.config.head_dim)
        v = v.reshape(B, T, -1, self.config.head_dim)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            kv_cache = update(kv_cache, input_pos, k, v)
            k, v = kv_cache.k_cache, kv_cache.v_cache
        sdpa_out = scaled_dot_product_attention(q, k, v, self.config.head_dim, mask=mask,
                                                softcap=self.config.logit_softcap)
        y = self.output_projection(sdpa_out.reshape(B, T, -1))
        return y if kv_cache is None else (y, kv_cache)


class Gemma2Block(nn.Module):
    def __init__(self, config: TransformerBlockConfig, model_config: ModelConfig):
        super().__init__()
        dim = model_config.embedding_dim
        self.config = config
        self.pre_atten_norm = nn.RMSNorm(dim)
        self.atten_func = CausalSelfAttention(dim, config.attn_config)
        self.post_atten_norm = nn.RMSNorm(dim)
        self.pre_ff_norm = nn.RMSNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, config.intermediate_size), nn.GELU(approximate="tanh"),
                                nn.Linear(config.intermediate_size, dim))
        self.post_ff_norm = nn.RMSNorm(dim)

    def forward(self, x, rope=None, mask=None, input_pos=None, kv_cache=None):
        x_norm = self.pre_atten_norm(x)
        attn_out, kv = self.atten_func(x_norm, rope, mask, input_pos, kv_cache)
        x = x + self.post_atten_norm(attn_out)
        x = x + self.post_ff_norm(self.ff(self.pre_ff_norm(x)))
        return x, kv


class Gemma2(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.tok_embedding = nn.Embedding(config.vocab_size, config.embedding_dim, padding_idx=0)
        self.lm_head = nn.Linear(config.embedding_dim, config.vocab_size, bias=False)
        self.lm_head.weight.data = self.tok_embedding.weight.data
        self.transformer_blocks = nn.ModuleList(Gemma2Block(config.block_config(idx), config)
                                                for idx in range(config.num_layers))
        self.final_norm = nn.RMSNorm(config.embedding_dim)
        self.mask_cache = build_causal_mask_cache(size=config.kv_cache_max)
        # Gemma2 has same hyper parameters for each layer except for attention types.
        attn_config = config.block_config(0).attn_config
        self.sliding_window_mask_cache = build_sliding_window_mask_cache(
            size=config.kv_cache_max, window_size=attn_config.sliding_window_size)
        self.config = config

    def get_attention_mask(self, attn_type: AttentionType, input_pos: torch.Tensor) -> torch.Tensor:
        if attn_type == AttentionType.LOCAL_SLIDING:
            return self.sliding_window_mask_cache.index_select(2, input_pos)
        return self.mask_cache.index_select(2, input_pos)

    @torch.inference_mode
    def forward(self, tokens, input_pos, kv_cache, mask=None, export_config=None):
        input_embeds = self.tok_embedding(tokens)
        attn_config = self.config.block_config(0).attn_config
        n_elem = int(attn_config.rotary_percentage * attn_config.head_dim)
        rope = build_rope(input_pos, n_elem, attn_config.rotary_base)
        if mask is None:
            mask = [self.get_attention_mask(self.config.block_config(i).attn_config.attn_type, input_pos)
                    for i in range(self.config.num_layers)]
        return self._forward_with_embeds(input_embeds, rope, mask, input_pos, kv_cache, export_config)

    def _forward_with_embeds(self, input_embeds, rope, mask, input_pos, kv_cache, export_config=None):
        if self.config.embedding_scale is not None:
            input_embeds = input_embeds * self.config.embedding_scale
        x = input_embeds
        updated_kv_entries = []
        for i, block in enumerate(self.transformer_blocks):
            mask_entry = mask[i] if isinstance(mask, list) else mask
            kv_entry = kv_cache.caches[i] if kv_cache else None
            x, kv_entry = block(x, rope, mask_entry, input_pos, kv_entry)
            if kv_entry:
                updated_kv_entries.append(kv_entry)
        updated_kv_cache = KVCache(tuple(updated_kv_entries))
        x = self.final_norm(x)
        res = self.lm_head(x)
        if self.config.final_logit_softcap is not None:
            res = torch.tanh(res / self.config.final_logit_softcap) * self.config.final_logit_softcap
        return {"logits": res, "kv_cache": updated_kv_cache}


class Decoder2(Gemma2):
    """A decoder of PaliGemma2 3B model which is Gemma2."""

    @torch.inference_mode
    def forward(self, tokens, input_pos, kv_cache, input_embeds=None, mask=None, export_config=None,
                called_by_generate: bool = True):
        if input_embeds is None:
            return super().forward(tokens, input_pos, kv_cache, mask, export_config)

        repo_pos = input_pos + 1  # PaliGemma2 position is 1-based.
        attn_config = self.config.block_config(0).attn_config
        n_elem = int(attn_config.rotary_percentage * attn_config.head_dim)
        rope = build_rope(repo_pos, n_elem, attn_config.rotary_base)

        if mask is None:
            if called_by_generate and not FIXED:
                # PaliGemma2 generate() uses a diagonal causal mask even with image embeds.
                mask = [self.get_attention_mask(self.config.block_config(i).attn_config.attn_type, input_pos)
                        for i in range(self.config.num_layers)]
            else:
                # By default, don't mask image embeds with a diagonal causal mask.
                embeds_len = input_embeds.shape[1]
                mask = torch.zeros(embeds_len, self.config.kv_cache_max)
                mask[:, embeds_len:] = float("-inf")

        return self._forward_with_embeds(input_embeds, rope, mask, input_pos, kv_cache, export_config)


def get_decoder2_config(kv_cache_max_len: int = 16) -> ModelConfig:
    def get_block_config(idx: int) -> TransformerBlockConfig:
        attn_config = AttentionConfig(
            num_heads=2, head_dim=16, num_query_groups=1, rotary_base=10000, rotary_percentage=1.0,
            logit_softcap=50.0, sliding_window_size=4096,
            attn_type=(AttentionType.GLOBAL if idx % 2 == 0 else AttentionType.LOCAL_SLIDING),
        )
        return TransformerBlockConfig(attn_config=attn_config, intermediate_size=64)

    num_layers = 2
    embedding_dim = 32
    return ModelConfig(vocab_size=128, num_layers=num_layers, max_seq_len=64, embedding_dim=embedding_dim,
                       kv_cache_max_len=kv_cache_max_len,
                       block_configs=[get_block_config(i) for i in range(num_layers)],
                       embedding_scale=embedding_dim ** 0.5, final_logit_softcap=30.0)


@dataclasses.dataclass
class PaliGemmaConfig:
    decoder_config: ModelConfig
    image_size: int
    patch_size: int
    image_token_id: int
    image_projection_scale: float
    image_projection_use_bias: bool = False


class PaliGemma(nn.Module):
    def __init__(self, config: PaliGemmaConfig):
        super().__init__()
        # SigLIP reduced to its patch embedding (no decoder mask involved there).
        self.image_encoder = nn.Conv2d(3, 24, kernel_size=config.patch_size, stride=config.patch_size)
        self.image_projection = nn.Linear(24, config.decoder_config.embedding_dim,
                                          bias=config.image_projection_use_bias)
        self.decoder = Decoder2(config.decoder_config)
        self.num_patches = (config.image_size // config.patch_size) ** 2
        self.config = config

    @torch.inference_mode
    def forward(self, tokens, input_pos, kv_cache, mask=None, pixel_values=None, export_config=None,
                called_by_generate: bool = True):
        if pixel_values is None:
            return self.decoder(tokens=tokens, input_pos=input_pos, kv_cache=kv_cache, mask=mask, input_embeds=None,
                                export_config=export_config, called_by_generate=called_by_generate)
        input_embeds = self.decoder.tok_embedding(tokens)
        image_encoded = self.image_encoder(pixel_values).flatten(2).transpose(1, 2)
        image_embeds = self.image_projection(image_encoded)
        image_embeds = image_embeds / self.config.image_projection_scale
        # PaliGemma token embedder reserves the first [num_patches] tokens for image tokens,
        # so image_embeds are merged into input_embeds by concatenating them.
        assert image_embeds.shape[1] == self.num_patches
        assert input_embeds.shape[1] >= self.num_patches
        input_embeds = torch.cat((image_embeds, input_embeds[:, self.num_patches:, :]), dim=1)
        return self.decoder(tokens=None, input_pos=input_pos, kv_cache=kv_cache, mask=mask,
                            input_embeds=input_embeds, export_config=export_config,
                            called_by_generate=called_by_generate)


def main():
    torch.manual_seed(0)
    config = PaliGemmaConfig(decoder_config=get_decoder2_config(kv_cache_max_len=16), image_size=8, patch_size=4,
                             image_token_id=127, image_projection_scale=32 ** 0.5, image_projection_use_bias=True)
    model = PaliGemma(config).eval()

    pixel_values = torch.randn(1, 3, 8, 8)
    # "<image>" x num_patches, then "<bos>describe en"
    tokens = torch.tensor([[127, 127, 127, 127, 2, 45, 67, 89]])
    kv_cache = KVCache.from_model_config(config.decoder_config)

    input_pos = torch.arange(tokens.shape[1])
    out = model(tokens, input_pos, kv_cache, pixel_values=pixel_values)
    kv_cache = out["kv_cache"]
    print("prefill last-position logit max:", round(out["logits"][0, -1].max().item(), 4))
    next_token = out["logits"][:, -1].argmax(-1, keepdim=True)
    generated = [next_token.item()]
    pos = tokens.shape[1]
    for _ in range(3):
        out = model(next_token, torch.tensor([pos]), kv_cache)
        kv_cache = out["kv_cache"]
        next_token = out["logits"][:, -1].argmax(-1, keepdim=True)
        generated.append(next_token.item())
        pos += 1
    print("generated:", generated)


if __name__ == "__main__":
    main()
