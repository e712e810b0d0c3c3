"""onnxruntime/mobius Qwen3-ASR audio encoder (torch rendering): no feature_attention_mask, no chunk blocks.

Citation: onnxruntime/mobius#264 ("Qwen3-ASR: feature_attention_mask + chunked conv for HF
parity"). Read from the PR description only (the diff was not available); the encoder below is
written from it and from the Hugging Face Qwen3-ASR audio tower it aligns with.

Bug: the exported audio encoder had no feature_attention_mask input: AudioEncoderLayer /
AudioAttention called the attention op without a mask, so (1) padded mel frames of shorter clips
produced tokens every real token attended, and (2) the encoder attended over the whole clip
instead of HF's block-diagonal windows (chunks of 2 * n_window mel frames -> 13 tokens each,
n_window_infer // (2 * n_window) chunks per attention block).
Fix: plumb attention_mask through to the attention op; declare feature_attention_mask, derive
audio_feature_lengths with HF's _get_feat_extract_output_lengths, and build a (B, S, S)
block-diagonal mask restricted to each clip's valid tokens. (The PR's per-chunk convolution
change is rendered here only as a per-chunk projection shared by both runs.)

Reproduction: two clips of 600 and 370 mel frames padded to 600; n_window = 50, n_window_infer =
400 (4 chunks = 52 tokens per block); F.scaled_dot_product_attention in each layer.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class AudioConfig:
    num_mel_bins: int = 8
    d_model: int = 32
    encoder_attention_heads: int = 4
    encoder_layers: int = 2
    n_window: int = 50
    n_window_infer: int = 400
    tokens_per_chunk: int = 13


def _get_feat_extract_output_lengths(input_lengths):
    input_lengths_leave = input_lengths % 100
    feat_lengths = (input_lengths_leave - 1) // 2 + 1
    output_lengths = ((feat_lengths - 1) // 2 + 1 - 1) // 2 + 1 + (input_lengths // 100) * 13
    return output_lengths


class AudioAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.encoder_attention_heads
        self.q_proj = nn.Linear(config.d_model, config.d_model)
        self.k_proj = nn.Linear(config.d_model, config.d_model)
        self.v_proj = nn.Linear(config.d_model, config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, hidden_states, attention_mask=None):
        b, s, d = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, s, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, d))


class AudioEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = AudioAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, 4 * config.d_model)
        self.fc2 = nn.Linear(4 * config.d_model, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, hidden_states, attention_mask=None):
        if FIXED:
            hidden_states = hidden_states + self.self_attn(self.self_attn_layer_norm(hidden_states), attention_mask)
        else:
            hidden_states = hidden_states + self.self_attn(self.self_attn_layer_norm(hidden_states))
        return hidden_states + self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden_states))))


class Qwen3ASRAudioEncoder(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        chunk_frames = 2 * config.n_window
        # stand-in for the conv2d stack: one chunk of mel frames -> tokens_per_chunk tokens
        self.conv_out = nn.Linear(config.num_mel_bins * chunk_frames, config.tokens_per_chunk * config.d_model)
        self.positional_embedding = nn.Parameter(torch.randn(config.tokens_per_chunk, config.d_model) * 0.1)
        self.layers = nn.ModuleList([AudioEncoderLayer(config) for _ in range(config.encoder_layers)])
        self.ln_post = nn.LayerNorm(config.d_model)

    def _block_mask(self, audio_feature_lengths, seq_len):
        cfg = self.config
        block = (cfg.n_window_infer // (2 * cfg.n_window)) * cfg.tokens_per_chunk
        pos = torch.arange(seq_len)
        same_block = (pos[:, None] // block) == (pos[None, :] // block)
        valid = pos[None, :] < audio_feature_lengths[:, None]  # (B, S)
        mask = same_block[None] & valid[:, None, :] & valid[:, :, None]
        return mask[:, None]  # (B, 1, S, S)

    def forward(self, input_features, feature_attention_mask):
        cfg = self.config
        b, n_mels, t = input_features.shape
        chunk_frames = 2 * cfg.n_window
        num_chunks = t // chunk_frames
        chunks = input_features.view(b, n_mels, num_chunks, chunk_frames).permute(0, 2, 1, 3).reshape(
            b, num_chunks, -1)
        hidden_states = self.conv_out(chunks).view(b, num_chunks, cfg.tokens_per_chunk, cfg.d_model)
        hidden_states = (hidden_states + self.positional_embedding).reshape(b, num_chunks * cfg.tokens_per_chunk, -1)

        audio_feature_lengths = _get_feat_extract_output_lengths(feature_attention_mask.sum(-1))
        attention_mask = self._block_mask(audio_feature_lengths, hidden_states.shape[1])
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return self.ln_post(hidden_states), audio_feature_lengths


if __name__ == "__main__":
    torch.manual_seed(0)
    config = AudioConfig()
    encoder = Qwen3ASRAudioEncoder(config).eval()
    lengths = torch.tensor([600, 370])
    input_features = torch.randn(2, config.num_mel_bins, 600)
    feature_attention_mask = torch.arange(600)[None, :] < lengths[:, None]
    input_features = input_features * feature_attention_mask[:, None, :]  # processor pads with zeros
    with torch.no_grad():
        audio_features, audio_feature_lengths = encoder(input_features, feature_attention_mask)
    print("audio_feature_lengths", audio_feature_lengths.tolist(),
          "clip1 token0", [round(v, 4) for v in audio_features[1, 0, :3].tolist()])
