"""Whisper's FlashAttention-2 path slices the 2D padding mask with the heads axis length.

Citation: huggingface/transformers PR #36477 ("Fix incorrect attention mask truncate in
WhisperFlashAttention2", merged; description and review hunk read; context issue #36585).

Bug: in WhisperFlashAttention2.forward the key/value states are (batch, seq, heads, head_dim)
(already transposed for flash-attn), but the mask was truncated with the eager layout's index:
`causal_mask = attention_mask[:, : key_states.shape[-2]]` — i.e. to `num_heads` columns.
When a `decoder_attention_mask` with zeros is passed (training with padded labels), the
(batch, kv_len) mask becomes (batch, num_heads); `_upad_input` then computes `indices_k` and
`cu_seqlens` from that truncated mask and applies them to the (batch*kv_len) token rows: the
varlen kernel attends over the wrong tokens with the wrong sequence boundaries.
Fix (PR #36477): `attention_mask[:, : key_states.shape[-3]]`.

Reproduction: one Whisper decoder layer (causal self-attention through the FA2 code path,
cross-attention without mask) with 4 heads, batch of 2 label sequences of length 8, the second
right-padded to 6.  `flash_attn_varlen_func` is emulated by `F.scaled_dot_product_attention`
(is_causal) on each cu_seqlens segment; `index_first_axis`/`pad_input` are the flash-attn
helpers written in torch.  The config is a small stand-in holding WhisperConfig's field names
(importing transformers alone takes longer than this program may run).
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class WhisperConfig:
    d_model: int = 64
    decoder_attention_heads: int = 4
    decoder_ffn_dim: int = 128
    attention_dropout: float = 0.0
    max_target_positions: int = 32
    vocab_size: int = 100
    pad_token_id: int = 50


def index_first_axis(x, indices):
    return x[indices]


def pad_input(hidden_states, indices, batch, seqlen):
    output = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.view(batch, seqlen, *hidden_states.shape[1:])


def _get_unpad_data(attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, max_seqlen_in_batch


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False):
    """Torch stand-in for flash-attn's varlen kernel: one SDPA call per packed segment."""
    out = torch.zeros_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        seg = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1),
            is_causal=causal, scale=softmax_scale)
        out[qs:qe] = seg.transpose(0, 1)
    return out


def _upad_input(query_layer, key_layer, value_layer, attention_mask, query_length):
    indices_k, cu_seqlens_k, max_seqlen_in_batch_k = _get_unpad_data(attention_mask)
    batch_size, kv_seq_len, num_key_value_heads, head_dim = key_layer.shape
    key_layer = index_first_axis(key_layer.reshape(batch_size * kv_seq_len, num_key_value_heads, head_dim), indices_k)
    value_layer = index_first_axis(value_layer.reshape(batch_size * kv_seq_len, num_key_value_heads, head_dim),
                                   indices_k)
    # self-attention over the full labels: query_length == kv_seq_len
    query_layer = index_first_axis(query_layer.reshape(batch_size * kv_seq_len, -1, head_dim), indices_k)
    return query_layer, key_layer, value_layer, indices_k, (cu_seqlens_k, cu_seqlens_k), \
        (max_seqlen_in_batch_k, max_seqlen_in_batch_k)


def _flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length, is_causal,
                             dropout=0.0, softmax_scale=None):
    if attention_mask is not None:
        batch_size = query_states.shape[0]
        query_states, key_states, value_states, indices_q, cu_seq_lens, max_seq_lens = _upad_input(
            query_states, key_states, value_states, attention_mask, query_length)
        cu_seqlens_q, cu_seqlens_k = cu_seq_lens
        max_seqlen_in_batch_q, max_seqlen_in_batch_k = max_seq_lens
        attn_output_unpad = flash_attn_varlen_func(
            query_states, key_states, value_states, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_in_batch_q, max_seqlen_k=max_seqlen_in_batch_k, dropout_p=dropout,
            softmax_scale=softmax_scale, causal=is_causal)
        return pad_input(attn_output_unpad, indices_q, batch_size, query_length)
    out = F.scaled_dot_product_attention(query_states.transpose(1, 2), key_states.transpose(1, 2),
                                         value_states.transpose(1, 2), is_causal=is_causal, scale=softmax_scale)
    return out.transpose(1, 2)


