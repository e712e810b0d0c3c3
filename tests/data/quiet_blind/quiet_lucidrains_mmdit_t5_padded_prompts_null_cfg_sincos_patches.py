"""Correct program: lucidrains' MMDiT (the SD3 joint-attention block) driven as a text-to-image
rectified-flow model, with T5 prompts padded to a fixed length and classifier-free guidance
whose null prompt rides in the same batch. Tiny sizes, CPU, float64.

Ported from lucidrains/mmdit @cca1e6c3d66aab7ae7c4bc03564b6f2e2fd779d2, mmdit/mmdit_pytorch.py
(JointAttention, MMDiTBlock, MMDiT with register tokens, num_residual_streams = 1), and the
pieces it imports: x_transformers/attend.py @4c3e62acff0cc1aeae2b4c2b60b5ae7b651e7d55 (Attend:
the einsum path, and `flash = True`, the SDPA path), x_transformers RMSNorm / FeedForward,
hyper_connections.Residual. einops' pack / unpack / Rearrange are written out with torch.
Around it, as SD3 (diffusers StableDiffusion3Pipeline / SD3Transformer2DModel) does it:
a PatchEmbed with a fixed 2-D sin-cos table added to the image patches, a T5 encoder over
`padding="max_length"` prompts, `torch.cat([latents] * 2)` with `[negative ; positive]`
prompts, `noise_pred.chunk(2)`, and FlowMatchEulerDiscreteScheduler steps (shift 3).

Masking, as in the project:
  * T5 prompts are right-padded to max_sequence_length; the tokenizer's attention_mask goes to
    the T5 encoder and, as a bool `text_mask`, to MMDiT;
  * JointAttention packs [text ; image] qkv along the sequence and packs the masks the same way,
    the image part all ones (`masks = (text_mask, None)`);
  * Attend turns the (b, n) key mask into (b, 1, 1, n): `sim.masked_fill(~mask, -finfo.max)`
    on the einsum path, `mask.expand(b, h, i, j)` as SDPA's bool attn_mask on the flash path;
  * the null prompt "" is its EOS alone, so the unconditional rows keep one text key.

Checked: every prompt (and the null prompt) run alone, its T5 input cut to its real tokens and
MMDiT run with no text mask, gives the same velocity and the same real-text outputs as its row
of the padded CFG batch, for both Attend paths; and a whole guided sampling run over the batch
matches each prompt sampled on its own.
"""
import math
import sys
from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import Module, ModuleList
from transformers import T5Config, T5EncoderModel

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def exists(v):
    return v is not None


def default(v, d):
    return v if exists(v) else d


# ------------------------------------------------------------------ einops, written out

def pack_seq(tensors, dim):
    """einops.pack(tensors, '... * ...') along one axis: returns the packed tensor and lengths."""
    return torch.cat(tensors, dim=dim), [t.shape[dim] for t in tensors]


def unpack_seq(t, packed_shape, dim):
    return list(t.split(packed_shape, dim=dim))


class SplitHeads(Module):
    """Rearrange('b n (qkv h d) -> qkv b h n d', h = heads, qkv = 3)"""

    def __init__(self, heads):
        super().__init__()
        self.heads = heads

    def forward(self, t):
        b, n, _ = t.shape
        return t.reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)


class MergeHeads(Module):
    """Rearrange('b h n d -> b n (h d)')"""

    def forward(self, t):
        b, h, n, d = t.shape
        return t.transpose(1, 2).reshape(b, n, h * d)


# ------------------------------------------------------------------ x_transformers pieces

