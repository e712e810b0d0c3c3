# hao-ai-lab/FastVideo#1422 (commit 3f2457813, "[bugfix] LTX2: honor `video_position_offset_sec` in the DiT").
#
# LTX-2 audio continuation: the audio latents carry a pre-roll (prefix_sec of audio before the video's first
# frame), so the denoising stage passes `video_position_offset_sec=prefix_sec` to the DiT to shift the video's
# temporal RoPE positions (in seconds) forward. LTX2Transformer3DModel.forward had no such parameter: the value
# was swallowed by `**kwargs`, the video positions stayed at t = 0, and the audio<->video cross-attention
# (which rotates video queries / audio keys by their temporal positions) paired each video frame with audio
# `prefix_sec` earlier than it should.
# Fix: take `video_position_offset_sec` in forward and add it to positions[:, 0] after _get_pixel_coords.
#
# Ported from fastvideo/models/dits/ltx2.py (VideoLatentPatchifier, AudioLatentPatchifier, _get_pixel_coords,
# precompute_ltx_freqs_cis with the SPLIT rope, TransformerArgsPreprocessor / MultiModalTransformerArgsPreprocessor,
# LTXSelfAttention + LTXLocalAttention, BasicAVTransformerBlock's a2v / v2a cross-attention) and
# fastvideo/pipelines/basic/ltx2/stages/ltx2_denoising.py, trimmed (no adaLN, no text cross-attention, no SP).
import functools
import math
import sys
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

DEFAULT_LTX2_SCALE_FACTORS = (8, 32, 32)
DEFAULT_LTX2_AUDIO_SAMPLE_RATE = 16000
DEFAULT_LTX2_AUDIO_HOP_LENGTH = 160
DEFAULT_LTX2_AUDIO_DOWNSAMPLE = 4


# ---------------------------------------------------------------- forward context (fps comes from the batch)
@dataclass
class ForwardBatch:
    fps: float | None = None
    extra: dict = field(default_factory=dict)


_FORWARD_BATCH: ForwardBatch | None = None


def get_forward_batch():
    return _FORWARD_BATCH


# ---------------------------------------------------------------- latent shapes / patchifiers
class VideoLatentShape(tuple):
    @property
    def batch(self):
        return self[0]

    @property
    def frames(self):
        return self[2]

    @property
    def height(self):
        return self[3]

    @property
    def width(self):
        return self[4]

    @staticmethod
    def from_torch_shape(shape):
        return VideoLatentShape(tuple(shape))


class AudioLatentShape(tuple):
    @property
    def batch(self):
        return self[0]

    @property
    def channels(self):
        return self[1]

    @property
    def frames(self):
        return self[2]

    @property
    def mel_bins(self):
        return self[3]

    @staticmethod
    def from_torch_shape(shape):
        return AudioLatentShape(tuple(shape))


class VideoLatentPatchifier:
    def __init__(self, patch_size: int):
        self._patch_size = (1, patch_size, patch_size)

    def patchify(self, latents):
        # "b c (f p1) (h p2) (w p3) -> b (f h w) (c p1 p2 p3)" with p1 = p2 = p3 = 1
        b, c, f, h, w = latents.shape
        return latents.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)

    def unpatchify(self, latents, output_shape):
        b, c, f, h, w = output_shape
        return latents.reshape(b, f, h, w, c).permute(0, 4, 1, 2, 3)

    def get_patch_grid_bounds(self, output_shape: VideoLatentShape, device=None):
        frames, height, width = output_shape.frames, output_shape.height, output_shape.width
        batch_size = output_shape.batch
        grid_coords = torch.meshgrid(
            torch.arange(start=0, end=frames, step=self._patch_size[0], device=device),
            torch.arange(start=0, end=height, step=self._patch_size[1], device=device),
            torch.arange(start=0, end=width, step=self._patch_size[2], device=device),
            indexing="ij",
        )
        patch_starts = torch.stack(grid_coords, dim=0)
        patch_size_delta = torch.tensor(self._patch_size, device=patch_starts.device,
                                        dtype=patch_starts.dtype).view(3, 1, 1, 1)
        patch_ends = patch_starts + patch_size_delta
        latent_coords = torch.stack((patch_starts, patch_ends), dim=-1)  # c f h w bounds
        c = latent_coords.shape[0]
        latent_coords = latent_coords.reshape(c, -1, 2).unsqueeze(0).expand(batch_size, -1, -1, -1)
        return latent_coords  # b c (f h w) bounds


