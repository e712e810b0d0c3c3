# huggingface/finetrainers#244 (fixes huggingface/finetrainers#233), "Fix LTX frame rate for rope
# interpolation scale calculation".
#
# finetrainers' LTX-Video LoRA trainer (finetrainers/models/ltx_video/lora.py, forward_pass) called
# diffusers' LTXVideoTransformer3DModel with a hard-coded `rope_interpolation_scale = [1 / 25, 32, 32]`.
# The transformer's LTXVideoRotaryPosEmbed multiplies each latent frame index by
# rope_interpolation_scale[0] * patch_size_t / base_num_frames, and the LTXPipeline used at inference
# passes vae_temporal_compression_ratio / frame_rate = 8 / 25 there (one latent frame = 8 video frames).
# So in training the temporal rotary positions of the video patches were packed 8x closer than the
# ones the model sees at sampling time: the self-attention between patches of different latent frames
# was trained at the wrong relative positions. The fix computes latent_frame_rate = frame_rate / 8 and
# passes [1 / latent_frame_rate, 32, 32], as the pipeline does.
#
# Ported (trimmed, tiny sizes, random weights, CPU) from diffusers' transformer_ltx.py
# (LTXVideoRotaryPosEmbed, apply_rotary_emb, LTXVideoAttentionProcessor2_0, LTXVideoTransformerBlock,
# LTXVideoTransformer3DModel.forward) and finetrainers' ltx_video/lora.py (_pack_latents, forward_pass)
# plus the flow-matching loss of its trainer.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class LTXVideoRotaryPosEmbed(nn.Module):
    def __init__(self, dim, base_num_frames=20, base_height=2048, base_width=2048, patch_size=1,
                 patch_size_t=1, theta=10000.0):
        super().__init__()
        self.dim = dim
        self.base_num_frames = base_num_frames
        self.base_height = base_height
        self.base_width = base_width
        self.patch_size = patch_size
        self.patch_size_t = patch_size_t
        self.theta = theta

    def forward(self, hidden_states, num_frames, height, width, rope_interpolation_scale=None):
        batch_size = hidden_states.size(0)

        # Always compute rope in fp32
        grid_h = torch.arange(height, dtype=torch.float32, device=hidden_states.device)
        grid_w = torch.arange(width, dtype=torch.float32, device=hidden_states.device)
        grid_f = torch.arange(num_frames, dtype=torch.float32, device=hidden_states.device)
        grid = torch.meshgrid(grid_f, grid_h, grid_w, indexing="ij")
        grid = torch.stack(grid, dim=0)
        grid = grid.unsqueeze(0).repeat(batch_size, 1, 1, 1, 1)

        if rope_interpolation_scale is not None:
            grid[:, 0:1] = grid[:, 0:1] * rope_interpolation_scale[0] * self.patch_size_t / self.base_num_frames
            grid[:, 1:2] = grid[:, 1:2] * rope_interpolation_scale[1] * self.patch_size / self.base_height
            grid[:, 2:3] = grid[:, 2:3] * rope_interpolation_scale[2] * self.patch_size / self.base_width

        grid = grid.flatten(2, 4).transpose(1, 2)

        start = 1.0
        end = self.theta
        freqs = self.theta ** torch.linspace(
            math.log(start, self.theta),
            math.log(end, self.theta),
            self.dim // 6,
            device=hidden_states.device,
            dtype=torch.float32,
        )
        freqs = freqs * math.pi / 2.0
        freqs = freqs * (grid.unsqueeze(-1) * 2 - 1)
        freqs = freqs.transpose(-1, -2).flatten(2)

        cos_freqs = freqs.cos().repeat_interleave(2, dim=-1)
        sin_freqs = freqs.sin().repeat_interleave(2, dim=-1)

        if self.dim % 6 != 0:
            cos_padding = torch.ones_like(cos_freqs[:, :, : self.dim % 6])
            sin_padding = torch.zeros_like(cos_freqs[:, :, : self.dim % 6])
            cos_freqs = torch.cat([cos_padding, cos_freqs], dim=-1)
            sin_freqs = torch.cat([sin_padding, sin_freqs], dim=-1)

        return cos_freqs, sin_freqs


def apply_rotary_emb(x, freqs):
    cos, sin = freqs
    x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)  # [B, S, H, D // 2]
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    out = (x.float() * cos + x_rotated.float() * sin).to(x.dtype)
    return out