class WhisperFlashAttention2(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, is_decoder=False, bias=True, is_causal=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.is_decoder = is_decoder
        self.is_causal = is_causal
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        is_cross_attention = key_value_states is not None
        bsz, tgt_len, _ = hidden_states.size()

        # [batch_size, seq_len, num_heads, head_dim]
        query_states = torch.reshape(self.q_proj(hidden_states), (bsz, tgt_len, self.num_heads, self.head_dim))
        current_states = key_value_states if is_cross_attention else hidden_states
        key_states = self._shape(self.k_proj(current_states), -1, bsz)
        value_states = self._shape(self.v_proj(current_states), -1, bsz)

        # flash-attn wants [batch_size, seq_len, num_heads, head_dim]
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)

        causal_mask = attention_mask
        if attention_mask is not None:  # no matter the length, we just slice it
            if FIXED:
                causal_mask = attention_mask[:, : key_states.shape[-3]]
            else:
                causal_mask = attention_mask[:, : key_states.shape[-2]]

        attn_output = _flash_attention_forward(
            query_states, key_states, value_states, causal_mask, tgt_len,
            dropout=self.dropout if self.training else 0.0, is_causal=self.is_causal)
        attn_output = attn_output.reshape(bsz, tgt_len, -1)
        return self.out_proj(attn_output)


class WhisperDecoderLayer(nn.Module):
    def __init__(self, config: WhisperConfig):
        super().__init__()
        self.embed_dim = config.d_model
        self.self_attn = WhisperFlashAttention2(self.embed_dim, config.decoder_attention_heads,
                                                dropout=config.attention_dropout, is_decoder=True, is_causal=True)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.encoder_attn = WhisperFlashAttention2(self.embed_dim, config.decoder_attention_heads,
                                                   dropout=config.attention_dropout, is_decoder=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None):
        residual = hidden_states
        hidden_states = self.self_attn(self.self_attn_layer_norm(hidden_states), attention_mask=attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.encoder_attn(self.encoder_attn_layer_norm(hidden_states),
                                          key_value_states=encoder_hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden_states))))
        return residual + hidden_states


class WhisperDecoder(nn.Module):
    def __init__(self, config: WhisperConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
        self.embed_positions = nn.Embedding(config.max_target_positions, config.d_model)
        self.layers = nn.ModuleList([WhisperDecoderLayer(config)])
        self.layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, input_ids, attention_mask=None, encoder_hidden_states=None):
        positions = torch.arange(input_ids.shape[1])
        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(positions)
        # flash_attention_2: keep the 2D mask only if it actually masks something
        causal_mask = attention_mask if (attention_mask is not None and 0 in attention_mask) else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=causal_mask,
                                  encoder_hidden_states=encoder_hidden_states)
        return self.layer_norm(hidden_states)


if __name__ == "__main__":
    torch.manual_seed(0)
    config = WhisperConfig()
    decoder = WhisperDecoder(config).eval()
    encoder_hidden_states = torch.randn(2, 10, config.d_model)
    decoder_input_ids = torch.tensor([[1, 11, 12, 13, 14, 15, 16, 17],
                                      [1, 21, 22, 23, 24, 25, 50, 50]])
    decoder_attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1],
                                           [1, 1, 1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        out = decoder(decoder_input_ids, attention_mask=decoder_attention_mask,
                      encoder_hidden_states=encoder_hidden_states)
    print(f"decoder output first feature, sample 0: {out[0, :, 0].sum().item():.4f}, sample 1: {out[1, :6, 0].sum().item():.4f}")