class AudioLatentPatchifier:
    def __init__(self, patch_size, sample_rate, hop_length, audio_latent_downsample_factor, is_causal=True,
                 shift=0):
        self.hop_length = hop_length
        self.sample_rate = sample_rate
        self.audio_latent_downsample_factor = audio_latent_downsample_factor
        self.is_causal = is_causal
        self.shift = shift

    def patchify(self, latents):
        # "b c t f -> b t (c f)"
        b, c, t, f = latents.shape
        return latents.permute(0, 2, 1, 3).reshape(b, t, c * f)

    def get_patch_grid_bounds(self, output_shape: AudioLatentShape, device=None):
        start_timings = self._get_audio_latent_time_in_sec(
            self.shift, output_shape.frames + self.shift, torch.float32, device)
        start_timings = start_timings.unsqueeze(0).expand(output_shape.batch, -1).unsqueeze(1)
        end_timings = self._get_audio_latent_time_in_sec(
            self.shift + 1, output_shape.frames + self.shift + 1, torch.float32, device)
        end_timings = end_timings.unsqueeze(0).expand(output_shape.batch, -1).unsqueeze(1)
        return torch.stack([start_timings, end_timings], dim=-1)

    def _get_audio_latent_time_in_sec(self, start_latent, end_latent, dtype, device):
        resolved_device = device or torch.device("cpu")
        audio_latent_frame = torch.arange(start_latent, end_latent, dtype=dtype, device=resolved_device)
        audio_mel_frame = audio_latent_frame * self.audio_latent_downsample_factor
        if self.is_causal:
            causal_offset = 1
            audio_mel_frame = (audio_mel_frame + causal_offset - self.audio_latent_downsample_factor).clamp(min=0)
        return audio_mel_frame * self.hop_length / self.sample_rate


def _get_pixel_coords(latent_coords, scale_factors, fps, causal_fix=True):
    broadcast_shape = [1] * latent_coords.ndim
    broadcast_shape[1] = -1
    scale_tensor = torch.tensor(scale_factors, device=latent_coords.device,
                                dtype=torch.float32).view(*broadcast_shape)
    pixel_coords = latent_coords.to(torch.float32) * scale_tensor
    if causal_fix:
        pixel_coords[:, 0, ...] = (pixel_coords[:, 0, ...] + 1 - scale_factors[0]).clamp(min=0)
    if fps:
        pixel_coords[:, 0, ...] = pixel_coords[:, 0, ...] / fps
    return pixel_coords


