"""TensorRT-Model-Connect Canary runtime: the encoder mask length came from the chunk-padded mel.

Citation: NVIDIA/TensorRT-Model-Connect commit 54c0a663a ("fix(canary): fix encoder padding leakage
end-to-end (engine + runtime)", fixes #268; PR #269). Files: src/runtime/models/canary/pipeline.cpp
(CanaryPipeline::transcribe, run_encoder), canary_mel_spectrogram.{h,cpp} (MelResult),
canary_host_plan.h (compute_canary_actual_encoder_length, build_canary_encoder_mask_values).

The bug: the audio is padded to chunk_length_s before framing, so MelResult.n_frames is always the
full chunk length. run_encoder passed mel.n_frames to compute_canary_actual_encoder_length, which
returns 0 when mel_length >= mel_full; run_encoder then used actual_enc = enc_seq, and
build_canary_encoder_mask_values produced an all-zero additive mask: the FastConformer encoder's
self-attention attends the padded tail of a short clip.

The fix: extract_mel_spectrogram also returns valid_frames (real audio samples / hop_length), and
transcribe/run_encoder compute the encoder length (and the mask) from valid_frames.

This program renders the C++ host code in Python and the engine's encoder graph in torch at toy
sizes with random weights (8x stride-2 subsampling kept, 2 encoder layers of relative-free
self-attention, hidden 32, 4 heads, chunk 1.6 s instead of 30 s, one 0.5 s clip). The engine adds
the [1, 1, S] mask to the [H, S, S] scores before a plain softmax, as _add_rel_pos_attention does.
The conv module and the decoder (cross-K/V zero padding, greedy loop) are left out.
"""

import dataclasses
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


# --------------------------------------------------------------------------------------------
# runtime/models/canary/canary_config.h (toy sizes)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class CanaryConfig:
    sample_rate: int = 16000
    hop_length: int = 160
    chunk_length_s: float = 1.6  # 30 s in canary-1b-v2
    n_mels: int = 16
    mel_length: int = 0  # 0 -> max_source_positions * 2 (overridden below to chunk frames)
    max_source_positions: int = 20  # encoder frames after 8x subsampling
    hidden_size: int = 32
    num_heads: int = 4
    num_encoder_layers: int = 2


# --------------------------------------------------------------------------------------------
# runtime/models/canary/canary_mel_spectrogram.{h,cpp}
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class MelResult:
    data: np.ndarray  # [n_mels, n_frames]
    n_mels: int = 0
    n_frames: int = 0  # total frames (audio is chunk-padded, so this is the full length)
    valid_frames: int = 0  # frames covering the real (pre-chunk-padding) audio


def extract_mel_spectrogram(samples, cfg, mel_basis):
    chunk_samples = int(cfg.chunk_length_s * cfg.sample_rate)
    padded = np.zeros(chunk_samples, dtype=np.float32)
    n = min(len(samples), chunk_samples)
    padded[:n] = samples[:n]
    n_frames_out = chunk_samples // cfg.hop_length
    frames = padded[: n_frames_out * cfg.hop_length].reshape(n_frames_out, cfg.hop_length)
    # stand-in for STFT power + mel filterbank + log: a fixed projection of each hop
    mel_spec = np.log(np.abs(frames @ mel_basis) + 1e-5).T.astype(np.float32)  # [n_mels, T]
    result = MelResult(data=mel_spec, n_mels=cfg.n_mels, n_frames=n_frames_out)
    if FIXED:
        valid_audio = min(max(len(samples), 0), chunk_samples)
        result.valid_frames = min(n_frames_out, valid_audio // cfg.hop_length)
    return result


# --------------------------------------------------------------------------------------------
# runtime/models/canary/canary_host_plan.h
# --------------------------------------------------------------------------------------------
def resolve_canary_expected_mel_length(cfg):
    return cfg.mel_length if cfg.mel_length > 0 else cfg.max_source_positions * 2


def count_canary_stride2_stages(mel_full, enc_full):
    ratio = mel_full // enc_full if enc_full > 0 else 2
    stages = 0
    while ratio > 1:
        ratio //= 2
        stages += 1
    return stages


def apply_canary_stride2_subsampling(length, stages):
    subsampled = length
    for _ in range(stages):
        subsampled = (subsampled + 2 - 3) // 2 + 1
    return subsampled


def compute_canary_actual_encoder_length(mel_length, mel_full, enc_full):
    if mel_full <= 0 or mel_length >= mel_full:
        return 0
    stages = count_canary_stride2_stages(mel_full, enc_full)
    return apply_canary_stride2_subsampling(mel_length, stages)


def build_canary_encoder_mask_values(enc_seq, actual_enc):
    if enc_seq <= 0:
        return []
    mask = [0.0] * enc_seq
    first_masked = min(max(actual_enc, 0), enc_seq)
    for position in range(first_masked, enc_seq):
        mask[position] = -10000.0
    return mask


# --------------------------------------------------------------------------------------------
# families/canary/plugin.py encoder graph, rendered in torch
# --------------------------------------------------------------------------------------------
class Subsampling(nn.Module):
    """DW-striding subsampling: stride-2 kernel-3 padding-1 stages, then a linear."""

    def __init__(self, cfg, stages):
        super().__init__()
        ch = cfg.hidden_size
        self.convs = nn.ModuleList(
            [nn.Conv1d(cfg.n_mels if i == 0 else ch, ch, 3, stride=2, padding=1) for i in range(stages)]
        )
        self.out = nn.Linear(ch, cfg.hidden_size)

    def forward(self, mel):  # [1, n_mels, T]
        x = mel
        for conv in self.convs:
            x = F.relu(conv(x))
        return self.out(x.transpose(1, 2))  # [1, S, hidden]


class EncoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden_size
        self.H = cfg.num_heads
        self.D = h // cfg.num_heads
        self.norm_att = nn.LayerNorm(h)
        self.linear_q = nn.Linear(h, h)
        self.linear_k = nn.Linear(h, h)
        self.linear_v = nn.Linear(h, h)
        self.linear_out = nn.Linear(h, h)
        self.norm_ff = nn.LayerNorm(h)
        self.ff = nn.Sequential(nn.Linear(h, 2 * h), nn.SiLU(), nn.Linear(2 * h, h))

    def forward(self, hs, enc_mask):
        S = hs.shape[0]
        n = self.norm_att(hs)
        q = self.linear_q(n).view(S, self.H, self.D).transpose(0, 1)
        k = self.linear_k(n).view(S, self.H, self.D).transpose(0, 1)
        v = self.linear_v(n).view(S, self.H, self.D).transpose(0, 1)
        scaled = q @ k.transpose(1, 2) / math.sqrt(self.D)  # [H, S, S]
        # Apply encoder sequence mask: [1, 1, S] added to scores [H, S, S]
        if enc_mask is not None:
            scaled = scaled + enc_mask
        sm = torch.softmax(scaled, dim=-1)
        ctx = (sm @ v).transpose(0, 1).reshape(S, -1)
        hs = hs + self.linear_out(ctx)
        hs = hs + 0.5 * self.ff(self.norm_ff(hs))
        return hs


class CanaryEncoderEngine(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        mel_full = resolve_canary_expected_mel_length(cfg)
        self.pre_encode = Subsampling(cfg, count_canary_stride2_stages(mel_full, cfg.max_source_positions))
        self.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg.num_encoder_layers)])

    def forward(self, inputs):
        mel = inputs["mel_features"].unsqueeze(0)
        hs = self.pre_encode(mel)[0]
        enc_mask = inputs.get("encoder_mask")
        if enc_mask is not None:
            enc_mask = enc_mask.view(1, 1, -1)
        for layer in self.layers:
            hs = layer(hs, enc_mask)
        return {"encoder_output": hs}


