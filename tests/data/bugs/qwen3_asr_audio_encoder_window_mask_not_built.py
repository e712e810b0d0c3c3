"""Qwen3-ASR audio encoder: windowed attention (cu_seqlens) is applied only by flash_attention_2.

Citation: QwenLM/Qwen3-ASR#103 ("Fix: audio encoder uses full attention instead of windowed on
non-FA2 backends", PR) and QwenLM/Qwen3-ASR#213 (issue with measurements). Code follows
qwen_asr/core/transformers_backend/modeling_qwen3_asr.py as stored upstream.

Bug: Qwen3ASRAudioEncoder.forward packs every utterance's encoder tokens into one sequence and
computes ``cu_seqlens`` for the ``n_window_infer`` attention windows, but calls each layer as
``encoder_layer(hidden_states, cu_seqlens)``. Only FA2's varlen path reads cu_seqlens; with
sdpa/eager the attention mask is None, so every token attends to every other packed token --
across windows and even across different utterances of the batch.
``_prepare_attention_mask`` (block-diagonal over cu_seqlens) was defined and never called.

Fix: ``attention_mask = self._prepare_attention_mask(hidden_states, cu_seqlens)`` and pass it to
every encoder layer.

This program: config scaled down (n_window=8 -> 16-frame conv chunks of 2 tokens,
n_window_infer=64 -> 8-token windows), a batch of two utterances with 100 and 56 mel frames
(13 and 7 tokens; cu_seqlens [0, 8, 13, 20]), attention through F.scaled_dot_product_attention
as transformers' sdpa integration calls it. ``_get_feat_extract_output_lengths`` is the plain
three-conv length formula (upstream hard-codes it for 100-frame chunks).
"""
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class Qwen3ASRAudioEncoderConfig:
    num_mel_bins: int = 16
    d_model: int = 32
    encoder_layers: int = 2
    encoder_attention_heads: int = 4
    encoder_ffn_dim: int = 64
    downsample_hidden_size: int = 8
    output_dim: int = 32
    max_source_positions: int = 256
    n_window: int = 8
    n_window_infer: int = 64
    conv_chunksize: int = 500
    _attn_implementation: str = "sdpa"


def _get_feat_extract_output_lengths(input_lengths):
    # three stride-2, padding-1, kernel-3 convolutions
    for _ in range(3):
        input_lengths = (input_lengths - 1) // 2 + 1
    return input_lengths


def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           is_causal=None, **kwargs):
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    attn_output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                 dropout_p=dropout, scale=scaling, is_causal=is_causal)
    return attn_output.transpose(1, 2).contiguous(), None


class Qwen3ASRAudioAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_dim = config.d_model
        self.num_heads = config.encoder_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.is_causal = False
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def forward(self, hidden_states, cu_seqlens=None, attention_mask=None, **kwargs):
        seq_length, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).reshape(seq_length, self.num_heads, -1).transpose(0, 1).unsqueeze(0)
        key_states = self.k_proj(hidden_states).reshape(seq_length, self.num_heads, -1).transpose(0, 1).unsqueeze(0)
        value_states = self.v_proj(hidden_states).reshape(seq_length, self.num_heads, -1).transpose(0, 1).unsqueeze(0)
        max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
        attn_output, _ = sdpa_attention_forward(
            self, query_states, key_states, value_states, attention_mask=attention_mask,
            scaling=self.scaling, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
            max_length_q=max_seqlen, max_length_k=max_seqlen, is_causal=False,
        )
        return self.out_proj(attn_output.reshape(seq_length, -1).contiguous())


class Qwen3ASRAudioEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Qwen3ASRAudioAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, hidden_states, cu_seqlens, attention_mask=None, **kwargs):
        residual = hidden_states
        hidden_states = self.self_attn(self.self_attn_layer_norm(hidden_states), cu_seqlens=cu_seqlens,
                                       attention_mask=attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden_states))))
        return (residual + hidden_states,)