class Attention(nn.Module):
    def __init__(self, query_dim, heads, dim_head, cross_attention_dim=None):
        super().__init__()
        inner_dim = heads * dim_head
        kv_dim = cross_attention_dim or query_dim
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim)
        self.to_k = nn.Linear(kv_dim, inner_dim)
        self.to_v = nn.Linear(kv_dim, inner_dim)
        self.norm_q = nn.RMSNorm(inner_dim, eps=1e-5)
        self.norm_k = nn.RMSNorm(inner_dim, eps=1e-5)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim), nn.Dropout(0.0)])

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        # LTXVideoAttentionProcessor2_0.__call__
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        if attention_mask is not None:
            attention_mask = attention_mask.view(batch_size, 1, -1, attention_mask.shape[-1])
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states

        query = self.to_q(hidden_states)
        key = self.to_k(encoder_hidden_states)
        value = self.to_v(encoder_hidden_states)

        query = self.norm_q(query)
        key = self.norm_k(key)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb)
            key = apply_rotary_emb(key, image_rotary_emb)

        query = query.unflatten(2, (self.heads, -1)).transpose(1, 2)
        key = key.unflatten(2, (self.heads, -1)).transpose(1, 2)
        value = value.unflatten(2, (self.heads, -1)).transpose(1, 2)

        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        hidden_states = self.to_out[0](hidden_states)
        hidden_states = self.to_out[1](hidden_states)
        return hidden_states


class LTXVideoTransformerBlock(nn.Module):
    def __init__(self, dim, num_attention_heads, attention_head_dim, cross_attention_dim):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False)
        self.attn1 = Attention(dim, num_attention_heads, attention_head_dim)
        self.norm2 = nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False)
        self.attn2 = Attention(dim, num_attention_heads, attention_head_dim, cross_attention_dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.scale_shift_table = nn.Parameter(torch.randn(6, dim) / dim**0.5)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, encoder_attention_mask=None):
        batch_size = hidden_states.size(0)
        norm_hidden_states = self.norm1(hidden_states)

        num_ada_params = self.scale_shift_table.shape[0]
        ada_values = self.scale_shift_table[None, None] + temb.reshape(batch_size, temb.size(1), num_ada_params, -1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada_values.unbind(dim=2)
        norm_hidden_states = norm_hidden_states * (1 + scale_msa) + shift_msa

        attn_hidden_states = self.attn1(
            hidden_states=norm_hidden_states,
            encoder_hidden_states=None,
            image_rotary_emb=image_rotary_emb,
        )
        hidden_states = hidden_states + attn_hidden_states * gate_msa

        attn_hidden_states = self.attn2(
            hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            image_rotary_emb=None,
            attention_mask=encoder_attention_mask,
        )
        hidden_states = hidden_states + attn_hidden_states
        norm_hidden_states = self.norm2(hidden_states) * (1 + scale_mlp) + shift_mlp

        ff_output = self.ff(norm_hidden_states)
        hidden_states = hidden_states + ff_output * gate_mlp
        return hidden_states


class LTXVideoTransformer3DModel(nn.Module):
    def __init__(self, in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2,
                 attention_head_dim=24, cross_attention_dim=48, num_layers=2, caption_channels=32):
        super().__init__()
        inner_dim = num_attention_heads * attention_head_dim
        self.proj_in = nn.Linear(in_channels, inner_dim)
        self.scale_shift_table = nn.Parameter(torch.randn(2, inner_dim) / inner_dim**0.5)
        # AdaLayerNormSingle, trimmed: sinusoidal timestep -> 6 * inner_dim modulation
        self.time_proj_dim = 32
        self.time_embed = nn.Sequential(nn.Linear(self.time_proj_dim, inner_dim), nn.SiLU(), nn.Linear(inner_dim, 6 * inner_dim))
        self.time_embedded = nn.Linear(self.time_proj_dim, inner_dim)
        self.caption_projection = nn.Sequential(
            nn.Linear(caption_channels, inner_dim), nn.GELU(approximate="tanh"), nn.Linear(inner_dim, inner_dim)
        )
        self.rope = LTXVideoRotaryPosEmbed(
            dim=inner_dim, base_num_frames=20, base_height=2048, base_width=2048,
            patch_size=patch_size, patch_size_t=patch_size_t, theta=10000.0,
        )
        self.transformer_blocks = nn.ModuleList(
            [LTXVideoTransformerBlock(inner_dim, num_attention_heads, attention_head_dim, cross_attention_dim)
             for _ in range(num_layers)]
        )
        self.norm_out = nn.LayerNorm(inner_dim, eps=1e-6, elementwise_affine=False)
        self.proj_out = nn.Linear(inner_dim, out_channels)

    def _timestep_proj(self, timestep):
        half = self.time_proj_dim // 2
        exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32) / half
        args = timestep.float()[:, None] * torch.exp(exponent)[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, hidden_states, encoder_hidden_states, timestep, encoder_attention_mask, num_frames, height,
                width, rope_interpolation_scale=None, return_dict=True):
        image_rotary_emb = self.rope(hidden_states, num_frames, height, width, rope_interpolation_scale)

        # convert encoder_attention_mask to a bias the same way we do for attention_mask
        if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:
            encoder_attention_mask = (1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0
            encoder_attention_mask = encoder_attention_mask.unsqueeze(1)

        batch_size = hidden_states.size(0)
        hidden_states = self.proj_in(hidden_states)

        t_proj = self._timestep_proj(timestep.flatten())
        temb = self.time_embed(t_proj)
        embedded_timestep = self.time_embedded(t_proj)
        temb = temb.view(batch_size, -1, temb.size(-1))
        embedded_timestep = embedded_timestep.view(batch_size, -1, embedded_timestep.size(-1))

        encoder_hidden_states = self.caption_projection(encoder_hidden_states)
        encoder_hidden_states = encoder_hidden_states.view(batch_size, -1, hidden_states.size(-1))

        for block in self.transformer_blocks:
            hidden_states = block(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                temb=temb,
                image_rotary_emb=image_rotary_emb,
                encoder_attention_mask=encoder_attention_mask,
            )

        scale_shift_values = self.scale_shift_table[None, None] + embedded_timestep[:, :, None]
        shift, scale = scale_shift_values[:, :, 0], scale_shift_values[:, :, 1]
        hidden_states = self.norm_out(hidden_states)
        hidden_states = hidden_states * (1 + scale) + shift
        output = self.proj_out(hidden_states)
        return (output,)


# ---- finetrainers/models/ltx_video/lora.py ----

def _pack_latents(latents, patch_size=1, patch_size_t=1):
    batch_size, num_channels, num_frames, height, width = latents.shape
    post_patch_num_frames = num_frames // patch_size_t
    post_patch_height = height // patch_size
    post_patch_width = width // patch_size
    latents = latents.reshape(
        batch_size, -1, post_patch_num_frames, patch_size_t, post_patch_height, patch_size, post_patch_width, patch_size,
    )
    latents = latents.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)
    return latents


