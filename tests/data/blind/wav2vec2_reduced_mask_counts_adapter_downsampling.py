"""Wav2Vec2 (Flax) computed the encoder's frame mask with the adapter's downsampling included.

Citation: huggingface/transformers PR #16725 ("[FlaxWav2Vec2Model] Fix bug in attention mask",
merged; description read), mirrored in sanchit-gandhi/seq2seq-speech PR #9.  The Flax code is
ported to torch here (jnp.at[].set / flip-cumsum written with torch ops).

Bug: FlaxWav2Vec2Module reduced the sample-level `attention_mask` to the feature frames with
`self._get_feature_vector_attention_mask(extract_features.shape[1], attention_mask)`, leaving
`add_adapter=None`.  `_get_feat_extract_output_lengths` then falls back to
`config.add_adapter`, and when the model has an adapter (speech encoder-decoder fine-tuning)
the lengths are also divided by the adapter's strides — but that mask is consumed by the
*encoder*, which runs before the adapter on the full frame rate.  Most real frames of every
utterance are masked out of self-attention.
Fix (PR #16725): pass `add_adapter=False`, as the PyTorch model does.

Reproduction: a small Wav2Vec2 (conv feature extractor with kernels (10, 3, 3) / strides
(5, 2, 2), one encoder layer with eager softmax attention, 3-layer stride-2 adapter), a batch of
two waveforms of 400 and 300 samples (the second zero-padded, `attention_mask` 0 there).
Encoder frames: 19 and 14 real; the buggy mask keeps 3 and 2.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class Wav2Vec2Config:
    hidden_size: int = 32
    num_attention_heads: int = 4
    intermediate_size: int = 64
    conv_dim: tuple = (16, 16, 16)
    conv_kernel: tuple = (10, 3, 3)
    conv_stride: tuple = (5, 2, 2)
    add_adapter: bool = True
    num_adapter_layers: int = 3
    adapter_kernel_size: int = 3
    adapter_stride: int = 2
    output_hidden_size: int = 32


class Wav2Vec2FeatureEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        dims = (1,) + tuple(config.conv_dim)
        self.conv_layers = nn.ModuleList([
            nn.Conv1d(dims[i], dims[i + 1], config.conv_kernel[i], stride=config.conv_stride[i])
            for i in range(len(config.conv_kernel))
        ])

    def forward(self, input_values):
        hidden_states = input_values[:, None]
        for conv in self.conv_layers:
            hidden_states = F.gelu(conv(hidden_states))
        return hidden_states.transpose(1, 2)  # (batch, frames, conv_dim[-1])


class Wav2Vec2Attention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _split_heads(self, hidden_states):
        return hidden_states.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def forward(self, hidden_states, attention_mask=None):
        query_states = self._split_heads(self.q_proj(hidden_states)) * self.head_dim ** -0.5
        key_states = self._split_heads(self.k_proj(hidden_states))
        value_states = self._split_heads(self.v_proj(hidden_states))
        attention_bias = None
        if attention_mask is not None:
            attention_bias = torch.where(attention_mask > 0, 0.0, torch.finfo(torch.float32).min)
        attn_weights = query_states @ key_states.transpose(-1, -2)
        if attention_bias is not None:
            attn_weights = attn_weights + attention_bias
        attn_weights = attn_weights.softmax(dim=-1)
        attn_output = (attn_weights @ value_states).transpose(1, 2).flatten(-2)
        return self.out_proj(attn_output)


class Wav2Vec2EncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = Wav2Vec2Attention(config.hidden_size, config.num_attention_heads)
        self.layer_norm = nn.LayerNorm(config.hidden_size)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = self.layer_norm(hidden_states + self.attention(hidden_states, attention_mask))
        return self.final_layer_norm(hidden_states + self.output(F.gelu(self.intermediate(hidden_states))))


class Wav2Vec2Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer_norm = nn.LayerNorm(config.hidden_size)
        self.layers = nn.ModuleList([Wav2Vec2EncoderLayer(config)])

    def forward(self, hidden_states, attention_mask=None):
        if attention_mask is not None:
            # make sure padded tokens are not attended to
            hidden_states = torch.where(attention_mask[:, :, None].expand_as(hidden_states), hidden_states, 0)
            attention_mask = attention_mask[:, None, None, :]  # expand_dims(axis=(-3, -2))
        hidden_states = self.layer_norm(hidden_states)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=attention_mask)
        return hidden_states


class Wav2Vec2Adapter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([
            nn.Conv1d(config.output_hidden_size, 2 * config.output_hidden_size, config.adapter_kernel_size,
                      stride=config.adapter_stride, padding=1)
            for _ in range(config.num_adapter_layers)
        ])

    def forward(self, hidden_states):
        hidden_states = hidden_states.transpose(1, 2)
        for layer in self.layers:
            hidden_states = F.glu(layer(hidden_states), dim=1)
        return hidden_states.transpose(1, 2)


class Wav2Vec2Model(nn.Module):
    def __init__(self, config: Wav2Vec2Config):
        super().__init__()
        self.config = config
        self.feature_extractor = Wav2Vec2FeatureEncoder(config)
        self.feature_projection = nn.Sequential(nn.LayerNorm(config.conv_dim[-1]),
                                                nn.Linear(config.conv_dim[-1], config.hidden_size))
        self.encoder = Wav2Vec2Encoder(config)
        self.adapter = Wav2Vec2Adapter(config) if config.add_adapter else None

    def _get_feat_extract_output_lengths(self, input_lengths, add_adapter=None):
        """Computes the output length of the convolutional layers"""
        add_adapter = self.config.add_adapter if add_adapter is None else add_adapter

        def _conv_out_length(input_length, kernel_size, stride):
            return (input_length - kernel_size) // stride + 1

        for kernel_size, stride in zip(self.config.conv_kernel, self.config.conv_stride):
            input_lengths = _conv_out_length(input_lengths, kernel_size, stride)
        if add_adapter:
            for _ in range(self.config.num_adapter_layers):
                input_lengths = _conv_out_length(input_lengths, 1, self.config.adapter_stride)
        return input_lengths

    def _get_feature_vector_attention_mask(self, feature_vector_length, attention_mask, add_adapter=None):
        # Effectively attention_mask.sum(-1), but not inplace to be able to run on inference mode.
        non_padded_lengths = attention_mask.cumsum(dim=-1)[:, -1]
        output_lengths = self._get_feat_extract_output_lengths(non_padded_lengths, add_adapter=add_adapter)
        batch_size = attention_mask.shape[0]
        attention_mask = torch.zeros((batch_size, feature_vector_length), dtype=attention_mask.dtype)
        # these two operations makes sure that all values before the output lengths indices are attended to
        attention_mask[torch.arange(batch_size), output_lengths - 1] = 1
        attention_mask = attention_mask.flip(-1).cumsum(-1).flip(-1).bool()
        return attention_mask

    def forward(self, input_values, attention_mask=None):
        extract_features = self.feature_extractor(input_values)
        # make sure that no loss is computed on padded inputs
        if attention_mask is not None:
            # compute reduced attention_mask corresponding to feature vectors
            if FIXED:
                attention_mask = self._get_feature_vector_attention_mask(
                    extract_features.shape[1], attention_mask, add_adapter=False)
            else:
                attention_mask = self._get_feature_vector_attention_mask(extract_features.shape[1], attention_mask)
        hidden_states = self.feature_projection(extract_features)
        hidden_states = self.encoder(hidden_states, attention_mask=attention_mask)
        if self.adapter is not None:
            hidden_states = self.adapter(hidden_states)
        return hidden_states, attention_mask


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Wav2Vec2Model(Wav2Vec2Config()).eval()
    input_values = torch.randn(2, 400)
    input_values[1, 300:] = 0.0
    attention_mask = torch.ones(2, 400, dtype=torch.long)
    attention_mask[1, 300:] = 0
    with torch.no_grad():
        hidden_states, frame_mask = model(input_values, attention_mask=attention_mask)
    print(f"encoder frames kept per utterance: {frame_mask.sum(-1).tolist()}, "
          f"adapter output sum {hidden_states.sum().item():.4f}")