# ---------------------------------------------------------------- LTX rope (SPLIT, double precision grid)
@functools.lru_cache(maxsize=5)
def generate_ltx_freq_grid_np(positional_embedding_theta, positional_embedding_max_pos_count, inner_dim):
    theta = positional_embedding_theta
    start = 1
    end = theta
    n_elem = 2 * positional_embedding_max_pos_count
    pow_indices = np.power(theta, np.linspace(np.log(start) / np.log(theta), np.log(end) / np.log(theta),
                                              inner_dim // n_elem, dtype=np.float64))
    return torch.tensor(pow_indices * math.pi / 2, dtype=torch.float32)


def _ltx_get_fractional_positions(indices_grid, max_pos):
    n_pos_dims = indices_grid.shape[1]
    return torch.stack([indices_grid[:, i] / max_pos[i] for i in range(n_pos_dims)], dim=-1)


def _ltx_generate_freqs(indices, indices_grid, max_pos, use_middle_indices_grid):
    if use_middle_indices_grid:
        indices_grid_start, indices_grid_end = indices_grid[..., 0], indices_grid[..., 1]
        indices_grid = (indices_grid_start + indices_grid_end) / 2.0
    elif len(indices_grid.shape) == 4:
        indices_grid = indices_grid[..., 0]
    fractional_positions = _ltx_get_fractional_positions(indices_grid, max_pos)
    indices = indices.to(device=fractional_positions.device)
    freqs = (indices * (fractional_positions.unsqueeze(-1) * 2 - 1)).transpose(-1, -2).flatten(2)
    return freqs


def _ltx_split_freqs_cis(freqs, pad_size, num_attention_heads):
    cos_freq = freqs.cos()
    sin_freq = freqs.sin()
    if pad_size != 0:
        cos_padding = torch.ones_like(cos_freq[:, :, :pad_size])
        sin_padding = torch.zeros_like(sin_freq[:, :, :pad_size])
        cos_freq = torch.concatenate([cos_padding, cos_freq], axis=-1)
        sin_freq = torch.concatenate([sin_padding, sin_freq], axis=-1)
    b = cos_freq.shape[0]
    t = cos_freq.shape[1]
    cos_freq = cos_freq.reshape(b, t, num_attention_heads, -1)
    sin_freq = sin_freq.reshape(b, t, num_attention_heads, -1)
    cos_freq = torch.swapaxes(cos_freq, 1, 2)
    sin_freq = torch.swapaxes(sin_freq, 1, 2)
    return cos_freq, sin_freq


def precompute_ltx_freqs_cis(indices_grid, dim, out_dtype, theta=10000.0, max_pos=None,
                             use_middle_indices_grid=False, num_attention_heads=32,
                             freq_grid_generator=generate_ltx_freq_grid_np):
    if max_pos is None:
        max_pos = [20, 2048, 2048]
    indices = freq_grid_generator(theta, indices_grid.shape[1], dim)
    freqs = _ltx_generate_freqs(indices, indices_grid, max_pos, use_middle_indices_grid)
    expected_freqs = dim // 2
    current_freqs = freqs.shape[-1]
    pad_size = expected_freqs - current_freqs
    cos_freq, sin_freq = _ltx_split_freqs_cis(freqs, pad_size, num_attention_heads)
    return cos_freq.to(out_dtype), sin_freq.to(out_dtype)


def apply_ltx_rotary_emb_4d(input_tensor, freqs_cis):
    # SPLIT: cos/sin [B, H, T, D/2], input [B, H, T, D]
    cos_freqs, sin_freqs = freqs_cis
    shape = input_tensor.shape
    split_input = input_tensor.reshape(*shape[:-1], 2, shape[-1] // 2)  # "... (d r) -> ... d r", d=2
    first_half_input = split_input[..., :1, :]
    second_half_input = split_input[..., 1:, :]
    output = split_input * cos_freqs.unsqueeze(-2)
    first_half_output = output[..., :1, :]
    second_half_output = output[..., 1:, :]
    first_half_output.addcmul_(-sin_freqs.unsqueeze(-2), second_half_input)
    second_half_output.addcmul_(sin_freqs.unsqueeze(-2), first_half_input)
    return output.reshape(shape)


# ---------------------------------------------------------------- args preprocessors
@dataclass(frozen=True)
class TransformerArgs:
    x: torch.Tensor
    positional_embeddings: tuple
    cross_positional_embeddings: tuple | None
    enabled: bool


@dataclass
class Modality:
    enabled: bool
    latent: torch.Tensor
    positions: torch.Tensor


class TransformerArgsPreprocessor:
    def __init__(self, patchify_proj, inner_dim, max_pos, num_attention_heads, use_middle_indices_grid,
                 positional_embedding_theta):
        self.patchify_proj = patchify_proj
        self.inner_dim = inner_dim
        self.max_pos = max_pos
        self.num_attention_heads = num_attention_heads
        self.use_middle_indices_grid = use_middle_indices_grid
        self.positional_embedding_theta = positional_embedding_theta

    def _prepare_positional_embeddings(self, positions, inner_dim, max_pos, use_middle_indices_grid,
                                       num_attention_heads, x_dtype):
        return precompute_ltx_freqs_cis(positions, dim=inner_dim, out_dtype=x_dtype,
                                        theta=self.positional_embedding_theta, max_pos=max_pos,
                                        use_middle_indices_grid=use_middle_indices_grid,
                                        num_attention_heads=num_attention_heads,
                                        freq_grid_generator=generate_ltx_freq_grid_np)

    def prepare(self, modality: Modality) -> TransformerArgs:
        x = self.patchify_proj(modality.latent.contiguous())
        pe = self._prepare_positional_embeddings(
            positions=modality.positions, inner_dim=self.inner_dim, max_pos=self.max_pos,
            use_middle_indices_grid=self.use_middle_indices_grid,
            num_attention_heads=self.num_attention_heads, x_dtype=modality.latent.dtype)
        return TransformerArgs(x=x, positional_embeddings=pe, cross_positional_embeddings=None,
                               enabled=modality.enabled)


class MultiModalTransformerArgsPreprocessor:
    def __init__(self, patchify_proj, inner_dim, max_pos, num_attention_heads, cross_pe_max_pos,
                 use_middle_indices_grid, audio_cross_attention_dim, positional_embedding_theta):
        self.simple_preprocessor = TransformerArgsPreprocessor(
            patchify_proj=patchify_proj, inner_dim=inner_dim, max_pos=max_pos,
            num_attention_heads=num_attention_heads, use_middle_indices_grid=use_middle_indices_grid,
            positional_embedding_theta=positional_embedding_theta)
        self.cross_pe_max_pos = cross_pe_max_pos
        self.audio_cross_attention_dim = audio_cross_attention_dim

    def prepare(self, modality: Modality) -> TransformerArgs:
        transformer_args = self.simple_preprocessor.prepare(modality)
        cross_pe = self.simple_preprocessor._prepare_positional_embeddings(
            positions=modality.positions[:, 0:1, :],
            inner_dim=self.audio_cross_attention_dim,
            max_pos=[self.cross_pe_max_pos],
            use_middle_indices_grid=True,
            num_attention_heads=self.simple_preprocessor.num_attention_heads,
            x_dtype=modality.latent.dtype,
        )
        return replace(transformer_args, cross_positional_embeddings=cross_pe)


# ---------------------------------------------------------------- attention
class LTXLocalAttention(nn.Module):
    def __init__(self, num_heads, head_size):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size

    def forward(self, q, k, v, ltx_freqs_cis=None, ltx_k_freqs_cis=None):
        if ltx_freqs_cis is not None:
            k_freqs = ltx_k_freqs_cis if ltx_k_freqs_cis is not None else ltx_freqs_cis
            q = q.transpose(1, 2)
            k = k.transpose(1, 2)
            q = apply_ltx_rotary_emb_4d(q, ltx_freqs_cis)
            k = apply_ltx_rotary_emb_4d(k, k_freqs)
            q = q.transpose(1, 2)
            k = k.transpose(1, 2)
        # SDPA backend: [B, T, H, D] -> [B, H, T, D]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)


class LTXSelfAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=2, dim_head=8):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = query_dim if context_dim is None else context_dim
        self.heads = heads
        self.dim_head = dim_head
        self.q_norm = nn.RMSNorm(inner_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(inner_dim, eps=1e-6)
        self.to_q = nn.Linear(query_dim, inner_dim, bias=True)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=True)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=True)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim, bias=True), nn.Identity()])
        self.attn = LTXLocalAttention(num_heads=heads, head_size=dim_head)

    def forward(self, x, context=None, mask=None, pe=None, k_pe=None):
        context = x if context is None else context
        q = self.q_norm(self.to_q(x))
        k = self.k_norm(self.to_k(context))
        v = self.to_v(context)
        b, q_len, _ = q.shape
        k_len = k.shape[1]
        q = q.view(b, q_len, self.heads, self.dim_head)
        k = k.view(b, k_len, self.heads, self.dim_head)
        v = v.view(b, k_len, self.heads, self.dim_head)
        out = self.attn(q, k, v, ltx_freqs_cis=pe, ltx_k_freqs_cis=k_pe)
        out = out.reshape(b, q_len, -1)
        out = self.to_out[0](out)
        return self.to_out[1](out)


