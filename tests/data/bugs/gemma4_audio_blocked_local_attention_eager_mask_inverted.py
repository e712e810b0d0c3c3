"""Gemma4 audio tower: blocked local attention applies the eager (additive) mask inverted.

Citation: huggingface/transformers#48818 "Gemma4 audio tower: attention mask inverted under eager attention
(uniform attention regardless of content)" (open issue), fix proposed in huggingface/transformers#48922
(open PR); read through their descriptions. ``Gemma4AudioModel.forward`` builds the audio mask with
``create_bidirectional_mask``, which gives sdpa/flex a bool mask (True = attend) but eager an additive
float mask (0.0 = attend, ``finfo.min`` = masked). The model passes it straight to
``_convert_4d_mask_to_blocked_5d`` (which pads with ``value=False``, i.e. 0.0 = *attend* for a float mask)
and ``Gemma4AudioAttention`` applies it with
``attn_weights.masked_fill(attention_mask.logical_not(), config.attention_invalid_logits_value)``: under
eager every allowed key gets the invalid logit and every masked one stays attendable.

Fix (the PR): turn the eager float mask back into the bool convention before blocking it, so the blocked
mask and the ``logical_not`` mean what they say.

This program: a config dataclass (``attention_chunk_size`` 4, ``attention_context_left`` 4 so three
past frames, ``attention_context_right`` 0, logit softcap, ``attention_invalid_logits_value``), a padded
batch (10 and 7 frames), the 4D mask (key padding and the local window) as create_bidirectional_mask
builds it for eager, the 4D -> blocked 5D conversion, and the chunked attention: query blocks of 4
against key contexts of 7, softcapped logits, mask, softmax. Buggy: frame 5 of the short row attends
frames 1, 6 and 7 (outside its window; 7 is padding); ``--fixed``: frames 2..5.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class Gemma4AudioConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    attention_chunk_size: int = 4
    attention_context_left: int = 4
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    _attn_implementation: str = "eager"


def create_bidirectional_mask(config, input_embeds, attention_mask, and_mask):
    allowed = attention_mask[:, None, None, :].bool() & and_mask[None, None]
    if config._attn_implementation != "eager":
        return allowed
    return torch.zeros(allowed.shape, dtype=input_embeds.dtype).masked_fill(~allowed, torch.finfo(input_embeds.dtype).min)


def _convert_4d_mask_to_blocked_5d(mask, chunk_size, max_past_horizon, max_future_horizon):
    """(b, 1, t, t) -> (b, 1, num_blocks, chunk_size, context_size), key windows aligned with the blocks."""
    b, _, t, _ = mask.shape
    num_blocks = (t + chunk_size - 1) // chunk_size
    pad_t = num_blocks * chunk_size - t
    context_size = chunk_size + max_past_horizon + max_future_horizon
    mask = F.pad(mask, (max_past_horizon, max_future_horizon + pad_t, 0, pad_t), value=False)
    blocks = [
        mask[:, :, n * chunk_size:(n + 1) * chunk_size, n * chunk_size:n * chunk_size + context_size]
        for n in range(num_blocks)
    ]
    return torch.stack(blocks, dim=2)


class Gemma4AudioAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.chunk_size = config.attention_chunk_size
        self.max_past_horizon = config.attention_context_left - 1
        self.max_future_horizon = config.attention_context_right
        self.context_size = self.chunk_size + self.max_past_horizon + self.max_future_horizon
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def _convert_to_block(self, x):
        b, t, h, d = x.shape
        num_blocks = (t + self.chunk_size - 1) // self.chunk_size
        x = F.pad(x, (0, 0, 0, 0, 0, num_blocks * self.chunk_size - t))
        return x.reshape(b, num_blocks, self.chunk_size, h, d)

    def _extract_block_context(self, x):
        b, t, h, d = x.shape
        num_blocks = (t + self.chunk_size - 1) // self.chunk_size
        pad_right = self.max_future_horizon + num_blocks * self.chunk_size - t
        x = F.pad(x, (0, 0, 0, 0, self.max_past_horizon, pad_right))
        x = x.unfold(1, self.context_size, self.chunk_size)  # (b, num_blocks, h, d, context)
        return x.permute(0, 1, 4, 2, 3)[:, :num_blocks]

    def forward(self, hidden_states, attention_mask):
        b, t, _ = hidden_states.shape
        shape = (b, t, self.num_heads, self.head_dim)
        query_blocks = self._convert_to_block(self.q_proj(hidden_states).view(shape) * self.head_dim**-0.5)
        key_blocks = self._extract_block_context(self.k_proj(hidden_states).view(shape))
        value_blocks = self._extract_block_context(self.v_proj(hidden_states).view(shape))
        # (b, h, num_blocks, chunk, context)
        attn_weights = torch.einsum("bnqhd,bnkhd->bhnqk", query_blocks, key_blocks)
        cap = self.config.attention_logit_cap
        attn_weights = torch.tanh(attn_weights / cap) * cap
        attn_weights = attn_weights.masked_fill(attention_mask.logical_not(), self.config.attention_invalid_logits_value)
        attn_weights = F.softmax(attn_weights, dim=-1)
        out = torch.einsum("bhnqk,bnkhd->bnqhd", attn_weights, value_blocks)
        out = out.reshape(b, -1, self.num_heads * self.head_dim)[:, :t]
        return self.o_proj(out)


class Gemma4AudioModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Gemma4AudioAttention(config) for _ in range(config.num_hidden_layers))
        self.norms = nn.ModuleList(nn.LayerNorm(config.hidden_size) for _ in range(config.num_hidden_layers))

    def forward(self, audio_features, audio_mel_mask):
        t = audio_features.shape[1]
        pos = torch.arange(t)
        dist = pos[:, None] - pos[None, :]
        local = (dist >= -self.config.attention_context_right) & (dist < self.config.attention_context_left)
        attention_mask = create_bidirectional_mask(self.config, audio_features, audio_mel_mask, local)
        if FIXED and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask == 0
        layer = self.layers[0]
        attention_mask = _convert_4d_mask_to_blocked_5d(
            attention_mask, layer.chunk_size, layer.max_past_horizon, layer.max_future_horizon
        )
        hidden_states = audio_features
        for norm, attn in zip(self.norms, self.layers):
            hidden_states = hidden_states + attn(norm(hidden_states), attention_mask)
        return hidden_states, attention_mask


def main():
    torch.manual_seed(0)
    config = Gemma4AudioConfig()
    model = Gemma4AudioModel(config).eval()
    features = torch.randn(2, 10, config.hidden_size)
    audio_mel_mask = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])
    with torch.no_grad():
        out, _ = model(features, audio_mel_mask)
        alone, _ = model(features[1:, :7], audio_mel_mask[1:, :7])
    print("short row matches its own run:", torch.allclose(out[1, :7], alone[0], atol=1e-4))


if __name__ == "__main__":
    main()