# --------------------------------------------------------------------------------------------
# runtime/models/canary/pipeline.cpp
# --------------------------------------------------------------------------------------------
class CanaryPipeline:
    def __init__(self, cfg, encoder, mel_basis):
        self.canary_config_ = cfg
        self.encoder_ = encoder
        self.mel_basis = mel_basis
        self.encoder_output = None

    def run_encoder(self, mel_data, mel_bins, mel_length, valid_mel_frames=None):
        cfg = self.canary_config_
        expected_length = resolve_canary_expected_mel_length(cfg)
        mel_host = np.zeros((mel_bins, expected_length), dtype=np.float32)
        copy_len = min(mel_length, expected_length)
        mel_host[:, :copy_len] = mel_data[:, :copy_len]
        inputs = {"mel_features": torch.from_numpy(mel_host)}

        enc_seq = cfg.max_source_positions
        length_for_mask = valid_mel_frames if FIXED else mel_length
        actual_enc = compute_canary_actual_encoder_length(length_for_mask, expected_length, enc_seq)
        if actual_enc <= 0:
            actual_enc = enc_seq
        enc_mask = build_canary_encoder_mask_values(enc_seq, actual_enc)
        inputs["encoder_mask"] = torch.tensor(enc_mask, dtype=torch.float32)

        with torch.no_grad():
            self.encoder_output = self.encoder_(inputs)["encoder_output"]

    def transcribe(self, audio_data):
        cfg = self.canary_config_
        mel = extract_mel_spectrogram(audio_data, cfg, self.mel_basis)
        if FIXED:
            valid_mel_frames = mel.valid_frames if mel.valid_frames > 0 else mel.n_frames
            self.run_encoder(mel.data, mel.n_mels, mel.n_frames, valid_mel_frames)
        else:
            valid_mel_frames = mel.n_frames
            self.run_encoder(mel.data, mel.n_mels, mel.n_frames)
        mel_full = resolve_canary_expected_mel_length(cfg)
        actual_enc_seq_len = compute_canary_actual_encoder_length(
            valid_mel_frames, mel_full, cfg.max_source_positions
        )
        return self.encoder_output, actual_enc_seq_len


def main():
    torch.manual_seed(0)
    cfg = CanaryConfig()
    cfg.mel_length = int(cfg.chunk_length_s * cfg.sample_rate) // cfg.hop_length  # 160 frames
    cfg.max_source_positions = cfg.mel_length // 8  # 20
    rng = np.random.default_rng(0)
    mel_basis = rng.standard_normal((cfg.hop_length, cfg.n_mels)).astype(np.float32) * 0.1

    encoder = CanaryEncoderEngine(cfg).eval()
    pipeline = CanaryPipeline(cfg, encoder, mel_basis)

    audio = rng.standard_normal(int(0.5 * cfg.sample_rate)).astype(np.float32) * 0.3  # 0.5 s clip
    enc_out, actual_len = pipeline.transcribe(audio)
    print("encoder output", tuple(enc_out.shape), "actual encoder seq len", actual_len)
    print("first frame (first 4 dims):", [round(x, 4) for x in enc_out[0, :4].tolist()])
    print("mean of frames 0..5:", round(enc_out[:6].mean().item(), 6))


if __name__ == "__main__":
    main()