def forward_pass(transformer, prompt_embeds, prompt_attention_mask, latents, noisy_latents, timesteps, num_frames,
                 height, width, **kwargs):
    if FIXED:
        # TODO(aryan): make configurable
        frame_rate = 25
        latent_frame_rate = frame_rate / 8
        spatial_compression_ratio = 32
        rope_interpolation_scale = [1 / latent_frame_rate, spatial_compression_ratio, spatial_compression_ratio]
    else:
        # TODO(aryan): make configurable
        rope_interpolation_scale = [1 / 25, 32, 32]

    denoised_latents = transformer(
        hidden_states=noisy_latents,
        encoder_hidden_states=prompt_embeds,
        timestep=timesteps,
        encoder_attention_mask=prompt_attention_mask,
        num_frames=num_frames,
        height=height,
        width=width,
        rope_interpolation_scale=rope_interpolation_scale,
        return_dict=False,
    )[0]

    return {"latents": denoised_latents}


def main():
    torch.manual_seed(0)
    transformer = LTXVideoTransformer3DModel()
    transformer.train()

    # a batch of two clips: VAE latents [B, C, F, H, W] (LTX VAE: 8x temporal, 32x spatial compression)
    batch_size, channels, num_frames, height, width = 2, 8, 4, 3, 4
    latents = torch.randn(batch_size, channels, num_frames, height, width)
    latents = _pack_latents(latents, 1, 1)

    # T5 prompt embeddings padded to max_sequence_length, with their bool mask
    max_sequence_length = 8
    prompt_embeds = torch.randn(batch_size, max_sequence_length, 32)
    lengths = torch.tensor([5, 8])
    prompt_attention_mask = (torch.arange(max_sequence_length)[None] < lengths[:, None]).bool()

    # flow matching, as the trainer does it
    sigmas = torch.tensor([0.7, 0.3]).view(-1, 1, 1)
    noise = torch.randn_like(latents)
    noisy_latents = (1.0 - sigmas) * latents + sigmas * noise
    timesteps = (sigmas.flatten() * 1000.0).long()

    pred = forward_pass(
        transformer=transformer,
        prompt_embeds=prompt_embeds,
        prompt_attention_mask=prompt_attention_mask,
        latents=latents,
        noisy_latents=noisy_latents,
        timesteps=timesteps,
        num_frames=num_frames,
        height=height,
        width=width,
    )["latents"]
    target = noise - latents
    loss = F.mse_loss(pred.float(), target.float())
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)

    print("pred[0, :3, :4] =", pred[0, :3, :4].detach())
    print(f"loss = {loss.item():.6f}  grad_norm = {grad_norm.item():.6f}")


if __name__ == "__main__":
    main()
