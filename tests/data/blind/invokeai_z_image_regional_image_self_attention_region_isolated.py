"""InvokeAI Z-Image regional guidance: image tokens may only attend image tokens of their own region.

Citation: invoke-ai/InvokeAI#8718 (commit d7d0512, fixes invoke-ai/InvokeAI#8715)
(invokeai/backend/z_image/extensions/regional_prompting_extension.py,
``ZImageRegionalPromptingExtension._prepare_regional_attn_mask``).

The bug: the regional attention mask for Z-Image's unified sequence ``[img_tokens, txt_tokens]``
filled the image/image block region by region (``mask @ mask.T`` for every regional prompt, plus
``bg @ bg.T`` for the area no region covers), so image patches could only see patches of their own
region. The denoiser then makes one separate picture per region ("two separate/disconnected images
instead of a single unified image").

The fix: image self-attention is unrestricted, ``regional_attention_mask[:img_seq_len,
:img_seq_len] = 1.0``; the text/image blocks stay regional.

This program ports the extension, InvokeAI's regional forward that patches
``ZImageTransformer2DModel.forward`` (regional mask on even main layers, the padding mask on odd
ones) and the Euler loop of ``ZImageDenoiseInvocation``, with the diffusers Z-Image transformer
trimmed to tiny sizes and random weights. The image is 16x16 latents (64 image tokens); a global
prompt, a left-region prompt and a right-region prompt are stand-in embeddings.
"""

import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


# ---- diffusers/models/transformers/transformer_z_image.py (trimmed) -----------------------------
ADALN_EMBED_DIM = 256
SEQ_MULTI_OF = 32


class RMSNorm(nn.RMSNorm):
    pass


class Attention(nn.Module):
    """The parts of diffusers' ``Attention`` that ZSingleStreamAttnProcessor uses."""

    def __init__(self, query_dim, cross_attention_dim=None, dim_head=64, heads=8, qk_norm=None, eps=1e-5,
                 bias=False, out_bias=False, processor=None):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=bias)
        self.to_k = nn.Linear(query_dim, inner_dim, bias=bias)
        self.to_v = nn.Linear(query_dim, inner_dim, bias=bias)
        self.norm_q = RMSNorm(dim_head, eps=eps) if qk_norm == "rms_norm" else None
        self.norm_k = RMSNorm(dim_head, eps=eps) if qk_norm == "rms_norm" else None
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim, bias=out_bias), nn.Dropout(0.0)])
        self.processor = processor

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask=attention_mask, **kwargs)


def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, backend=None,
                          parallel_config=None):
    # native backend: [B, S, H, D] in and out
    query, key, value = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                         is_causal=is_causal)
    return out.permute(0, 2, 1, 3)


class TimestepEmbedder(nn.Module):
    def __init__(self, out_size, mid_size=None, frequency_embedding_size=256):
        super().__init__()
        if mid_size is None:
            mid_size = out_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, mid_size, bias=True),
            nn.SiLU(),
            nn.Linear(mid_size, out_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(
            -math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32, device=t.device) / half
        )
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t):
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        weight_dtype = self.mlp[0].weight.dtype
        if weight_dtype.is_floating_point:
            t_freq = t_freq.to(weight_dtype)
        return self.mlp(t_freq)


