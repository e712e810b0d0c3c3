# Citation: Tencent-Hunyuan/UniRL#274 (merged), "fix(qwen3-omni): align audio-video rollout numerics".
# Upstream code the fix is about: transformers models/qwen3_omni_moe/modeling_qwen3_omni_moe.py
#   (Qwen3OmniMoeAudioEncoder.forward builds cu_seqlens for the n_window_infer attention windows,
#    Qwen3OmniMoeAudioAttention.forward hands them to ALL_ATTENTION_FUNCTIONS[...] as
#    cu_seq_lens_q / cu_seq_lens_k with attention_mask=None), as used by UniRL's HF replay of the
#   Qwen3-Omni thinker's audio tower.
# Bug: only the flash_attention_2 interface reads cu_seq_lens_q/k (varlen); the sdpa interface drops
#   them, so the packed audio tokens (all windows of all audios of the batch) attend to each other
#   in one full attention instead of within their ~104-frame windows (what vLLM / FA2 compute).
# Fix (UniRL#274): run the audio tower with attn_implementation="flash_attention_2" so the
#   cu_seqlens windows are honoured (here flash_attn_varlen_func is a plain-torch stand-in).
import math
import sys
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ------------------------------------------------------------------ attention interfaces
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
    """Plain-torch stand-in for flash_attn.flash_attn_varlen_func: q/k/v are (total, nheads, headdim)."""
    outs = []
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi = q[qs:qe].transpose(0, 1)
        ki = k[ks:ke].transpose(0, 1)
        vi = v[ks:ke].transpose(0, 1)
        oi = F.scaled_dot_product_attention(qi, ki, vi, dropout_p=dropout_p, is_causal=causal,
                                            scale=softmax_scale)
        outs.append(oi.transpose(0, 1))
    return torch.cat(outs, dim=0)


def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            is_causal=None, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None,
                            max_length_k=None, **kwargs):
    # transformers.integrations.flash_attention.flash_attention_forward -> _flash_attention_forward:
    # (b, h, s, d) -> (b, s, h, d); with cu_seq_lens given, the batch is flattened and run varlen.
    query = query.transpose(1, 2)
    key = key.transpose(1, 2)
    value = value.transpose(1, 2)
    causal = module.is_causal if is_causal is None else is_causal
    if cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        q = query.reshape(-1, query.size(-2), query.size(-1))
        k = key.reshape(-1, key.size(-2), key.size(-1))
        v = value.reshape(-1, value.size(-2), value.size(-1))
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seq_lens_q, cu_seqlens_k=cu_seq_lens_k,
                                     max_seqlen_q=max_length_q, max_seqlen_k=max_length_k,
                                     dropout_p=dropout, softmax_scale=scaling, causal=causal)
        out = out.view(query.size(0), -1, out.size(-2), out.size(-1))
    else:
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             scale=scaling, is_causal=causal).transpose(1, 2)
    return out, None


def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           is_causal=None, **kwargs):
    # transformers.integrations.sdpa_attention.sdpa_attention_forward (extra kwargs are not read)
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    attn_output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                 scale=scaling, is_causal=is_causal)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, None


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


ALL_ATTENTION_FUNCTIONS = {
    "sdpa": sdpa_attention_forward,
    "flash_attention_2": flash_attention_forward,
}


# ------------------------------------------------------------------ config
class Qwen3OmniMoeAudioEncoderConfig:
    def __init__(self, attn_implementation):
        self.num_mel_bins = 16
        self.d_model = 32
        self.encoder_layers = 2
        self.encoder_attention_heads = 4
        self.encoder_ffn_dim = 64
        self.dropout = 0.0
        self.attention_dropout = 0.0
        self.activation_function = "gelu"
        self.activation_dropout = 0.0
        self.scale_embedding = False
        self.max_source_positions = 64
        self.n_window = 8            # chunks of n_window * 2 mel frames (upstream: 50)
        self.n_window_infer = 64     # attention window in mel frames (upstream: 800)
        self.conv_chunksize = 500
        self.downsample_hidden_size = 8
        self.output_dim = 24
        self._attn_implementation = attn_implementation