class Attend(Module):
    def __init__(self, dropout=0., flash=False):
        super().__init__()
        self.flash = flash
        self.dropout = dropout
        self.attn_dropout = nn.Dropout(dropout)
        self.attn_fn = lambda t: F.softmax(t, dim=-1, dtype=torch.float32 if t.dtype != torch.float64 else t.dtype)

    def flash_attn(self, q, k, v, mask=None):
        batch, heads, q_len, _ = q.shape
        k_len = k.shape[-2]

        # expand key padding mask

        if exists(mask):
            assert mask.ndim == 4
            mask = mask.expand(batch, heads, q_len, k_len)

        # protect against an entire row being masked out

        row_is_entirely_masked = None

        if exists(mask):
            row_is_entirely_masked = ~mask.any(dim=-1)

        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.,
            is_causal=False,
        )

        if exists(row_is_entirely_masked) and row_is_entirely_masked.any():
            out = out.masked_fill(row_is_entirely_masked[..., None], 0.)

        return out, None

    def forward(self, q, k, v, mask=None):
        scale = q.shape[-1] ** -0.5

        # handle key padding mask

        if exists(mask) and mask.ndim == 2:
            mask = mask[:, None, None, :]

        if self.flash:
            return self.flash_attn(q, k, v, mask=mask)

        sim = torch.einsum('b h i d, b h j d -> b h i j', q, k)
        sim = sim * scale

        dtype = sim.dtype
        mask_value = -torch.finfo(sim.dtype).max

        if exists(mask):
            sim = sim.masked_fill(~mask, mask_value)

        row_is_entirely_masked = None

        if exists(mask):
            row_is_entirely_masked = ~mask.any(dim=-1)

        attn = self.attn_fn(sim)
        attn = attn.type(dtype)
        attn = self.attn_dropout(attn)

        out = torch.einsum('b h i j, b h j d -> b h i d', attn, v)

        if exists(row_is_entirely_masked) and row_is_entirely_masked.any():
            out = out.masked_fill(row_is_entirely_masked[..., None], 0.)

        return out, attn