class ZSingleStreamAttnProcessor:
    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        query = query.unflatten(-1, (attn.heads, -1))
        key = key.unflatten(-1, (attn.heads, -1))
        value = value.unflatten(-1, (attn.heads, -1))

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        def apply_rotary_emb(x_in, freqs_cis):
            x = torch.view_as_complex(x_in.float().reshape(*x_in.shape[:-1], -1, 2))
            freqs_cis = freqs_cis.unsqueeze(2)
            x_out = torch.view_as_real(x * freqs_cis).flatten(3)
            return x_out.type_as(x_in)

        if freqs_cis is not None:
            query = apply_rotary_emb(query, freqs_cis)
            key = apply_rotary_emb(key, freqs_cis)

        dtype = query.dtype
        query, key = query.to(dtype), key.to(dtype)

        # From [batch, seq_len] to [batch, 1, 1, seq_len] -> broadcast to [batch, heads, seq_len, seq_len]
        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :]

        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend, parallel_config=self._parallel_config,
        )

        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(dtype)

        output = attn.to_out[0](hidden_states)
        if len(attn.to_out) > 1:
            output = attn.to_out[1](output)
        return output


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ZImageTransformerBlock(nn.Module):
    def __init__(self, layer_id, dim, n_heads, n_kv_heads, norm_eps, qk_norm, modulation=True):
        super().__init__()
        self.dim = dim
        self.head_dim = dim // n_heads
        self.attention = Attention(
            query_dim=dim, cross_attention_dim=None, dim_head=dim // n_heads, heads=n_heads,
            qk_norm="rms_norm" if qk_norm else None, eps=1e-5, bias=False, out_bias=False,
            processor=ZSingleStreamAttnProcessor(),
        )
        self.feed_forward = FeedForward(dim=dim, hidden_dim=int(dim / 3 * 8))
        self.layer_id = layer_id
        self.attention_norm1 = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm1 = RMSNorm(dim, eps=norm_eps)
        self.attention_norm2 = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm2 = RMSNorm(dim, eps=norm_eps)
        self.modulation = modulation
        if modulation:
            self.adaLN_modulation = nn.Sequential(nn.Linear(min(dim, ADALN_EMBED_DIM), 4 * dim, bias=True))

    def forward(self, x, attn_mask, freqs_cis, adaln_input=None):
        if self.modulation:
            scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(adaln_input).unsqueeze(1).chunk(4, dim=2)
            gate_msa, gate_mlp = gate_msa.tanh(), gate_mlp.tanh()
            scale_msa, scale_mlp = 1.0 + scale_msa, 1.0 + scale_mlp
            attn_out = self.attention(self.attention_norm1(x) * scale_msa, attention_mask=attn_mask,
                                      freqs_cis=freqs_cis)
            x = x + gate_msa * self.attention_norm2(attn_out)
            x = x + gate_mlp * self.ffn_norm2(self.feed_forward(self.ffn_norm1(x) * scale_mlp))
        else:
            attn_out = self.attention(self.attention_norm1(x), attention_mask=attn_mask, freqs_cis=freqs_cis)
            x = x + self.attention_norm2(attn_out)
            x = x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        return x


class FinalLayer(nn.Module):
    def __init__(self, hidden_size, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(min(hidden_size, ADALN_EMBED_DIM), hidden_size))

    def forward(self, x, c):
        scale = 1.0 + self.adaLN_modulation(c)
        x = self.norm_final(x) * scale.unsqueeze(1)
        return self.linear(x)


class RopeEmbedder:
    def __init__(self, theta=256.0, axes_dims=(16, 56, 56), axes_lens=(64, 128, 128)):
        self.theta = theta
        self.axes_dims = axes_dims
        self.axes_lens = axes_lens
        self.freqs_cis = None

    @staticmethod
    def precompute_freqs_cis(dim, end, theta=256.0):
        freqs_cis = []
        for d, e in zip(dim, end):
            freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
            timestep = torch.arange(e, dtype=torch.float64)
            freqs = torch.outer(timestep, freqs).float()
            freqs_cis.append(torch.polar(torch.ones_like(freqs), freqs).to(torch.complex64))
        return freqs_cis

    def __call__(self, ids):
        if self.freqs_cis is None:
            self.freqs_cis = self.precompute_freqs_cis(self.axes_dims, self.axes_lens, theta=self.theta)
        return torch.cat([self.freqs_cis[i][ids[:, i]] for i in range(len(self.axes_dims))], dim=-1)