@dataclass
class TransformerConfig:
    dim: int
    heads: int
    d_head: int


class BasicAVTransformerBlock(nn.Module):
    def __init__(self, video: TransformerConfig, audio: TransformerConfig):
        super().__init__()
        self.attn1 = LTXSelfAttention(video.dim, heads=video.heads, dim_head=video.d_head)
        self.audio_attn1 = LTXSelfAttention(audio.dim, heads=audio.heads, dim_head=audio.d_head)
        # Q from video, K/V from audio; audio heads / head dim (audio_cross_attention_dim)
        self.audio_to_video_attn = LTXSelfAttention(video.dim, context_dim=audio.dim, heads=audio.heads,
                                                    dim_head=audio.d_head)
        # Q from audio, K/V from video
        self.video_to_audio_attn = LTXSelfAttention(audio.dim, context_dim=video.dim, heads=audio.heads,
                                                    dim_head=audio.d_head)
        self.ff = nn.Sequential(nn.Linear(video.dim, 2 * video.dim), nn.GELU(approximate="tanh"),
                                nn.Linear(2 * video.dim, video.dim))
        self.audio_ff = nn.Sequential(nn.Linear(audio.dim, 2 * audio.dim), nn.GELU(approximate="tanh"),
                                      nn.Linear(2 * audio.dim, audio.dim))

    @staticmethod
    def _norm(x):
        return F.rms_norm(x, (x.shape[-1],), eps=1e-6)

    def forward(self, video: TransformerArgs, audio: TransformerArgs):
        vx, ax = video.x, audio.x
        vx = vx + self.attn1(self._norm(vx), pe=video.positional_embeddings)
        ax = ax + self.audio_attn1(self._norm(ax), pe=audio.positional_embeddings)

        vx_norm3 = self._norm(vx)
        ax_norm3 = self._norm(ax)
        # Audio-to-video cross-attention: Q from video, K/V from audio
        vx = vx + self.audio_to_video_attn(vx_norm3, context=ax_norm3,
                                           pe=video.cross_positional_embeddings,
                                           k_pe=audio.cross_positional_embeddings)
        # Video-to-audio cross-attention: Q from audio, K/V from video
        ax = ax + self.video_to_audio_attn(ax_norm3, context=vx_norm3,
                                           pe=audio.cross_positional_embeddings,
                                           k_pe=video.cross_positional_embeddings)

        vx = vx + self.ff(self._norm(vx))
        ax = ax + self.audio_ff(self._norm(ax))
        return replace(video, x=vx), replace(audio, x=ax)


