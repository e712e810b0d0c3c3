"""sglang-omni MiniCPM-o audio encoder: the key-validity mask compared post-conv frames with mel lengths.

Citation: sgl-project/sglang-omni#1879 ("[MiniCPM-o] Support MiniCPM-o-4.5"), review thread on
sglang_omni/models/minicpm_o/components/audio_encoder.py (lailoo; confirmed by koppx as BUG-06 of
their test report), fixed in the PR by the author (MayDomine) before merge.

The bug: ``MiniCPMOAudioEncoder.forward`` indexes frames after the Whisper encoder's stride-2
``conv2`` (``max_seq_len = (max_mel_seq_len - 1) // 2 + 1``) but built
``valid = seq_range[None, :] < lens[:, None]`` with ``lens`` still in mel frames. In a batch of
clips of different lengths, a shorter clip's padding frames after the convolution stayed valid
keys (60 valid mel frames become 30 after the conv, and the mask allowed 30 more).

The fix: ``lens_after_conv = feature_lens_after_conv(lens)`` (``(lens - 1) // 2 + 1``) and
``valid = seq_range[None, :] < lens_after_conv[:, None]``.

This program keeps the file's structure at toy sizes with random weights (no checkpoint): the
Whisper encoder with fused ``qkv_proj`` and an additive SDPA mask, the chunked-causal mask cached
per size and ANDed with the key validity, the ``MASK_MIN`` fill, the projector and the
``AvgPool1d`` pooling with per-clip pooled lengths. Two clips of 40 and 24 mel frames in one batch.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

FIXED = "--fixed" in sys.argv

# note (MayDomine): finite mask values avoid NaNs on fully masked padding rows.
MASK_MIN = -1e9


def chunked_causal_mask(size: int, chunk_size: int, device: torch.device) -> torch.Tensor:
    """Allow attention within the current chunk and to all preceding chunks."""
    frame = torch.arange(size, device=device)
    visible_end = (frame // chunk_size + 1) * chunk_size
    return frame[None, :] < visible_end[:, None]


def feature_lens_after_conv(input_lengths: torch.Tensor) -> torch.Tensor:
    """Valid frame counts after the encoder's stride-2 conv2."""
    return (input_lengths - 1) // 2 + 1


def feature_lens_after_pooling(input_lengths: torch.Tensor, pool_step: int) -> torch.Tensor:
    after_cnn = feature_lens_after_conv(input_lengths)
    after_pool = (after_cnn - pool_step) // pool_step + 1
    return after_pool.to(dtype=torch.int32)


class MiniCPMOConfig(PretrainedConfig):
    model_type = "minicpmo"

    def __init__(self, hidden_size=64, audio_pool_step=2, audio_chunk_length=0.2, audio_config=None, **kwargs):
        self.hidden_size = hidden_size
        self.audio_pool_step = audio_pool_step
        self.audio_chunk_length = audio_chunk_length
        self.audio_config = audio_config or dict(
            d_model=32,
            encoder_attention_heads=4,
            encoder_layers=2,
            encoder_ffn_dim=64,
            num_mel_bins=16,
            max_source_positions=64,
            activation_function="gelu",
        )
        super().__init__(**kwargs)


def audio_config_object(config: PretrainedConfig) -> PretrainedConfig:
    audio_config = config.audio_config
    if isinstance(audio_config, dict):
        return PretrainedConfig.from_dict(audio_config)
    return audio_config


class MiniCPMWhisperEncoderAttention(nn.Module):
    """Whisper self-attention with fused QKV and an additive SDPA mask."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_dim = config.d_model
        self.num_heads = config.encoder_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.qkv_proj = nn.Linear(self.embed_dim, 3 * self.embed_dim)
        with torch.no_grad():
            self.qkv_proj.bias[self.embed_dim : 2 * self.embed_dim].zero_()
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def reshape_heads(self, states):
        batch_size, seq_len, _ = states.shape
        return states.view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, attn_mask):
        query, key, value = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        key, value = self.reshape_heads(key), self.reshape_heads(value)
        attn_output = F.scaled_dot_product_attention(
            self.reshape_heads(query), key, value, attn_mask=attn_mask, dropout_p=0.0
        )
        attn_output = attn_output.transpose(1, 2).reshape(hidden_states.shape[0], hidden_states.shape[1], self.embed_dim)
        return self.out_proj(attn_output)


class MiniCPMWhisperEncoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.self_attn = MiniCPMWhisperEncoderAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)
        self.activation_fn = ACT2FN[config.activation_function]

    def forward(self, hidden_states, attn_mask):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = self.self_attn(hidden_states, attn_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(self.activation_fn(self.fc1(hidden_states)))
        return residual + hidden_states


class MiniCPMWhisperEncoder(nn.Module):
    """Standard Whisper encoder stack driven by an external additive mask."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.conv1 = nn.Conv1d(config.num_mel_bins, config.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(config.d_model, config.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, config.d_model)
        self.layers = nn.ModuleList([MiniCPMWhisperEncoderLayer(config) for _ in range(config.encoder_layers)])
        self.layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, input_features, attn_mask):
        hidden_states = F.gelu(self.conv1(input_features))
        hidden_states = F.gelu(self.conv2(hidden_states))
        hidden_states = hidden_states.permute(0, 2, 1)
        embed_pos = self.embed_positions.weight[: hidden_states.shape[1]]
        hidden_states = hidden_states + embed_pos
        for layer in self.layers:
            hidden_states = layer(hidden_states, attn_mask)
        return self.layer_norm(hidden_states), None