class RMSNorm(Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.g


class FeedForward(Module):
    def __init__(self, dim, mult=4, dropout=0.):
        super().__init__()
        inner_dim = int(dim * mult)
        self.ff = nn.Sequential(
            nn.Linear(dim, inner_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(inner_dim, dim),
        )

    def forward(self, x):
        return self.ff(x)


class Residual(Module):
    """hyper_connections.Residual: num_residual_streams == 1 is a plain residual."""

    def __init__(self, num_residual_streams=1, *, dim=None):
        super().__init__()

    def forward(self, residuals):
        def add_residual_fn(branch_out):
            return branch_out + residuals

        return residuals, add_residual_fn


# ------------------------------------------------------------------ mmdit/mmdit_pytorch.py

class MultiHeadRMSNorm(Module):
    def __init__(self, dim, heads=1):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(heads, 1, dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.gamma * self.scale


class JointAttention(Module):
    def __init__(self, *, dim_inputs: Tuple[int, ...], dim_head=64, heads=8, qk_rmsnorm=False, flash=False):
        super().__init__()
        dim_inner = dim_head * heads

        num_inputs = len(dim_inputs)
        self.num_inputs = num_inputs

        self.to_qkv = ModuleList([nn.Linear(dim_input, dim_inner * 3, bias=False) for dim_input in dim_inputs])

        self.split_heads = SplitHeads(heads)
        self.attend = Attend(flash=flash)
        self.merge_heads = MergeHeads()

        self.to_out = ModuleList([nn.Linear(dim_inner, dim_input, bias=False) for dim_input in dim_inputs])

        self.qk_rmsnorm = qk_rmsnorm
        self.q_rmsnorms = (None,) * num_inputs
        self.k_rmsnorms = (None,) * num_inputs

        if qk_rmsnorm:
            self.q_rmsnorms = ModuleList([MultiHeadRMSNorm(dim_head, heads=heads) for _ in range(num_inputs)])
            self.k_rmsnorms = ModuleList([MultiHeadRMSNorm(dim_head, heads=heads) for _ in range(num_inputs)])

        self.register_buffer('dummy', torch.tensor(0), persistent=False)

    def forward(self, inputs: Tuple[Tensor, ...], masks: Optional[Tuple[Optional[Tensor], ...]] = None):
        device = self.dummy.device

        assert len(inputs) == self.num_inputs

        masks = default(masks, (None,) * self.num_inputs)

        # project each modality separately for qkv
        # also handle masks, assume None means attend to all tokens

        all_qkvs = []
        all_masks = []

        for x, mask, to_qkv, q_rmsnorm, k_rmsnorm in zip(inputs, masks, self.to_qkv, self.q_rmsnorms, self.k_rmsnorms):
            qkv = to_qkv(x)
            qkv = self.split_heads(qkv)

            if self.qk_rmsnorm:
                q, k, v = qkv
                q = q_rmsnorm(q)
                k = k_rmsnorm(k)
                qkv = torch.stack((q, k, v))

            all_qkvs.append(qkv)

            if not exists(mask):
                mask = torch.ones(x.shape[:2], device=device, dtype=torch.bool)

            all_masks.append(mask)

        # combine all qkv and masks

        all_qkvs, packed_shape = pack_seq(all_qkvs, dim=3)   # 'qkv b h * d'
        all_masks, _ = pack_seq(all_masks, dim=1)            # 'b *'

        q, k, v = all_qkvs

        outs, *_ = self.attend(q, k, v, mask=all_masks)

        # merge heads and then separate by modality for combine heads projection

        outs = self.merge_heads(outs)
        outs = unpack_seq(outs, packed_shape, dim=1)         # 'b * d'

        all_outs = []

        for out, to_out in zip(outs, self.to_out):
            out = to_out(out)
            all_outs.append(out)

        return tuple(all_outs)


class MMDiTBlock(Module):
    def __init__(self, *, dim_text, dim_image, dim_cond=None, dim_head=64, heads=8, qk_rmsnorm=False,
                 flash_attn=False, num_residual_streams=1, ff_kwargs: dict = dict()):
        super().__init__()

        residual_klass = Residual

        self.text_attn_residual_fn = residual_klass(num_residual_streams, dim=dim_text)
        self.text_ff_residual_fn = residual_klass(num_residual_streams, dim=dim_text)

        self.image_attn_residual_fn = residual_klass(num_residual_streams, dim=dim_image)
        self.image_ff_residual_fn = residual_klass(num_residual_streams, dim=dim_image)

        has_cond = exists(dim_cond)
        self.has_cond = has_cond

        if has_cond:
            dim_gammas = (*((dim_text,) * 4), *((dim_image,) * 4))
            dim_betas = (*((dim_text,) * 2), *((dim_image,) * 2))

            self.cond_dims = (*dim_gammas, *dim_betas)

            to_cond_linear = nn.Linear(dim_cond, sum(self.cond_dims))

            self.to_cond = nn.Sequential(
                nn.Unflatten(1, (1, dim_cond)),   # Rearrange('b d -> b 1 d')
                nn.SiLU(),
                to_cond_linear,
            )

            # the project zero-inits this layer (gammas 1, betas 0); a trained model has moved away
            # from that, so start from small random weights around the same point
            nn.init.normal_(to_cond_linear.weight, std=0.02)
            nn.init.normal_(to_cond_linear.bias, std=0.02)
            with torch.no_grad():
                to_cond_linear.bias[:sum(dim_gammas)] += 1.

        self.text_attn_layernorm = nn.LayerNorm(dim_text, elementwise_affine=not has_cond)
        self.image_attn_layernorm = nn.LayerNorm(dim_image, elementwise_affine=not has_cond)

        self.text_ff_layernorm = nn.LayerNorm(dim_text, elementwise_affine=not has_cond)
        self.image_ff_layernorm = nn.LayerNorm(dim_image, elementwise_affine=not has_cond)

        self.joint_attn = JointAttention(
            dim_inputs=(dim_text, dim_image),
            dim_head=dim_head,
            heads=heads,
            qk_rmsnorm=qk_rmsnorm,
            flash=flash_attn,
        )

        self.text_ff = FeedForward(dim_text, **ff_kwargs)
        self.image_ff = FeedForward(dim_image, **ff_kwargs)

    def forward(self, *, text_tokens, image_tokens, text_mask=None, time_cond=None, skip_feedforward_text_tokens=True):
        assert not (exists(time_cond) ^ self.has_cond)

        if self.has_cond:
            (
                text_pre_attn_gamma, text_post_attn_gamma, text_pre_ff_gamma, text_post_ff_gamma,
                image_pre_attn_gamma, image_post_attn_gamma, image_pre_ff_gamma, image_post_ff_gamma,
                text_pre_attn_beta, text_pre_ff_beta, image_pre_attn_beta, image_pre_ff_beta,
            ) = self.to_cond(time_cond).split(self.cond_dims, dim=-1)

        text_tokens, add_text_residual = self.text_attn_residual_fn(text_tokens)
        image_tokens, add_image_residual = self.image_attn_residual_fn(image_tokens)

        text_tokens = self.text_attn_layernorm(text_tokens)
        image_tokens = self.image_attn_layernorm(image_tokens)

        if self.has_cond:
            text_tokens = text_tokens * text_pre_attn_gamma + text_pre_attn_beta
            image_tokens = image_tokens * image_pre_attn_gamma + image_pre_attn_beta

        text_tokens, image_tokens = self.joint_attn(
            inputs=(text_tokens, image_tokens),
            masks=(text_mask, None),
        )

        if self.has_cond:
            text_tokens = text_tokens * text_post_attn_gamma
            image_tokens = image_tokens * image_post_attn_gamma

        text_tokens = add_text_residual(text_tokens)
        image_tokens = add_image_residual(image_tokens)

        if not skip_feedforward_text_tokens:
            text_tokens, add_text_residual = self.text_ff_residual_fn(text_tokens)
            text_tokens = self.text_ff_layernorm(text_tokens)

            if self.has_cond:
                text_tokens = text_tokens * text_pre_ff_gamma + text_pre_ff_beta

        image_tokens, add_image_residual = self.image_ff_residual_fn(image_tokens)
        image_tokens = self.image_ff_layernorm(image_tokens)

        if self.has_cond:
            image_tokens = image_tokens * image_pre_ff_gamma + image_pre_ff_beta

        image_tokens = self.image_ff(image_tokens)

        if self.has_cond:
            image_tokens = image_tokens * image_post_ff_gamma

        image_tokens = add_image_residual(image_tokens)

        if skip_feedforward_text_tokens:
            return text_tokens, image_tokens

        text_tokens = self.text_ff(text_tokens)

        if self.has_cond:
            text_tokens = text_tokens * text_post_ff_gamma

        text_tokens = add_text_residual(text_tokens)

        return text_tokens, image_tokens


class MMDiT(Module):
    def __init__(self, *, depth, dim_image, num_register_tokens=0, final_norm=True, num_residual_streams=1, **block_kwargs):
        super().__init__()

        self.has_register_tokens = num_register_tokens > 0
        self.register_tokens = nn.Parameter(torch.zeros(num_register_tokens, dim_image))
        nn.init.normal_(self.register_tokens, std=0.02)

        self.blocks = ModuleList([
            MMDiTBlock(dim_image=dim_image, num_residual_streams=num_residual_streams, **block_kwargs)
            for _ in range(depth)
        ])

        self.norm = RMSNorm(dim_image) if final_norm else nn.Identity()

    def forward(self, *, text_tokens, image_tokens, text_mask=None, time_cond=None, should_skip_last_feedforward=True):
        if self.has_register_tokens:
            register_tokens = self.register_tokens.expand(image_tokens.shape[0], -1, -1)
            image_tokens, packed_shape = pack_seq([register_tokens, image_tokens], dim=1)

        for ind, block in enumerate(self.blocks):
            is_last = ind == (len(self.blocks) - 1)

            text_tokens, image_tokens = block(
                time_cond=time_cond,
                text_tokens=text_tokens,
                image_tokens=image_tokens,
                text_mask=text_mask,
                skip_feedforward_text_tokens=is_last and should_skip_last_feedforward,
            )

        if self.has_register_tokens:
            _, image_tokens = unpack_seq(image_tokens, packed_shape, dim=1)

        image_tokens = self.norm(image_tokens)

        return text_tokens, image_tokens


# ------------------------------------------------------------------ SD3-style wrapper

def get_2d_sincos_pos_embed(embed_dim, grid_size, base_size=None, interpolation_scale=1.0):
    """diffusers.models.embeddings.get_2d_sincos_pos_embed (numpy version), as SD3's PatchEmbed uses it."""
    base_size = default(base_size, grid_size)
    grid_h = np.arange(grid_size, dtype=np.float32) / (grid_size / base_size) / interpolation_scale
    grid_w = np.arange(grid_size, dtype=np.float32) / (grid_size / base_size) / interpolation_scale
    grid = np.meshgrid(grid_w, grid_h)  # here w goes first
    grid = np.stack(grid, axis=0).reshape([2, 1, grid_size, grid_size])

    def get_1d(embed_dim, pos):
        omega = np.arange(embed_dim // 2, dtype=np.float64)
        omega /= embed_dim / 2.0
        omega = 1.0 / 10000 ** omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    emb_h = get_1d(embed_dim // 2, grid[0])
    emb_w = get_1d(embed_dim // 2, grid[1])
    return np.concatenate([emb_h, emb_w], axis=1)


def get_timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0, max_period=10000):
    half_dim = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(half_dim, dtype=torch.float64) / (half_dim - downscale_freq_shift)
    emb = timesteps[:, None].to(torch.float64) * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)
    return emb


class TextToImageMMDiT(Module):
    def __init__(self, *, in_channels=4, patch_size=2, sample_size=8, dim_text=32, dim_image=48, dim_cond=32,
                 depth=2, heads=2, dim_head=16, num_register_tokens=2, flash_attn=False):
        super().__init__()
        self.in_channels = in_channels
        self.patch_size = patch_size
        self.grid = sample_size // patch_size

        self.proj = nn.Conv2d(in_channels, dim_image, kernel_size=patch_size, stride=patch_size)
        pos_embed = get_2d_sincos_pos_embed(dim_image, self.grid)
        self.register_buffer("pos_embed", torch.from_numpy(pos_embed).to(torch.get_default_dtype())[None], persistent=False)

        self.time_proj_dim = 64
        self.time_mlp = nn.Sequential(nn.Linear(self.time_proj_dim, dim_cond), nn.SiLU(), nn.Linear(dim_cond, dim_cond))

        self.mmdit = MMDiT(
            depth=depth, dim_image=dim_image, num_register_tokens=num_register_tokens,
            dim_text=dim_text, dim_cond=dim_cond, heads=heads, dim_head=dim_head,
            qk_rmsnorm=True, flash_attn=flash_attn,
        )

        self.proj_out = nn.Linear(dim_image, patch_size * patch_size * in_channels)

    def patchify(self, latent):
        x = self.proj(latent)                       # b d h w
        x = x.flatten(2).transpose(1, 2)            # b (h w) d
        return x + self.pos_embed

    def unpatchify(self, x):
        b, p, c, g = x.shape[0], self.patch_size, self.in_channels, self.grid
        x = x.reshape(b, g, g, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(b, c, g * p, g * p)

    def forward(self, hidden_states, encoder_hidden_states, timestep, encoder_attention_mask=None):
        image_tokens = self.patchify(hidden_states)
        time_cond = self.time_mlp(get_timestep_embedding(timestep, self.time_proj_dim))
        text_mask = encoder_attention_mask.bool() if exists(encoder_attention_mask) else None

        text_out, image_out = self.mmdit(
            text_tokens=encoder_hidden_states,
            image_tokens=image_tokens,
            text_mask=text_mask,
            time_cond=time_cond,
        )
        return self.unpatchify(self.proj_out(image_out)), text_out


# ------------------------------------------------------------------ pipeline

PAD_ID, EOS_ID = 0, 1
MAX_SEQUENCE_LENGTH = 10


def tokenize(prompts_ids, max_length=MAX_SEQUENCE_LENGTH):
    """T5TokenizerFast(padding="max_length", max_length=..., truncation=True): ids + </s>, right-padded."""
    input_ids, attention_mask = [], []
    for ids in prompts_ids:
        ids = list(ids)[: max_length - 1] + [EOS_ID]
        input_ids.append(ids + [PAD_ID] * (max_length - len(ids)))
        attention_mask.append([1] * len(ids) + [0] * (max_length - len(ids)))
    return torch.tensor(input_ids), torch.tensor(attention_mask)


@torch.no_grad()
def encode_prompt(text_encoder, prompts_ids, max_length=MAX_SEQUENCE_LENGTH):
    input_ids, attention_mask = tokenize(prompts_ids, max_length)
    prompt_embeds = text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return prompt_embeds, attention_mask


def flow_match_sigmas(num_inference_steps, shift=3.0):
    """FlowMatchEulerDiscreteScheduler.set_timesteps (shift 3.0, as SD3), the final sigma 0 appended."""
    sigmas = torch.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps)
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return torch.cat([sigmas, torch.zeros(1)])


@torch.no_grad()
def generate(transformer, text_encoder, prompts_ids, latents, guidance_scale=4.5, num_inference_steps=4):
    batch = len(prompts_ids)
    prompt_embeds, prompt_mask = encode_prompt(text_encoder, prompts_ids)
    negative_embeds, negative_mask = encode_prompt(text_encoder, [[]] * batch)   # "" -> </s> alone

    prompt_embeds = torch.cat([negative_embeds, prompt_embeds], dim=0)
    prompt_mask = torch.cat([negative_mask, prompt_mask], dim=0)

    sigmas = flow_match_sigmas(num_inference_steps)
    for i in range(num_inference_steps):
        latent_model_input = torch.cat([latents] * 2)
        timestep = (sigmas[i] * 1000).expand(latent_model_input.shape[0])
        noise_pred, _ = transformer(latent_model_input, prompt_embeds, timestep, encoder_attention_mask=prompt_mask)
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
        latents = latents + (sigmas[i + 1] - sigmas[i]) * noise_pred
    return latents


# ------------------------------------------------------------------ reference: one prompt, unpadded

@torch.no_grad()
def encode_one_unpadded(text_encoder, ids):
    input_ids = torch.tensor([list(ids) + [EOS_ID]])
    return text_encoder(input_ids=input_ids).last_hidden_state


@torch.no_grad()
def generate_one(transformer, text_encoder, ids, latent, guidance_scale=4.5, num_inference_steps=4):
    cond = encode_one_unpadded(text_encoder, ids)
    uncond = encode_one_unpadded(text_encoder, [])
    sigmas = flow_match_sigmas(num_inference_steps)
    for i in range(num_inference_steps):
        timestep = (sigmas[i] * 1000).expand(1)
        v_uncond, _ = transformer(latent, uncond, timestep)
        v_text, _ = transformer(latent, cond, timestep)
        v = v_uncond + guidance_scale * (v_text - v_uncond)
        latent = latent + (sigmas[i + 1] - sigmas[i]) * v
    return latent


def main():
    t5_config = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, feed_forward_proj="gated-gelu", pad_token_id=PAD_ID, eos_token_id=EOS_ID,
    )
    text_encoder = T5EncoderModel(t5_config).eval()

    prompts_ids = [
        [12, 7, 33, 5, 19, 41, 8],     # 7 words + </s> -> 8 of 10
        [22, 9],                       # 3 of 10
        [3, 17, 28, 44, 50],           # 6 of 10
    ]
    batch = len(prompts_ids)
    latents = torch.randn(batch, 4, 8, 8)

    for flash_attn in (False, True):
        torch.manual_seed(1)
        transformer = TextToImageMMDiT(flash_attn=flash_attn).eval()

        # one denoiser call over the CFG batch [null ; prompts], against each row run alone
        prompt_embeds, prompt_mask = encode_prompt(text_encoder, prompts_ids)
        negative_embeds, negative_mask = encode_prompt(text_encoder, [[]] * batch)
        embeds = torch.cat([negative_embeds, prompt_embeds])
        mask = torch.cat([negative_mask, prompt_mask])
        x = torch.cat([latents] * 2)
        timestep = torch.full((2 * batch,), 750.0)
        with torch.no_grad():
            v, text_out = transformer(x, embeds, timestep, encoder_attention_mask=mask)

        for row, ids in enumerate([[]] * batch + prompts_ids):
            ref_embeds = encode_one_unpadded(text_encoder, ids)
            n = ref_embeds.shape[1]
            assert int(mask[row].sum()) == n
            assert torch.allclose(embeds[row, :n], ref_embeds[0], atol=1e-10)
            with torch.no_grad():
                v_ref, text_ref = transformer(x[row:row + 1], ref_embeds, timestep[row:row + 1])
            err_v = (v[row] - v_ref[0]).abs().max().item()
            err_t = (text_out[row, :n] - text_ref[0]).abs().max().item()
            assert err_v < 1e-10 and err_t < 1e-10, (flash_attn, row, err_v, err_t)

        # a guided sampling run over the batch, against each prompt sampled alone
        images = generate(transformer, text_encoder, prompts_ids, latents)
        for b, ids in enumerate(prompts_ids):
            ref = generate_one(transformer, text_encoder, ids, latents[b:b + 1])
            err = (images[b] - ref[0]).abs().max().item()
            assert err < 1e-9, (flash_attn, b, err)
        print(f"flash_attn={flash_attn}: batched CFG matches per-prompt runs "
              f"(velocity, real text tokens, {images.shape[0]} sampled latents)")

    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