class LTXModel(nn.Module):
    def __init__(self, in_channels, audio_in_channels, num_attention_heads, attention_head_dim,
                 audio_num_attention_heads, audio_attention_head_dim, num_layers,
                 positional_embedding_theta=10000.0, positional_embedding_max_pos=None,
                 audio_positional_embedding_max_pos=None, use_middle_indices_grid=True):
        super().__init__()
        self.positional_embedding_max_pos = positional_embedding_max_pos or [20, 2048, 2048]
        self.audio_positional_embedding_max_pos = audio_positional_embedding_max_pos or [20]
        inner_dim = num_attention_heads * attention_head_dim
        audio_inner_dim = audio_num_attention_heads * audio_attention_head_dim
        self.patchify_proj = nn.Linear(in_channels, inner_dim)
        self.audio_patchify_proj = nn.Linear(audio_in_channels, audio_inner_dim)
        self.proj_out = nn.Linear(inner_dim, in_channels)
        self.audio_proj_out = nn.Linear(audio_inner_dim, audio_in_channels)
        cross_pe_max_pos = max(self.positional_embedding_max_pos[0], self.audio_positional_embedding_max_pos[0])
        self.video_args_preprocessor = MultiModalTransformerArgsPreprocessor(
            patchify_proj=self.patchify_proj, inner_dim=inner_dim, max_pos=self.positional_embedding_max_pos,
            num_attention_heads=num_attention_heads, cross_pe_max_pos=cross_pe_max_pos,
            use_middle_indices_grid=use_middle_indices_grid, audio_cross_attention_dim=audio_inner_dim,
            positional_embedding_theta=positional_embedding_theta)
        self.audio_args_preprocessor = MultiModalTransformerArgsPreprocessor(
            patchify_proj=self.audio_patchify_proj, inner_dim=audio_inner_dim,
            max_pos=self.audio_positional_embedding_max_pos, num_attention_heads=audio_num_attention_heads,
            cross_pe_max_pos=cross_pe_max_pos, use_middle_indices_grid=use_middle_indices_grid,
            audio_cross_attention_dim=audio_inner_dim, positional_embedding_theta=positional_embedding_theta)
        self.transformer_blocks = nn.ModuleList([
            BasicAVTransformerBlock(TransformerConfig(inner_dim, num_attention_heads, attention_head_dim),
                                    TransformerConfig(audio_inner_dim, audio_num_attention_heads,
                                                      audio_attention_head_dim))
            for _ in range(num_layers)
        ])

    def forward(self, video: Modality, audio: Modality):
        video_args = self.video_args_preprocessor.prepare(video)
        audio_args = self.audio_args_preprocessor.prepare(audio)
        for block in self.transformer_blocks:
            video_args, audio_args = block(video_args, audio_args)
        return self.proj_out(F.rms_norm(video_args.x, (video_args.x.shape[-1],))), \
            self.audio_proj_out(F.rms_norm(audio_args.x, (audio_args.x.shape[-1],)))