def _get_feat_extract_output_lengths(input_lengths, n_window):
    """Output length of the three stride-2 convolutions, chunk by chunk of n_window * 2 frames
    (upstream hard-codes 100 frames -> 13 tokens per full chunk; here 16 frames -> 2 tokens)."""
    chunk_len = n_window * 2
    tokens_per_chunk = (((chunk_len - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1
    input_lengths_leave = input_lengths % chunk_len
    feat_lengths = (input_lengths_leave - 1) // 2 + 1
    output_lengths = ((feat_lengths - 1) // 2 + 1 - 1) // 2 + 1 + (input_lengths // chunk_len) * tokens_per_chunk
    return output_lengths


class SinusoidsPositionEmbedding(nn.Module):
    def __init__(self, length, channels, max_timescale=10000):
        super().__init__()
        log_timescale_increment = np.log(max_timescale) / (channels // 2 - 1)
        inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2).float())
        scaled_time = torch.arange(length)[:, np.newaxis] * inv_timescales[np.newaxis, :]
        self.register_buffer("positional_embedding",
                             torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1), persistent=False)


class Qwen3OmniMoeAudioAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.d_model
        self.num_heads = config.encoder_attention_heads
        self.dropout = config.attention_dropout
        self.head_dim = self.embed_dim // self.num_heads
        self.num_key_value_groups = 1
        self.config = config
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = 0.0
        self.is_decoder = False
        self.is_causal = False
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=True)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=True)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=True)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=True)

    def forward(self, hidden_states, cu_seqlens=None, attention_mask=None, **kwargs):
        seq_length, _ = hidden_states.size()

        query_states = self.q_proj(hidden_states).reshape(seq_length, self.num_heads, -1)
        key_states = self.k_proj(hidden_states).reshape(seq_length, self.num_heads, -1)
        value_states = self.v_proj(hidden_states).reshape(seq_length, self.num_heads, -1)

        query_states = query_states.transpose(0, 1).unsqueeze(0)
        key_states = key_states.transpose(0, 1).unsqueeze(0)
        value_states = value_states.transpose(0, 1).unsqueeze(0)
        max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max()

        attention_interface: Callable = eager_attention_forward
        if self.config._attn_implementation != "eager":
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]

        attn_output, _ = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask=attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens,
            max_length_q=max_seqlen,
            max_length_k=max_seqlen,
            **kwargs,
        )

        attn_output = attn_output.reshape(seq_length, -1).contiguous()
        attn_output = self.out_proj(attn_output)
        return attn_output