class MultiModalProjector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim, bias=True)
        self.linear2 = nn.Linear(out_dim, out_dim, bias=True)

    def forward(self, audio_features):
        return self.linear2(F.relu(self.linear1(audio_features)))


class MiniCPMOAudioEncoder(nn.Module):
    """Encode and pool audio features into thinker embeddings."""

    def __init__(self, config: MiniCPMOConfig, device: str = "cpu", dtype=torch.float32) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.dtype = dtype
        audio_config = audio_config_object(config)
        self.apm = MiniCPMWhisperEncoder(audio_config)
        self.audio_projection_layer = MultiModalProjector(int(audio_config.d_model), int(config.hidden_size))
        self.eval()
        self.audio_pool_step = int(config.audio_pool_step)
        self.audio_avg_pooler = nn.AvgPool1d(self.audio_pool_step, stride=self.audio_pool_step)
        # note (MayDomine): stride-2 convolution yields 50 frames per second.
        self.chunk_num_frame = int(float(config.audio_chunk_length) * 50)
        self.chunk_mask_cache = None

    def cached_chunk_mask(self, size: int) -> torch.Tensor:
        if self.chunk_mask_cache is None or self.chunk_mask_cache[0] != size:
            self.chunk_mask_cache = (size, chunked_causal_mask(size, self.chunk_num_frame, self.device))
        return self.chunk_mask_cache[1]

    @torch.no_grad()
    def forward(self, *, audio_features=None, audio_feature_lens=None, **_):
        if audio_features is None or audio_features.numel() == 0 or audio_feature_lens is None:
            return {}
        wavforms = audio_features.to(self.device, dtype=self.dtype)
        lens_cpu = audio_feature_lens.to("cpu")
        lens = audio_feature_lens.to(self.device)

        _, _, max_mel_seq_len = wavforms.shape
        max_seq_len = (max_mel_seq_len - 1) // 2 + 1

        # note (MayDomine): convolution sees padding before the attention mask does.
        mel_range = torch.arange(max_mel_seq_len, device=self.device)
        wavforms = wavforms.masked_fill(mel_range[None, None, :] >= lens[:, None, None], 0.0)

        seq_range = torch.arange(max_seq_len, device=self.device)
        if FIXED:
            lens_after_conv = feature_lens_after_conv(lens)
            valid = seq_range[None, :] < lens_after_conv[:, None]
        else:
            valid = seq_range[None, :] < lens[:, None]  # (B, T) key validity
        allowed = self.cached_chunk_mask(max_seq_len)[None, :, :] & valid[:, None, :]
        attn_mask = torch.where(allowed, 0.0, MASK_MIN).to(self.dtype)
        attn_mask = attn_mask.unsqueeze(1)

        audio_states, _ = self.apm(wavforms, attn_mask)
        audio_embeds = self.audio_projection_layer(audio_states)

        audio_embeds = audio_embeds.transpose(1, 2)
        audio_embeds = self.audio_avg_pooler(audio_embeds)
        audio_embeds = audio_embeds.transpose(1, 2)

        pooled_lens = feature_lens_after_pooling(lens_cpu, self.audio_pool_step)
        pool_range = torch.arange(audio_embeds.shape[1], device=self.device)
        keep = pool_range[None, :] < pooled_lens.to(self.device)[:, None]
        return {"audio_embeds": audio_embeds[keep]}


def main():
    torch.manual_seed(0)
    config = MiniCPMOConfig()
    encoder = MiniCPMOAudioEncoder(config)
    n_mels = config.audio_config["num_mel_bins"]
    lens = torch.tensor([40, 24])
    audio_features = torch.randn(2, n_mels, 40)
    out = encoder(audio_features=audio_features, audio_feature_lens=lens)["audio_embeds"]
    pooled = feature_lens_after_pooling(lens, config.audio_pool_step).tolist()
    first, second = out[: pooled[0]], out[pooled[0] :]
    print("fixed" if FIXED else "buggy", "audio embeds:", tuple(out.shape), "pooled per clip:", pooled)
    print("clip 0 sum: %.6f  clip 1 sum: %.6f" % (first.sum().item(), second.sum().item()))


if __name__ == "__main__":
    main()
