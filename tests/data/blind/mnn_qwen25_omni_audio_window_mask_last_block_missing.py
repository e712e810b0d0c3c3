# alibaba/MNN#4458 (closed; fix = the boundary check proposed there): Omni::audioProcess builds the
# Qwen2.5-Omni audio encoder's block-diagonal window mask from cu_seqlens, but only appends the final
# boundary when seqlen % n_window != 0, so at an exact multiple the last window stays all `lowest`.
# Torch rendering of the C++ mask loop and of the exported audio encoder graph it feeds.
import math
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
LOWEST = float(np.finfo(np.float32).min)  # std::numeric_limits<float>::lowest()


class AudioAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x, attention_mask):
        seq = x.shape[0]
        q = self.q_proj(x).view(seq, self.n_heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(seq, self.n_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(seq, self.n_heads, self.head_dim).transpose(0, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        probs = torch.softmax(scores + attention_mask, dim=-1)  # attention_mask: (1, seqlen, seqlen)
        return self.out_proj((probs @ v).transpose(0, 1).reshape(seq, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.self_attn = AudioAttention(d_model, n_heads)
        self.final_layer_norm = nn.LayerNorm(d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, 2 * d_model), nn.Linear(2 * d_model, d_model)

    def forward(self, x, attention_mask):
        x = x + self.self_attn(self.self_attn_layer_norm(x), attention_mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """Qwen2.5-Omni audio tower as exported for MNN: inputs (input_features, attention_mask)."""

    def __init__(self, n_mels=16, d_model=32, n_heads=4, n_layers=2, max_source_positions=1500):
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)
        pos = torch.arange(max_source_positions)[:, None] * torch.exp(
            -math.log(10000) * torch.arange(d_model // 2)[None, :] / (d_model // 2 - 1))
        self.register_buffer("positional_embedding", torch.cat([pos.sin(), pos.cos()], dim=1))
        self.layers = nn.ModuleList([AudioEncoderLayer(d_model, n_heads) for _ in range(n_layers)])
        self.ln_post = nn.LayerNorm(d_model)

    def forward(self, input_features, attention_mask):
        x = F.gelu(self.conv2(F.gelu(self.conv1(input_features))))[0].transpose(0, 1)  # (seqlen, d)
        x = x + self.positional_embedding[: x.shape[0]]
        for layer in self.layers:
            x = layer(x, attention_mask)
        return self.ln_post(x)


def audio_process(audio_module, input_features):
    """Omni::audioProcess, the branch for audio modules that take an attention_mask input."""
    seqlen = (input_features.shape[2] + 1) // 2  # UP_DIV(dim[2], 2)
    n_window = 100
    cu_seqlens = []
    curseq = 0
    while curseq < seqlen:
        cu_seqlens.append(curseq)
        curseq += n_window
    if FIXED:
        if not cu_seqlens or cu_seqlens[-1] != seqlen:
            cu_seqlens.append(seqlen)
    elif seqlen % n_window != 0:
        cu_seqlens.append(seqlen)
    attention_mask = torch.full((1, seqlen, seqlen), LOWEST)
    for i in range(1, len(cu_seqlens)):
        attention_mask[0, cu_seqlens[i - 1]:cu_seqlens[i], cu_seqlens[i - 1]:cu_seqlens[i]] = 0
    return audio_module(input_features, attention_mask)


encoder = AudioEncoder().eval()
# 4 s of audio: 400 fbank frames -> seqlen 200 = exactly two windows of n_window=100
input_features = torch.randn(1, 16, 400)
with torch.no_grad():
    audio_embedding = audio_process(encoder, input_features)
    # what the windowed encoder means: each 100-frame window encoded on its own
    x = F.gelu(encoder.conv2(F.gelu(encoder.conv1(input_features))))[0].transpose(0, 1)
    x = x + encoder.positional_embedding[: x.shape[0]]
    windows = []
    for s in range(0, 200, 100):
        w = x[s:s + 100]
        for layer in encoder.layers:
            w = layer(w, torch.zeros(1, 100, 100))
        windows.append(encoder.ln_post(w))
    reference = torch.cat(windows)
first = (audio_embedding[:100] - reference[:100]).abs().max().item()
last = (audio_embedding[100:] - reference[100:]).abs().max().item()
print(f"fixed={FIXED} max |embedding - per-window reference|: window 0 = {first:.3e}, window 1 = {last:.3e}")