def _to_denoised(sample, velocity, sigma):
    return (sample.to(torch.float32) - velocity.to(torch.float32) * sigma.to(torch.float32).view(-1, 1, 1)
            ).to(sample.dtype)


class LTX2Transformer3DModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = LTXModel(in_channels=4, audio_in_channels=4, num_attention_heads=2, attention_head_dim=16,
                              audio_num_attention_heads=2, audio_attention_head_dim=8, num_layers=2)
        self.patchifier = VideoLatentPatchifier(patch_size=1)
        self.audio_patchifier = AudioLatentPatchifier(
            patch_size=1, sample_rate=DEFAULT_LTX2_AUDIO_SAMPLE_RATE, hop_length=DEFAULT_LTX2_AUDIO_HOP_LENGTH,
            audio_latent_downsample_factor=DEFAULT_LTX2_AUDIO_DOWNSAMPLE, is_causal=True)

    if FIXED:
        def forward(self, hidden_states, timestep, audio_hidden_states=None, audio_timestep=None,
                    video_position_offset_sec: float = 0.0, **kwargs):
            return self._forward(hidden_states, timestep, audio_hidden_states, audio_timestep,
                                 video_position_offset_sec)
    else:
        def forward(self, hidden_states, timestep, audio_hidden_states=None, audio_timestep=None, **kwargs):
            return self._forward(hidden_states, timestep, audio_hidden_states, audio_timestep, 0.0)

    def _forward(self, hidden_states, timestep, audio_hidden_states, audio_timestep, video_position_offset_sec):
        fps = None
        forward_batch = get_forward_batch()
        if forward_batch is not None and forward_batch.fps is not None:
            fps = float(forward_batch.fps)

        video_shape = VideoLatentShape.from_torch_shape(hidden_states.shape)
        latents = self.patchifier.patchify(hidden_states)
        positions = self.patchifier.get_patch_grid_bounds(video_shape, device=hidden_states.device)
        positions = _get_pixel_coords(positions, DEFAULT_LTX2_SCALE_FACTORS, fps=fps, causal_fix=True)
        if FIXED:
            if video_position_offset_sec:
                positions[:, 0, ...] = positions[:, 0, ...] + float(video_position_offset_sec)
        positions = positions.to(hidden_states.dtype)
        video_modality = Modality(enabled=True, latent=latents, positions=positions)

        audio_shape = AudioLatentShape.from_torch_shape(audio_hidden_states.shape)
        audio_latents = self.audio_patchifier.patchify(audio_hidden_states)
        audio_positions = self.audio_patchifier.get_patch_grid_bounds(audio_shape, device=audio_hidden_states.device)
        audio_modality = Modality(enabled=True, latent=audio_latents, positions=audio_positions)

        video_out, audio_out = self.model(video=video_modality, audio=audio_modality)
        video_out = _to_denoised(video_modality.latent, video_out, timestep)
        audio_out = _to_denoised(audio_modality.latent, audio_out, audio_timestep)
        return self.patchifier.unpatchify(video_out, hidden_states.shape), audio_out


