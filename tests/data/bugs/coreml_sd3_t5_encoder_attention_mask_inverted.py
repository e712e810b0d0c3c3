"""apple/ml-stable-diffusion SD3 Swift pipeline: the T5 text encoder's attention_mask was inverted.

Citation: apple/ml-stable-diffusion PR #359 ("Fix invalid mask implementation", description and review
thread read). The stored copy of ``swift/StableDiffusion/pipeline/TextEncoderT5.swift`` (commit 38af821)
already has the fixed lines; I did not read which commit landed them.

Bug: ``TextEncoderT5.encode(ids:)`` feeds the Core ML conversion of Hugging Face's T5 encoder an
``attention_mask`` it builds itself from the padded ids. It wrote
``token == padToken ? maskToken : padToken`` with ``padToken = bosTokenId ?? 0`` and
``maskToken = eosTokenId ?? 1``, then ``attentionMask[0] = bosToken``: 1 at padding, 0 at the prompt, the
opposite of the tokenizer convention the converted model was traced with. Every prompt token attended
only to the padding.

Fix: ``token == padToken ? padToken : maskToken`` and ``attentionMask[0] = eosToken`` (1 for the prompt and
its eos, 0 for padding).

Reproduction: the Swift ``encode(ids:)`` re-written in Python line by line, and a small T5 encoder written
as Hugging Face's ``T5EncoderModel`` computes it (the model the Core ML package was converted from:
relative position bias plus the extended mask ``(1 - attention_mask) * finfo.min`` added to the scores,
softmax), random weights; plain torch because importing transformers alone takes longer than this
program may run. T5 has no bos token, so bosTokenId is nil and falls back to 0 = its pad id, as in the
app. The input length is the Core ML model's fixed input shape.
"""
import sys

import math
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class T5Config:
    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    pad_token_id: int = 0
    eos_token_id: int = 1


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)


class T5Attention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.n_heads = config.num_heads
        self.key_value_proj_dim = config.d_kv
        self.inner_dim = config.num_heads * config.d_kv
        self.relative_attention_num_buckets = config.relative_attention_num_buckets
        self.relative_attention_max_distance = config.relative_attention_max_distance
        self.has_relative_attention_bias = has_relative_attention_bias
        self.q = nn.Linear(config.d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(config.d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(config.d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, config.d_model, bias=False)
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.relative_attention_num_buckets, self.n_heads)

    @staticmethod
    def _relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
        # bidirectional buckets, as in the encoder
        num_buckets //= 2
        relative_buckets = (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
        max_exact = num_buckets // 2
        is_small = relative_position < max_exact
        relative_position_if_large = max_exact + (
            torch.log(relative_position.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.long)
        relative_position_if_large = torch.min(
            relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
        )
        return relative_buckets + torch.where(is_small, relative_position, relative_position_if_large)

    def compute_bias(self, query_length, key_length):
        context_position = torch.arange(query_length, dtype=torch.long)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long)[None, :]
        relative_position_bucket = self._relative_position_bucket(
            memory_position - context_position,
            num_buckets=self.relative_attention_num_buckets,
            max_distance=self.relative_attention_max_distance,
        )
        values = self.relative_attention_bias(relative_position_bucket)
        return values.permute([2, 0, 1]).unsqueeze(0)

    def forward(self, hidden_states, mask=None, position_bias=None):
        batch_size, seq_length = hidden_states.shape[:2]
        shape = (batch_size, -1, self.n_heads, self.key_value_proj_dim)
        query_states = self.q(hidden_states).view(shape).transpose(1, 2)
        key_states = self.k(hidden_states).view(shape).transpose(1, 2)
        value_states = self.v(hidden_states).view(shape).transpose(1, 2)
        scores = torch.matmul(query_states, key_states.transpose(3, 2))
        if position_bias is None:
            position_bias = self.compute_bias(seq_length, seq_length)
            if mask is not None:
                position_bias = position_bias + mask  # (batch_size, n_heads, seq_length, key_length)
        scores += position_bias
        attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().view(batch_size, -1, self.inner_dim)
        return self.o(attn_output), position_bias


class T5Block(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.SelfAttention = T5Attention(config, has_relative_attention_bias)
        self.ff_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        attn, position_bias = self.SelfAttention(self.layer_norm(hidden_states), attention_mask, position_bias)
        hidden_states = hidden_states + attn
        hidden_states = hidden_states + self.wo(torch.relu(self.wi(self.ff_norm(hidden_states))))
        return hidden_states, position_bias


class T5EncoderModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.block = nn.ModuleList([T5Block(config, has_relative_attention_bias=bool(i == 0))
                                    for i in range(config.num_layers)])
        self.final_layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, attention_mask):
        hidden_states = self.shared(input_ids)
        dtype = hidden_states.dtype
        # get_extended_attention_mask: 1 keeps a key, 0 hides it
        extended_attention_mask = attention_mask[:, None, None, :].to(dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * torch.finfo(dtype).min
        position_bias = None
        for layer_module in self.block:
            hidden_states, position_bias = layer_module(hidden_states, extended_attention_mask, position_bias)
        return self.final_layer_norm(hidden_states)


class Tokenizer:
    """What the Swift pipeline reads from the T5 tokenizer: no bos token, eos id 1."""

    bosTokenId = None
    eosTokenId = 1


class TextEncoderT5:
    def __init__(self, tokenizer, model, input_shape):
        self.tokenizer = tokenizer
        self.model = model
        self.inputShape = input_shape  # the converted model's fixed input shape

    def encode(self, ids):
        inputShape = self.inputShape
        inputLength = inputShape[1]

        bosToken = self.tokenizer.bosTokenId if self.tokenizer.bosTokenId is not None else 0
        eosToken = self.tokenizer.eosTokenId if self.tokenizer.eosTokenId is not None else 1
        padToken = bosToken
        maskToken = eosToken

        # Truncate and pad input to the expected length
        truncatedIds = ids[: inputLength - 1] + [eosToken]
        inputIds = truncatedIds + [padToken] * (inputLength - len(truncatedIds))

        if FIXED:
            attentionMask = [padToken if token == padToken else maskToken for token in inputIds]
            attentionMask[0] = eosToken
        else:
            attentionMask = [maskToken if token == padToken else padToken for token in inputIds]
            attentionMask[0] = bosToken

        floatIds = torch.tensor(inputIds, dtype=torch.float32).reshape(inputShape)
        floatMask = torch.tensor(attentionMask, dtype=torch.float32).reshape(inputShape)
        # the Core ML model takes float inputs; the traced torch graph casts the ids back
        with torch.no_grad():
            out = self.model(input_ids=floatIds.long(), attention_mask=floatMask)
        return out


def main():
    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16)
    model = T5EncoderModel(config).eval()
    encoder = TextEncoderT5(Tokenizer(), model, input_shape=[1, 12])
    prompt_ids = [17, 23, 5, 40, 9]
    hidden = encoder.encode(prompt_ids)
    print("encoder_hidden_states[0, :3, 0]:", [round(v, 4) for v in hidden[0, :3, 0].tolist()])


if __name__ == "__main__":
    main()