class ZImageTransformer2DModel(nn.Module):
    def __init__(self, all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                 n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                 rope_theta=256.0, t_scale=1000.0, axes_dims=(32, 48, 48), axes_lens=(1024, 512, 512)):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = in_channels
        self.all_patch_size = all_patch_size
        self.all_f_patch_size = all_f_patch_size
        self.dim = dim
        self.n_heads = n_heads
        self.t_scale = t_scale
        self.gradient_checkpointing = False

        all_x_embedder = {}
        all_final_layer = {}
        for patch_size, f_patch_size in zip(all_patch_size, all_f_patch_size):
            all_x_embedder[f"{patch_size}-{f_patch_size}"] = nn.Linear(
                f_patch_size * patch_size * patch_size * in_channels, dim, bias=True)
            all_final_layer[f"{patch_size}-{f_patch_size}"] = FinalLayer(
                dim, patch_size * patch_size * f_patch_size * self.out_channels)
        self.all_x_embedder = nn.ModuleDict(all_x_embedder)
        self.all_final_layer = nn.ModuleDict(all_final_layer)
        self.noise_refiner = nn.ModuleList([
            ZImageTransformerBlock(1000 + i, dim, n_heads, n_kv_heads, norm_eps, qk_norm, modulation=True)
            for i in range(n_refiner_layers)])
        self.context_refiner = nn.ModuleList([
            ZImageTransformerBlock(i, dim, n_heads, n_kv_heads, norm_eps, qk_norm, modulation=False)
            for i in range(n_refiner_layers)])
        self.t_embedder = TimestepEmbedder(min(dim, ADALN_EMBED_DIM), mid_size=1024)
        self.cap_embedder = nn.Sequential(RMSNorm(cap_feat_dim, eps=norm_eps), nn.Linear(cap_feat_dim, dim))
        self.x_pad_token = nn.Parameter(torch.randn((1, dim)))
        self.cap_pad_token = nn.Parameter(torch.randn((1, dim)))
        self.layers = nn.ModuleList([
            ZImageTransformerBlock(i, dim, n_heads, n_kv_heads, norm_eps, qk_norm) for i in range(n_layers)])
        assert dim // n_heads == sum(axes_dims)
        self.rope_embedder = RopeEmbedder(theta=rope_theta, axes_dims=axes_dims, axes_lens=axes_lens)

    @property
    def dtype(self):
        return self.x_pad_token.dtype

    def unpatchify(self, x, size, patch_size, f_patch_size):
        pH = pW = patch_size
        pF = f_patch_size
        for i in range(len(x)):
            F_, H, W = size[i]
            ori_len = (F_ // pF) * (H // pH) * (W // pW)
            x[i] = (
                x[i][:ori_len]
                .view(F_ // pF, H // pH, W // pW, pF, pH, pW, self.out_channels)
                .permute(6, 0, 3, 1, 4, 2, 5)
                .reshape(self.out_channels, F_, H, W)
            )
        return x

    @staticmethod
    def create_coordinate_grid(size, start=None, device=None):
        if start is None:
            start = (0 for _ in size)
        axes = [torch.arange(x0, x0 + span, dtype=torch.int32, device=device) for x0, span in zip(start, size)]
        grids = torch.meshgrid(axes, indexing="ij")
        return torch.stack(grids, dim=-1)

    def patchify_and_embed(self, all_image, all_cap_feats, patch_size, f_patch_size):
        pH = pW = patch_size
        pF = f_patch_size
        device = all_image[0].device
        all_image_out, all_image_size, all_image_pos_ids, all_image_pad_mask = [], [], [], []
        all_cap_pos_ids, all_cap_pad_mask, all_cap_feats_out = [], [], []
        for image, cap_feat in zip(all_image, all_cap_feats):
            cap_ori_len = len(cap_feat)
            cap_padding_len = (-cap_ori_len) % SEQ_MULTI_OF
            all_cap_pos_ids.append(self.create_coordinate_grid(
                size=(cap_ori_len + cap_padding_len, 1, 1), start=(1, 0, 0), device=device).flatten(0, 2))
            all_cap_pad_mask.append(torch.cat([
                torch.zeros((cap_ori_len,), dtype=torch.bool, device=device),
                torch.ones((cap_padding_len,), dtype=torch.bool, device=device)]))
            all_cap_feats_out.append(torch.cat([cap_feat, cap_feat[-1:].repeat(cap_padding_len, 1)], dim=0))

            C, F_, H, W = image.size()
            all_image_size.append((F_, H, W))
            F_tokens, H_tokens, W_tokens = F_ // pF, H // pH, W // pW
            image = image.view(C, F_tokens, pF, H_tokens, pH, W_tokens, pW)
            image = image.permute(1, 3, 5, 2, 4, 6, 0).reshape(F_tokens * H_tokens * W_tokens, pF * pH * pW * C)
            image_ori_len = len(image)
            image_padding_len = (-image_ori_len) % SEQ_MULTI_OF
            image_ori_pos_ids = self.create_coordinate_grid(
                size=(F_tokens, H_tokens, W_tokens), start=(cap_ori_len + cap_padding_len + 1, 0, 0),
                device=device).flatten(0, 2)
            if image_padding_len > 0:
                pad_ids = self.create_coordinate_grid(size=(1, 1, 1), start=(0, 0, 0), device=device).flatten(0, 2)
                image_padded_pos_ids = torch.cat([image_ori_pos_ids, pad_ids.repeat(image_padding_len, 1)], dim=0)
            else:
                image_padded_pos_ids = image_ori_pos_ids
            all_image_pos_ids.append(image_padded_pos_ids)
            all_image_pad_mask.append(torch.cat([
                torch.zeros((image_ori_len,), dtype=torch.bool, device=device),
                torch.ones((image_padding_len,), dtype=torch.bool, device=device)]))
            all_image_out.append(
                torch.cat([image, image[-1:].repeat(image_padding_len, 1)], dim=0) if image_padding_len > 0 else image)
        return (all_image_out, all_cap_feats_out, all_image_size, all_image_pos_ids, all_cap_pos_ids,
                all_image_pad_mask, all_cap_pad_mask)


# ---- invokeai/backend/stable_diffusion/diffusion/conditioning_data.py ---------------------------
@dataclass
class Range:
    start: int
    end: int


# ---- invokeai/backend/z_image/text_conditioning.py ----------------------------------------------
@dataclass
class ZImageTextConditioning:
    prompt_embeds: torch.Tensor
    mask: torch.Tensor | None = None


@dataclass
class ZImageRegionalTextConditioning:
    prompt_embeds: torch.Tensor
    image_masks: list
    embedding_ranges: list

    @classmethod
    def from_text_conditionings(cls, text_conditionings):
        concat_embeds, concat_ranges, image_masks = [], [], []
        cur_embed_len = 0
        for tc in text_conditionings:
            concat_embeds.append(tc.prompt_embeds)
            concat_ranges.append(Range(start=cur_embed_len, end=cur_embed_len + tc.prompt_embeds.shape[0]))
            image_masks.append(tc.mask)
            cur_embed_len += tc.prompt_embeds.shape[0]
        return cls(prompt_embeds=torch.cat(concat_embeds, dim=0), image_masks=image_masks,
                   embedding_ranges=concat_ranges)


# ---- invokeai/backend/z_image/extensions/regional_prompting_extension.py ------------------------
class ZImageRegionalPromptingExtension:
    def __init__(self, regional_text_conditioning, regional_attn_mask=None):
        self.regional_text_conditioning = regional_text_conditioning
        self.regional_attn_mask = regional_attn_mask

    @classmethod
    def from_text_conditionings(cls, text_conditionings, img_seq_len):
        regional_text_conditioning = ZImageRegionalTextConditioning.from_text_conditionings(text_conditionings)
        attn_mask = cls._prepare_regional_attn_mask(regional_text_conditioning, img_seq_len)
        return cls(regional_text_conditioning=regional_text_conditioning, regional_attn_mask=attn_mask)

    @classmethod
    def _prepare_regional_attn_mask(cls, regional_text_conditioning, img_seq_len):
        has_regional_masks = any(mask is not None for mask in regional_text_conditioning.image_masks)
        if not has_regional_masks:
            return None

        background_region_mask = None
        for image_mask in regional_text_conditioning.image_masks:
            if image_mask is not None:
                mask_flat = image_mask.view(-1)
                if background_region_mask is None:
                    background_region_mask = torch.ones_like(mask_flat)
                background_region_mask = background_region_mask * (1 - mask_flat)

        device = torch.device("cpu")  # TorchDevice.choose_torch_device()
        txt_seq_len = regional_text_conditioning.prompt_embeds.shape[0]
        total_seq_len = img_seq_len + txt_seq_len

        # Z-Image sequence: [img_tokens (0:img_seq_len), txt_tokens (img_seq_len:total_seq_len)]
        regional_attention_mask = torch.zeros((total_seq_len, total_seq_len), device=device, dtype=torch.float16)

        for image_mask, embedding_range in zip(
            regional_text_conditioning.image_masks, regional_text_conditioning.embedding_ranges, strict=True
        ):
            txt_start = img_seq_len + embedding_range.start
            txt_end = img_seq_len + embedding_range.end

            # 1. txt attends to itself
            regional_attention_mask[txt_start:txt_end, txt_start:txt_end] = 1.0

            if image_mask is not None:
                mask_flat = image_mask.view(img_seq_len)
                # 2. img attends to corresponding regional txt
                regional_attention_mask[:img_seq_len, txt_start:txt_end] = mask_flat.view(img_seq_len, 1)
                # 3. txt attends to corresponding regional img
                regional_attention_mask[txt_start:txt_end, :img_seq_len] = mask_flat.view(1, img_seq_len)
                if not FIXED:
                    # 4. img self-attention within region
                    regional_attention_mask[:img_seq_len, :img_seq_len] += mask_flat.view(
                        img_seq_len, 1) @ mask_flat.view(1, img_seq_len)
            else:
                if background_region_mask is not None:
                    regional_attention_mask[:img_seq_len, txt_start:txt_end] = background_region_mask.view(
                        img_seq_len, 1)
                    regional_attention_mask[txt_start:txt_end, :img_seq_len] = background_region_mask.view(
                        1, img_seq_len)
                else:
                    regional_attention_mask[:img_seq_len, txt_start:txt_end] = 1.0
                    regional_attention_mask[txt_start:txt_end, :img_seq_len] = 1.0

        if FIXED:
            # 4. Allow unrestricted image self-attention
            regional_attention_mask[:img_seq_len, :img_seq_len] = 1.0
        else:
            # Allow background regions to attend to themselves
            if background_region_mask is not None:
                bg_mask = background_region_mask.view(img_seq_len, 1)
                regional_attention_mask[:img_seq_len, :img_seq_len] += bg_mask @ bg_mask.T

        regional_attention_mask = regional_attention_mask > 0.5
        return regional_attention_mask

    @staticmethod
    def preprocess_regional_prompt_mask(mask, target_height, target_width, dtype, device):
        img_seq_len = target_height * target_width
        if mask is None:
            return torch.ones((1, 1, img_seq_len), dtype=dtype, device=device)
        mask = mask.to(dtype=dtype)
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(0)
        resized_mask = F.interpolate(mask, size=(target_height, target_width), mode="nearest")
        return resized_mask.flatten(start_dim=2).to(device=device)


# ---- invokeai/backend/z_image/z_image_transformer_patch.py --------------------------------------
def create_regional_forward(original_forward: Callable, regional_attn_mask: torch.Tensor, img_seq_len: int):
    def regional_forward(self, x: List[torch.Tensor], t: torch.Tensor, cap_feats: List[torch.Tensor],
                         patch_size: int = 2, f_patch_size: int = 1) -> Tuple[List[torch.Tensor], dict]:
        bsz = len(x)
        device = x[0].device
        t_scaled = t * self.t_scale
        t_emb = self.t_embedder(t_scaled)

        SEQ_MULTI_OF = 32

        (x, cap_feats, x_size, x_pos_ids, cap_pos_ids, x_inner_pad_mask, cap_inner_pad_mask) = \
            self.patchify_and_embed(x, cap_feats, patch_size, f_patch_size)

        x_item_seqlens = [len(_) for _ in x]
        assert all(_ % SEQ_MULTI_OF == 0 for _ in x_item_seqlens)
        x_max_item_seqlen = max(x_item_seqlens)

        x_cat = torch.cat(x, dim=0)
        x_cat = self.all_x_embedder[f"{patch_size}-{f_patch_size}"](x_cat)
        adaln_input = t_emb.type_as(x_cat)
        x_cat[torch.cat(x_inner_pad_mask)] = self.x_pad_token
        x_list = list(x_cat.split(x_item_seqlens, dim=0))
        x_freqs_cis = list(self.rope_embedder(torch.cat(x_pos_ids, dim=0)).split(x_item_seqlens, dim=0))

        x_padded = pad_sequence(x_list, batch_first=True, padding_value=0.0)
        x_freqs_cis_padded = pad_sequence(x_freqs_cis, batch_first=True, padding_value=0.0)
        x_attn_mask = torch.zeros((bsz, x_max_item_seqlen), dtype=torch.bool, device=device)
        for i, seq_len in enumerate(x_item_seqlens):
            x_attn_mask[i, :seq_len] = 1

        for layer in self.noise_refiner:
            x_padded = layer(x_padded, x_attn_mask, x_freqs_cis_padded, adaln_input)

        cap_item_seqlens = [len(_) for _ in cap_feats]
        assert all(_ % SEQ_MULTI_OF == 0 for _ in cap_item_seqlens)
        cap_max_item_seqlen = max(cap_item_seqlens)

        cap_cat = torch.cat(cap_feats, dim=0)
        cap_cat = self.cap_embedder(cap_cat)
        cap_cat[torch.cat(cap_inner_pad_mask)] = self.cap_pad_token
        cap_list = list(cap_cat.split(cap_item_seqlens, dim=0))
        cap_freqs_cis = list(self.rope_embedder(torch.cat(cap_pos_ids, dim=0)).split(cap_item_seqlens, dim=0))

        cap_padded = pad_sequence(cap_list, batch_first=True, padding_value=0.0)
        cap_freqs_cis_padded = pad_sequence(cap_freqs_cis, batch_first=True, padding_value=0.0)
        cap_attn_mask = torch.zeros((bsz, cap_max_item_seqlen), dtype=torch.bool, device=device)
        for i, seq_len in enumerate(cap_item_seqlens):
            cap_attn_mask[i, :seq_len] = 1

        for layer in self.context_refiner:
            cap_padded = layer(cap_padded, cap_attn_mask, cap_freqs_cis_padded)

        # Unified sequence: [img_tokens, txt_tokens]
        unified = []
        unified_freqs_cis = []
        for i in range(bsz):
            x_len = x_item_seqlens[i]
            cap_len = cap_item_seqlens[i]
            unified.append(torch.cat([x_padded[i][:x_len], cap_padded[i][:cap_len]]))
            unified_freqs_cis.append(torch.cat([x_freqs_cis_padded[i][:x_len], cap_freqs_cis_padded[i][:cap_len]]))

        unified_item_seqlens = [a + b for a, b in zip(cap_item_seqlens, x_item_seqlens, strict=False)]
        assert unified_item_seqlens == [len(_) for _ in unified]
        unified_max_item_seqlen = max(unified_item_seqlens)

        unified_padded = pad_sequence(unified, batch_first=True, padding_value=0.0)
        unified_freqs_cis_padded = pad_sequence(unified_freqs_cis, batch_first=True, padding_value=0.0)

        # --- REGIONAL ATTENTION MASK INJECTION ---
        if regional_attn_mask.shape[0] != unified_max_item_seqlen:
            padded_regional_mask = torch.zeros((unified_max_item_seqlen, unified_max_item_seqlen),
                                               dtype=regional_attn_mask.dtype, device=device)
            mask_size = min(regional_attn_mask.shape[0], unified_max_item_seqlen)
            padded_regional_mask[:mask_size, :mask_size] = regional_attn_mask[:mask_size, :mask_size]
        else:
            padded_regional_mask = regional_attn_mask.to(device)

        # True (attend) -> 0.0, False (block) -> -inf
        float_mask = torch.zeros_like(padded_regional_mask, dtype=torch.bfloat16)
        float_mask[~padded_regional_mask] = float("-inf")

        unified_attn_mask = float_mask.unsqueeze(0).unsqueeze(0).expand(bsz, 1, -1, -1)

        for layer_idx, layer in enumerate(self.layers):
            # Alternate between regional mask and full attention
            if layer_idx % 2 == 0:
                unified_padded = layer(unified_padded, unified_attn_mask, unified_freqs_cis_padded, adaln_input)
            else:
                padding_mask = torch.zeros((bsz, unified_max_item_seqlen), dtype=torch.bool, device=device)
                for i, seq_len in enumerate(unified_item_seqlens):
                    padding_mask[i, :seq_len] = 1
                unified_padded = layer(unified_padded, padding_mask, unified_freqs_cis_padded, adaln_input)

        unified_out = self.all_final_layer[f"{patch_size}-{f_patch_size}"](unified_padded, adaln_input)
        unified_list = list(unified_out.unbind(dim=0))
        x_out = self.unpatchify(unified_list, x_size, patch_size, f_patch_size)
        return x_out, {}

    return regional_forward


@contextmanager
def patch_transformer_for_regional_prompting(transformer, regional_attn_mask: Optional[torch.Tensor], img_seq_len):
    if regional_attn_mask is None:
        yield transformer
        return
    original_forward = transformer.forward
    regional_fwd = create_regional_forward(original_forward, regional_attn_mask, img_seq_len)
    transformer.forward = lambda *args, **kwargs: regional_fwd(transformer, *args, **kwargs)
    try:
        yield transformer
    finally:
        transformer.forward = original_forward


# ---- invokeai/app/invocations/z_image_denoise.py (the parts that run) ---------------------------
LATENT_SCALE_FACTOR = 8


def _calculate_shift(image_seq_len, base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5,
                     max_shift=1.15):
    m = (max_shift - base_shift) / (max_image_seq_len - base_image_seq_len)
    b = base_shift - m * base_image_seq_len
    return image_seq_len * m + b


def _get_sigmas(mu, num_steps):
    def time_shift(mu, sigma, t):
        if t <= 0:
            return 0.0
        if t >= 1:
            return 1.0
        return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)

    return [time_shift(mu, 1.0, 1.0 - i / num_steps) for i in range(num_steps + 1)]


def run_diffusion(transformer, text_conditionings_raw, width, height, steps, seed):
    device = torch.device("cpu")
    inference_dtype = torch.bfloat16

    patch_size = 2
    latent_height = height // LATENT_SCALE_FACTOR
    latent_width = width // LATENT_SCALE_FACTOR
    img_token_height = latent_height // patch_size
    img_token_width = latent_width // patch_size
    img_seq_len = img_token_height * img_token_width

    pos_text_conditionings = []
    for prompt_embeds, mask in text_conditionings_raw:
        if mask is not None:
            mask = ZImageRegionalPromptingExtension.preprocess_regional_prompt_mask(
                mask, img_token_height, img_token_width, inference_dtype, device)
        pos_text_conditionings.append(ZImageTextConditioning(prompt_embeds=prompt_embeds.to(inference_dtype),
                                                             mask=mask))

    regional_extension = ZImageRegionalPromptingExtension.from_text_conditionings(
        text_conditionings=pos_text_conditionings, img_seq_len=img_seq_len)
    pos_prompt_embeds = regional_extension.regional_text_conditioning.prompt_embeds

    mu = _calculate_shift(img_seq_len)
    sigmas = _get_sigmas(mu, steps)
    total_steps = len(sigmas) - 1

    latents = torch.randn(1, transformer.in_channels, latent_height, latent_width,
                          generator=torch.Generator().manual_seed(seed)).to(dtype=torch.float32)

    with patch_transformer_for_regional_prompting(transformer=transformer,
                                                  regional_attn_mask=regional_extension.regional_attn_mask,
                                                  img_seq_len=img_seq_len):
        for step_idx in range(total_steps):
            sigma_curr = sigmas[step_idx]
            sigma_prev = sigmas[step_idx + 1]
            model_t = 1.0 - sigma_curr
            timestep = torch.tensor([model_t], device=device, dtype=inference_dtype).expand(latents.shape[0])

            latent_model_input = latents.to(transformer.dtype)
            latent_model_input = latent_model_input.unsqueeze(2)
            latent_model_input_list = list(latent_model_input.unbind(dim=0))

            model_output = transformer(x=latent_model_input_list, t=timestep, cap_feats=[pos_prompt_embeds])
            model_out_list = model_output[0]

            noise_pred_cond = torch.stack([t.float() for t in model_out_list], dim=0)
            noise_pred_cond = noise_pred_cond.squeeze(2)
            noise_pred = -noise_pred_cond

            latents = latents.to(dtype=torch.float32)
            latents = latents + (sigma_prev - sigma_curr) * noise_pred
    return latents


def main():
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=64, n_layers=4, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=(8, 12, 12), axes_lens=(128, 32, 32),
    ).to(torch.bfloat16).eval()

    width = height = 128  # 16x16 latents, 8x8 = 64 image tokens
    # canvas masks at pixel resolution: a left and a right region, the middle columns are background
    left = torch.zeros(height, width)
    left[:, : width * 3 // 8] = 1.0
    right = torch.zeros(height, width)
    right[:, width * 5 // 8:] = 1.0

    g = torch.Generator().manual_seed(1)
    global_embeds = torch.randn(16, 32, generator=g)   # "two women"
    left_embeds = torch.randn(8, 32, generator=g)      # "a woman in a business suit"
    right_embeds = torch.randn(8, 32, generator=g)     # "a woman in a peasant dress"

    with torch.no_grad():
        latents = run_diffusion(
            transformer,
            [(global_embeds, None), (left_embeds, left), (right_embeds, right)],
            width=width, height=height, steps=4, seed=123,
        )

    print("fixed" if FIXED else "buggy", "latents", tuple(latents.shape))
    print("mean per latent column:", [round(v, 4) for v in latents[0].mean(dim=(0, 1)).tolist()])
    print("checksum:", round(latents.abs().sum().item(), 4))


if __name__ == "__main__":
    main()
