"""Nemotron ASR Streaming (FastConformer) encoder: the chunked mask is inverted under eager attention.

Citation: huggingface/transformers#48817 "Fix inverted eager attention mask in NemotronAsrStreaming
encoder (NaN / wrong context window)" (PR, closed; read through its description). The same pattern in
Gemma4's audio tower is reported in huggingface/transformers#48818.
``NemotronAsrStreamingEncoder.forward`` builds the chunked_limited (``att_context_size``) and padding
mask with ``create_bidirectional_mask``, which returns an additive float mask for eager (0 allowed,
``finfo.min`` disallowed) and a bool mask for sdpa. ``NemotronAsrStreamingEncoderAttention`` then puts
the mask into the relative-position term with
``matrix_bd.masked_fill_(attention_mask.logical_not(), float("-inf"))``, which assumes a bool mask: under
eager the allowed keys (0.0 -> True) are filled with -inf and the disallowed ones stay attendable, so
every frame attends exactly outside its streaming context (and fully-allowed rows turn to NaN).

Fix: read the mask in its real convention before the masked_fill (allowed = the additive mask's zeros),
so the -inf goes on the keys the chunked_limited context excludes.

This program: a config dataclass with ``att_context_size = [4, 1]`` (chunk of right + 1 = 2 frames, two
left chunks), a padded batch of two utterances (12 and 9 frames), the mask built the way
create_bidirectional_mask builds it for eager, and the rel-pos attention with the additive bias reaching
an eager softmax over ``q @ k.T``. Buggy: frame 0 attends frames 2..11 (the short row's padding included);
``--fixed``: frames 0..1.
"""
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class NemotronAsrStreamingEncoderConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    att_context_size: list = field(default_factory=lambda: [4, 1])  # [left frames, right frames]
    _attn_implementation: str = "eager"


def chunked_limited_mask(seq_len, att_context_size):
    chunk_size = att_context_size[1] + 1
    left_chunks_num = att_context_size[0] // chunk_size
    chunk_idx = torch.div(torch.arange(seq_len), chunk_size, rounding_mode="trunc")
    diff_chunks = chunk_idx.unsqueeze(1) - chunk_idx.unsqueeze(0)
    return (diff_chunks <= left_chunks_num) & (diff_chunks >= 0)


def create_bidirectional_mask(config, input_embeds, attention_mask, and_mask):
    """Bool (sdpa) or additive float (eager) 4D mask: the padding of the keys and the extra and_mask."""
    allowed = attention_mask[:, None, None, :].bool() & and_mask[None, None]
    if config._attn_implementation == "sdpa":
        return allowed
    zeros = torch.zeros(allowed.shape, dtype=input_embeds.dtype)
    return zeros.masked_fill(~allowed, torch.finfo(input_embeds.dtype).min)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    return torch.matmul(attn_weights, value).transpose(1, 2).contiguous()


class NemotronAsrStreamingEncoderAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.relative_k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.bias_u = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
        self.bias_v = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))

    def forward(self, hidden_states, position_embeddings, attention_mask):
        b, t, _ = hidden_states.shape
        shape = (b, t, self.num_heads, self.head_dim)
        query_states = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(shape).transpose(1, 2)

        query_states_with_bias_u = query_states + self.bias_u.view(1, self.num_heads, 1, self.head_dim)
        query_states_with_bias_v = query_states + self.bias_v.view(1, self.num_heads, 1, self.head_dim)
        relative_key_states = self.relative_k_proj(position_embeddings)
        relative_key_states = relative_key_states.view(b, -1, self.num_heads, self.head_dim)
        matrix_bd = query_states_with_bias_v @ relative_key_states.permute(0, 2, 3, 1)
        matrix_bd = self._rel_shift(matrix_bd)[..., :t] * self.scaling

        if attention_mask is not None:
            if FIXED and attention_mask.dtype != torch.bool:
                attention_mask = attention_mask == 0  # the additive eager mask: 0 where allowed
            matrix_bd = matrix_bd.masked_fill_(attention_mask.logical_not(), float("-inf"))

        attn_output = eager_attention_forward(
            self, query_states_with_bias_u, key_states, value_states, matrix_bd, self.scaling
        )
        return self.o_proj(attn_output.reshape(b, t, -1))

    def _rel_shift(self, attention_scores):
        b, h, t, pos_len = attention_scores.shape
        attention_scores = nn.functional.pad(attention_scores, pad=(1, 0))
        attention_scores = attention_scores.view(b, h, -1, t)
        return attention_scores[:, :, 1:].view(b, h, t, pos_len)


class NemotronAsrStreamingEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(NemotronAsrStreamingEncoderAttention(config) for _ in range(config.num_hidden_layers))
        self.norms = nn.ModuleList(nn.LayerNorm(config.hidden_size) for _ in range(config.num_hidden_layers))

    def _position_embeddings(self, b, t):
        # relative positions t-1 .. -(t-1), sinusoidal
        pos = torch.arange(t - 1, -t, -1, dtype=torch.float32)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.config.hidden_size, 2).float() / self.config.hidden_size))
        angles = pos[:, None] * inv_freq[None, :]
        pe = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)
        return pe.unsqueeze(0).expand(b, -1, -1)

    def forward(self, hidden_states, attention_mask):
        b, t, _ = hidden_states.shape
        and_mask = chunked_limited_mask(t, self.config.att_context_size)
        mask = create_bidirectional_mask(self.config, hidden_states, attention_mask, and_mask)
        position_embeddings = self._position_embeddings(b, t)
        for norm, layer in zip(self.norms, self.layers):
            hidden_states = hidden_states + layer(norm(hidden_states), position_embeddings, mask)
        return hidden_states, mask


def main():
    torch.manual_seed(0)
    config = NemotronAsrStreamingEncoderConfig()
    encoder = NemotronAsrStreamingEncoder(config).eval()
    frames = torch.randn(2, 12, config.hidden_size)  # subsampled features
    attention_mask = torch.tensor([[1] * 12, [1] * 9 + [0] * 3])
    with torch.no_grad():
        out, _ = encoder(frames, attention_mask)
    print("finite:", bool(torch.isfinite(out).all()), "| out norm", round(float(out.nan_to_num().norm()), 4))


if __name__ == "__main__":
    main()
