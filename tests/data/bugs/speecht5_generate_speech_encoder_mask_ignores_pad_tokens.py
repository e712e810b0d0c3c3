"""SpeechT5 TTS: ``_generate_speech`` builds an all-ones encoder mask, so padded text is attended.

Citation: huggingface/transformers#25908 ("SpeechT5 TTS wrong attention mask handling when padding
the input text"), fixed by PR #25943 ("Add speecht5 batch generation and fix wrong attention mask
when padding"). The issue/PR threads were read; the pre-fix line ``encoder_attention_mask =
torch.ones_like(input_values)`` was read in stored copies of the old ``_generate_speech`` and the
fixed lines in the installed transformers ``modeling_speecht5.py``.

Bug: ``_generate_speech(model, input_values, ...)`` set ``encoder_attention_mask =
torch.ones_like(input_values)``: the text padded with ``config.pad_token_id`` (1) to a fixed
length was attended by the encoder self-attention and by every decoder step's cross-attention,
so the generated spectrogram changed with the amount of padding.
Fix: ``encoder_attention_mask = 1 - (input_values == model.config.pad_token_id).int()`` (or the
caller's ``attention_mask``), passed to the encoder and to the decoder cross-attention.

Reproduction: plain-torch rendering of the text encoder (one layer) and the autoregressive
decoder (one layer, self-attention over the cached frames, cross-attention to the encoder),
both eager softmax over q @ k^T plus the additive ``_expand_mask`` bias; hyper-parameters held
in transformers' ``SpeechT5Config`` (config object only, random weights). A 5-token text padded
to 9 with pad_token_id is decoded for 4 frames and compared with the unpadded text.
"""
import sys

import torch
import torch.nn as nn
from transformers import SpeechT5Config

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _expand_mask(mask, dtype, tgt_len=None):
    """[bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len] additive bias."""
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


class SpeechT5Attention(nn.Module):
    def __init__(self, embed_dim, num_heads, is_decoder=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, past_key_value=None, attention_mask=None):
        is_cross_attention = key_value_states is not None
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self._shape(self.q_proj(hidden_states) * self.scaling, tgt_len, bsz)
        if is_cross_attention and past_key_value is not None:
            key_states, value_states = past_key_value
        elif is_cross_attention:
            key_states = self._shape(self.k_proj(key_value_states), -1, bsz)
            value_states = self._shape(self.v_proj(key_value_states), -1, bsz)
        elif past_key_value is not None:
            key_states = torch.cat([past_key_value[0], self._shape(self.k_proj(hidden_states), -1, bsz)], dim=2)
            value_states = torch.cat([past_key_value[1], self._shape(self.v_proj(hidden_states), -1, bsz)], dim=2)
        else:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        past_key_value = (key_states, value_states) if self.is_decoder else None

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, -1)
        return self.out_proj(attn_output), past_key_value


class SpeechT5EncoderWithTextPrenet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.embed_positions = nn.Embedding(64, config.hidden_size)
        self.attention = SpeechT5Attention(config.hidden_size, config.encoder_attention_heads)
        self.layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_values, attention_mask):
        positions = torch.arange(input_values.shape[1])
        hidden_states = self.embed_tokens(input_values) + self.embed_positions(positions)
        extended = _expand_mask(attention_mask, hidden_states.dtype)
        out, _ = self.attention(hidden_states, attention_mask=extended)
        return self.layer_norm(hidden_states + out)


class SpeechT5DecoderWithSpeechPrenet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.prenet = nn.Linear(config.num_mel_bins, config.hidden_size)
        self.self_attn = SpeechT5Attention(config.hidden_size, config.decoder_attention_heads, is_decoder=True)
        self.encoder_attn = SpeechT5Attention(config.hidden_size, config.decoder_attention_heads, is_decoder=True)
        self.feat_out = nn.Linear(config.hidden_size, config.num_mel_bins * config.reduction_factor)

    def forward(self, output_sequence, encoder_hidden_states, encoder_attention_mask, past_key_values):
        hidden_states = self.prenet(output_sequence[:, -1:])
        self_past, cross_past = past_key_values if past_key_values is not None else (None, None)
        out, self_past = self.self_attn(hidden_states, past_key_value=self_past)
        hidden_states = hidden_states + out
        cross_mask = _expand_mask(encoder_attention_mask, hidden_states.dtype, tgt_len=1)
        out, cross_past = self.encoder_attn(
            hidden_states, key_value_states=encoder_hidden_states, past_key_value=cross_past, attention_mask=cross_mask
        )
        hidden_states = hidden_states + out
        return hidden_states, (self_past, cross_past)


class SpeechT5ForTextToSpeech(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.encoder = SpeechT5EncoderWithTextPrenet(config)
        self.decoder = SpeechT5DecoderWithSpeechPrenet(config)


def _generate_speech(model, input_values, attention_mask=None, num_frames=4):
    if FIXED:
        if attention_mask is None:
            encoder_attention_mask = 1 - (input_values == model.config.pad_token_id).int()
        else:
            encoder_attention_mask = attention_mask
    else:
        encoder_attention_mask = torch.ones_like(input_values)

    encoder_last_hidden_state = model.encoder(input_values, attention_mask=encoder_attention_mask)
    bsz = input_values.size(0)
    output_sequence = encoder_last_hidden_state.new_zeros(bsz, 1, model.config.num_mel_bins)
    spectrogram = []
    past_key_values = None
    for _ in range(num_frames):
        last_decoder_output, past_key_values = model.decoder(
            output_sequence, encoder_last_hidden_state, encoder_attention_mask, past_key_values
        )
        spectrum = model.decoder.feat_out(last_decoder_output[:, -1])
        spectrum = spectrum.view(bsz, model.config.reduction_factor, model.config.num_mel_bins)
        spectrogram.append(spectrum)
        output_sequence = torch.cat((output_sequence, spectrum[:, -1:, :]), dim=1)
    return torch.cat(spectrogram, dim=1)


if __name__ == "__main__":
    config = SpeechT5Config(
        vocab_size=40, hidden_size=32, encoder_attention_heads=4, decoder_attention_heads=4,
        num_mel_bins=8, reduction_factor=2, pad_token_id=1,
    )
    model = SpeechT5ForTextToSpeech(config).eval()
    text = torch.tensor([[4, 9, 13, 22, 2]])  # ends with </s>
    padded = torch.cat([text, torch.full((1, 4), config.pad_token_id)], dim=1)  # padding="max_length"
    with torch.no_grad():
        ref = _generate_speech(model, text)
        out = _generate_speech(model, padded)
    print("fixed" if FIXED else "buggy", "padded vs unpadded spectrogram max diff:", f"{(out - ref).abs().max().item():.4f}")