class Qwen3ASRAudioEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.n_window = config.n_window
        self.n_window_infer = config.n_window_infer
        self.conv_chunksize = config.conv_chunksize
        self.layers = nn.ModuleList(Qwen3ASRAudioEncoderLayer(config) for _ in range(config.encoder_layers))
        self.ln_post = nn.LayerNorm(config.d_model)
        h = config.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, h, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(h, h, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(h, h, 3, 2, padding=1)
        self.conv_out = nn.Linear(h * ((((config.num_mel_bins + 1) // 2 + 1) // 2 + 1) // 2), config.d_model, bias=False)
        pos = torch.arange(config.max_source_positions)[:, None] / (10000 ** (torch.arange(config.d_model // 2) / (config.d_model // 2 - 1)))
        self.register_buffer("positional_embedding", torch.cat([pos.sin(), pos.cos()], dim=1), persistent=False)

    def _prepare_attention_mask(self, inputs_tensor, cu_seqlens):
        # Flash Attention 2 doesn't need a 4D mask and relies on `cu_seqlens/max_seqlen`
        if self.config._attn_implementation == "flash_attention_2":
            return None
        seq_length = inputs_tensor.shape[0]
        attention_mask = torch.full([1, 1, seq_length, seq_length], torch.finfo(inputs_tensor.dtype).min,
                                    dtype=inputs_tensor.dtype)
        for i in range(1, len(cu_seqlens)):
            attention_mask[..., cu_seqlens[i - 1]:cu_seqlens[i], cu_seqlens[i - 1]:cu_seqlens[i]] = 0
        return attention_mask

    def forward(self, input_features, feature_lens=None):
        aftercnn_lens = _get_feat_extract_output_lengths(feature_lens)
        chunk_num = torch.ceil(feature_lens / (self.n_window * 2)).long()
        chunk_lengths = torch.tensor([self.n_window * 2] * chunk_num.sum(), dtype=torch.long)
        tail_chunk_index = F.pad(chunk_num, (1, 0), value=-1).cumsum(0)[1:]
        chunk_lengths[tail_chunk_index] = feature_lens % (self.n_window * 2)
        chunk_lengths[chunk_lengths == 0] = self.n_window * 2
        chunk_list = input_features.T.split(chunk_lengths.tolist(), dim=0)
        padded_feature = nn.utils.rnn.pad_sequence(chunk_list, batch_first=True).transpose(1, 2)
        feature_lens_after_cnn = _get_feat_extract_output_lengths(chunk_lengths)
        padded_mask_after_cnn = nn.utils.rnn.pad_sequence(
            [torch.ones(int(n), dtype=torch.bool) for n in feature_lens_after_cnn], batch_first=True)
        padded_embed = F.gelu(self.conv2d1(padded_feature.unsqueeze(1)))
        padded_embed = F.gelu(self.conv2d2(padded_embed))
        padded_embed = F.gelu(self.conv2d3(padded_embed))
        b, c, f, t = padded_embed.size()
        padded_embed = self.conv_out(padded_embed.permute(0, 3, 1, 2).contiguous().view(b, t, c * f))
        padded_embed = padded_embed + self.positional_embedding[: padded_embed.shape[1], :].unsqueeze(0)
        hidden_states = padded_embed[padded_mask_after_cnn]
        cu_chunk_lens = [0]
        window_aftercnn = padded_mask_after_cnn.shape[-1] * (self.n_window_infer // (self.n_window * 2))
        for cnn_len in aftercnn_lens.tolist():
            cu_chunk_lens += [window_aftercnn] * (cnn_len // window_aftercnn)
            remainder = cnn_len % window_aftercnn
            if remainder != 0:
                cu_chunk_lens += [remainder]
        cu_seqlens = torch.tensor(cu_chunk_lens).cumsum(-1, dtype=torch.int32)
        attention_mask = self._prepare_attention_mask(hidden_states, cu_seqlens) if FIXED else None
        for encoder_layer in self.layers:
            if FIXED:
                layer_outputs = encoder_layer(hidden_states, cu_seqlens, attention_mask=attention_mask)
            else:
                layer_outputs = encoder_layer(hidden_states, cu_seqlens)
            hidden_states = layer_outputs[0]
        return self.ln_post(hidden_states), cu_seqlens


def main():
    torch.manual_seed(0)
    config = Qwen3ASRAudioEncoderConfig()
    encoder = Qwen3ASRAudioEncoder(config).eval()
    feature_lens = torch.tensor([100, 56])
    input_features = torch.randn(config.num_mel_bins, int(feature_lens.sum()))  # mels of both clips, concatenated
    with torch.no_grad():
        hidden, cu_seqlens = encoder(input_features, feature_lens)
    print(f"cu_seqlens {cu_seqlens.tolist()} encoder tokens {hidden.shape[0]} norm {hidden.norm():.4f}")


if __name__ == "__main__":
    main()
