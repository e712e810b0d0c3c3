"""wav2vec 2.0 encoder: a padding mask given in audio samples, reduced to conv frames, then additive.

Follows huggingface/transformers src/transformers/models/wav2vec2/modeling_wav2vec2.py
(Wav2Vec2PreTrainedModel._get_feat_extract_output_lengths, _get_feature_vector_attention_mask,
Wav2Vec2Encoder.forward, eager attention), written as plain torch with the project's names; the
additive mask is the explicit `(1.0 - mask) * finfo.min` form of the pre-masking_utils versions
(transformers 5.x builds the same bidirectional padding mask with create_bidirectional_mask).
Three utterances of 4000, 2600 and 1300 samples are zero-padded to 4000; `attention_mask` is per
sample. The conv feature encoder (kernels 10,3,3,3,3,2,2; strides 5,2,2,2,2,2,2) turns 4000 samples
into 12 frames; each utterance's frame count comes from the conv length formula, and the frame mask
is built by marking the last valid frame and flip-cumsum-flip. The encoder zeroes padded frames and
adds (1 - mask) * finfo.min over keys, bidirectional.
Mask meant: bidirectional over each utterance's real frames (12, 7 and 3 frames); padded frame keys
get finfo(float32).min; padded query rows are computed and ignored.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Wav2Vec2Config:
    conv_dim: tuple = (32, 32, 32, 32, 32, 32, 32)
    conv_kernel: tuple = (10, 3, 3, 3, 3, 2, 2)
    conv_stride: tuple = (5, 2, 2, 2, 2, 2, 2)
    hidden_size: int = 48
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    intermediate_size: int = 96


class Wav2Vec2FeatureEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        layers, in_dim = [], 1
        for dim, k, s in zip(config.conv_dim, config.conv_kernel, config.conv_stride):
            layers.append(nn.Conv1d(in_dim, dim, kernel_size=k, stride=s, bias=False))
            in_dim = dim
        self.conv_layers = nn.ModuleList(layers)

    def forward(self, input_values):
        hidden_states = input_values[:, None]
        for conv in self.conv_layers:
            hidden_states = F.gelu(conv(hidden_states))
        return hidden_states


class Wav2Vec2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.shape
        shape = (bsz, tgt_len, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, tgt_len, -1)
        return self.out_proj(out)


class Wav2Vec2EncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = Wav2Vec2Attention(config)
        self.layer_norm = nn.LayerNorm(config.hidden_size)
        self.feed_forward = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                          nn.Linear(config.intermediate_size, config.hidden_size))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = self.layer_norm(hidden_states + self.attention(hidden_states, attention_mask))
        return self.final_layer_norm(hidden_states + self.feed_forward(hidden_states))


class Wav2Vec2Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer_norm = nn.LayerNorm(config.hidden_size)
        self.layers = nn.ModuleList([Wav2Vec2EncoderLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask=None):
        if attention_mask is not None:
            expand_attention_mask = attention_mask.unsqueeze(-1).repeat(1, 1, hidden_states.shape[2])
            # make sure padded tokens output 0
            hidden_states = hidden_states.masked_fill(~expand_attention_mask, 0.0)
            attention_mask = 1.0 - attention_mask[:, None, None, :].to(dtype=hidden_states.dtype)
            attention_mask = attention_mask * torch.finfo(hidden_states.dtype).min
            attention_mask = attention_mask.expand(attention_mask.shape[0], 1, attention_mask.shape[-1],
                                                   attention_mask.shape[-1])
        hidden_states = self.layer_norm(hidden_states)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=attention_mask)
        return hidden_states


class Wav2Vec2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.feature_extractor = Wav2Vec2FeatureEncoder(config)
        self.feature_projection = nn.Linear(config.conv_dim[-1], config.hidden_size)
        self.encoder = Wav2Vec2Encoder(config)

    def _get_feat_extract_output_lengths(self, input_lengths):
        def _conv_out_length(input_length, kernel_size, stride):
            return torch.div(input_length - kernel_size, stride, rounding_mode="floor") + 1

        for kernel_size, stride in zip(self.config.conv_kernel, self.config.conv_stride):
            input_lengths = _conv_out_length(input_lengths, kernel_size, stride)
        return input_lengths

    def _get_feature_vector_attention_mask(self, feature_vector_length, attention_mask):
        non_padded_lengths = attention_mask.cumsum(dim=-1)[:, -1]
        output_lengths = self._get_feat_extract_output_lengths(non_padded_lengths).to(torch.long)
        batch_size = attention_mask.shape[0]
        attention_mask = torch.zeros((batch_size, feature_vector_length), dtype=attention_mask.dtype)
        # these two operations makes sure that all values before the output lengths idxs are attended to
        attention_mask[(torch.arange(batch_size), output_lengths - 1)] = 1
        return attention_mask.flip([-1]).cumsum(-1).flip([-1]).bool()

    def forward(self, input_values, attention_mask=None):
        extract_features = self.feature_extractor(input_values).transpose(1, 2)
        if attention_mask is not None:
            attention_mask = self._get_feature_vector_attention_mask(extract_features.shape[1], attention_mask)
        hidden_states = self.feature_projection(extract_features)
        return self.encoder(hidden_states, attention_mask=attention_mask), attention_mask


if __name__ == "__main__":
    torch.manual_seed(0)
    config = Wav2Vec2Config()
    model = Wav2Vec2Model(config).eval()
    lengths = torch.tensor([4000, 2600, 1300])
    input_values = torch.randn(3, 4000)
    attention_mask = (torch.arange(4000)[None, :] < lengths[:, None]).long()
    input_values = input_values * attention_mask  # the feature extractor pads with zeros
    with torch.no_grad():
        last_hidden_state, frame_mask = model(input_values, attention_mask=attention_mask)
    print("last_hidden_state", tuple(last_hidden_state.shape), "frames", frame_mask.sum(-1).tolist())