class Qwen3OmniMoeAudioEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.d_model
        self.self_attn = Qwen3OmniMoeAudioAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, cu_seqlens, attention_mask=None, **kwargs):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = self.self_attn(hidden_states=hidden_states, cu_seqlens=cu_seqlens,
                                       attention_mask=attention_mask, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(F.gelu(self.fc1(hidden_states)))
        hidden_states = residual + hidden_states
        return (hidden_states,)


class Qwen3OmniMoeAudioEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        embed_dim = config.d_model
        self.num_mel_bins = config.num_mel_bins
        self.n_window = config.n_window
        self.positional_embedding = SinusoidsPositionEmbedding(config.max_source_positions, embed_dim)
        self.layers = nn.ModuleList([Qwen3OmniMoeAudioEncoderLayer(config) for _ in range(config.encoder_layers)])
        self.ln_post = nn.LayerNorm(config.d_model)
        self.conv2d1 = nn.Conv2d(1, config.downsample_hidden_size, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(config.downsample_hidden_size, config.downsample_hidden_size, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(config.downsample_hidden_size, config.downsample_hidden_size, 3, 2, padding=1)
        self.conv_out = nn.Linear(
            config.downsample_hidden_size * ((((config.num_mel_bins + 1) // 2 + 1) // 2 + 1) // 2),
            config.d_model, bias=False)
        self.proj1 = nn.Linear(config.d_model, config.d_model)
        self.act = nn.GELU()
        self.proj2 = nn.Linear(config.d_model, config.output_dim)
        self.n_window_infer = config.n_window_infer
        self.conv_chunksize = config.conv_chunksize

    def forward(self, input_features, feature_lens=None, aftercnn_lens=None):
        aftercnn_lens = _get_feat_extract_output_lengths(feature_lens, self.n_window)
        chunk_num = torch.ceil(feature_lens / (self.n_window * 2)).long()

        chunk_lengths = torch.tensor([self.n_window * 2] * chunk_num.sum(), dtype=torch.long,
                                     device=feature_lens.device)
        tail_chunk_index = F.pad(chunk_num, (1, 0), value=-1).cumsum(0)[1:]
        chunk_lengths[tail_chunk_index] = feature_lens % (self.n_window * 2)
        chunk_lengths[chunk_lengths == 0] = self.n_window * 2

        chunk_list = input_features.T.split(chunk_lengths.tolist(), dim=0)
        padded_feature = nn.utils.rnn.pad_sequence(chunk_list, batch_first=True).transpose(1, 2)
        feature_lens_after_cnn = _get_feat_extract_output_lengths(chunk_lengths, self.n_window)
        padded_mask_after_cnn = nn.utils.rnn.pad_sequence(
            [torch.ones(int(length), dtype=torch.bool, device=padded_feature.device)
             for length in feature_lens_after_cnn],
            batch_first=True,
        )
        padded_feature = padded_feature.unsqueeze(1)
        padded_embeds = []
        for chunk in padded_feature.split(self.conv_chunksize, dim=0):
            padded_embed = F.gelu(self.conv2d1(chunk))
            padded_embed = F.gelu(self.conv2d2(padded_embed))
            padded_embed = F.gelu(self.conv2d3(padded_embed))
            padded_embeds.append(padded_embed)
        padded_embed = torch.cat(padded_embeds, dim=0)
        b, c, f, t = padded_embed.size()
        padded_embed = self.conv_out(padded_embed.permute(0, 3, 1, 2).contiguous().view(b, t, c * f))

        positional_embedding = (
            self.positional_embedding.positional_embedding[: padded_embed.shape[1], :]
            .unsqueeze(0)
            .to(padded_embed.dtype)
        )
        padded_embed = padded_embed + positional_embedding
        hidden_states = padded_embed[padded_mask_after_cnn]
        cu_chunk_lens = [0]
        window_aftercnn = padded_mask_after_cnn.shape[-1] * (self.n_window_infer // (self.n_window * 2))
        for cnn_len in aftercnn_lens:
            cu_chunk_lens += [window_aftercnn] * int(cnn_len // window_aftercnn)
            remainder = int(cnn_len % window_aftercnn)
            if remainder != 0:
                cu_chunk_lens += [remainder]
        cu_seqlens = torch.tensor(cu_chunk_lens, device=aftercnn_lens.device).cumsum(-1, dtype=torch.int32)

        for encoder_layer in self.layers:
            layer_outputs = encoder_layer(hidden_states, cu_seqlens)
            hidden_states = layer_outputs[0]

        hidden_states = self.ln_post(hidden_states)
        hidden_states = self.proj1(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.proj2(hidden_states)
        return hidden_states, aftercnn_lens, cu_seqlens


def main():
    torch.manual_seed(0)
    # UniRL's replay loads the thinker with the trainer's attention implementation;
    # the audio tower inherits it.
    attn_implementation = "flash_attention_2" if FIXED else "sdpa"
    config = Qwen3OmniMoeAudioEncoderConfig(attn_implementation)
    audio_tower = Qwen3OmniMoeAudioEncoder(config).eval()

    # Two clips of a rollout batch, log-mel (num_mel_bins, frames), concatenated on the time axis
    # the way Qwen3OmniMoeThinker.get_audio_features hands them over (feature_attention_mask applied).
    feature_lens = torch.tensor([100, 56])
    mels = [torch.randn(config.num_mel_bins, int(n)) for n in feature_lens]
    input_features = torch.cat(mels, dim=1)

    with torch.no_grad():
        audio_embeds, aftercnn_lens, cu_seqlens = audio_tower(input_features, feature_lens=feature_lens)

    print("attn_implementation:", attn_implementation)
    print("audio tokens per clip:", aftercnn_lens.tolist(), " cu_seqlens:", cu_seqlens.tolist())
    print("audio_embeds:", tuple(audio_embeds.shape), " sum: %.6f" % audio_embeds.sum().item())
    for i, emb in enumerate(audio_embeds.split(aftercnn_lens.tolist(), dim=0)):
        print("clip %d: mean %.6f  first token[:3] %s" % (i, emb.mean().item(),
                                                           [round(x, 5) for x in emb[0, :3].tolist()]))


if __name__ == "__main__":
    main()