def main():
    global _FORWARD_BATCH
    transformer = LTX2Transformer3DModel().eval()

    fps = 24.0
    # Continuation segment: 3 latent video frames (17 pixel frames at 24 fps) and audio with a pre-roll.
    # dreamverse's video_generation.py: prefix_sec = audio_extra / 24.0
    audio_extra = 5
    prefix_sec = float(audio_extra) / 24.0
    video_seconds = (1 + 8 * 2) / fps
    audio_latent_sec = DEFAULT_LTX2_AUDIO_DOWNSAMPLE * DEFAULT_LTX2_AUDIO_HOP_LENGTH / DEFAULT_LTX2_AUDIO_SAMPLE_RATE
    audio_num_frames = int(round((prefix_sec + video_seconds) / audio_latent_sec))
    _FORWARD_BATCH = ForwardBatch(fps=fps, extra={"video_position_offset_sec": prefix_sec})

    g = torch.Generator().manual_seed(1)
    video_latents = torch.randn(1, 4, 3, 2, 2, generator=g)
    audio_latents = torch.randn(1, 2, audio_num_frames, 2, generator=g)

    # ltx2_denoising.py: the offset read from batch.extra and passed to the transformer call
    video_position_offset_sec = float(_FORWARD_BATCH.extra.get("video_position_offset_sec", 0.0))
    sigmas = [1.0, 0.6, 0.3, 0.0]
    with torch.no_grad():
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            timestep = torch.tensor([sigma])
            denoised, audio_denoised = transformer(
                hidden_states=video_latents,
                timestep=timestep,
                audio_hidden_states=audio_latents,
                audio_timestep=timestep,
                video_sigma=timestep,
                audio_sigma=timestep,
                video_position_offset_sec=video_position_offset_sec,
            )
            # Euler step on both streams
            velocity = (video_latents - denoised) / sigma
            video_latents = video_latents + velocity * (sigma_next - sigma)
            audio_patched = transformer.audio_patchifier.patchify(audio_latents)
            audio_velocity = (audio_patched - audio_denoised) / sigma
            audio_patched = audio_patched + audio_velocity * (sigma_next - sigma)
            b, c, t, f = audio_latents.shape
            audio_latents = audio_patched.reshape(b, t, c, f).permute(0, 2, 1, 3)

    print("video latents:", video_latents.shape, "sum %.6f" % video_latents.sum().item())
    print("first frame:", [round(v, 4) for v in video_latents[0, :, 0, 0, 0].tolist()])
    print("audio latents:", audio_latents.shape, "sum %.6f" % audio_latents.sum().item())


if __name__ == "__main__":
    main()
