"""Whisper FlashAttention-2 decoder: the padding mask is cut to num_heads columns (transformers#36477).

Citation: huggingface/transformers#36477 ("Fix incorrect attention mask truncate in
WhisperFlashAttention2", OliBomby, merged 2025-05), which also addresses #36585 (FA2 and SDPA
outputs differ for Whisper with an attention mask). The review thread shows the one-line diff.

Bug: ``WhisperFlashAttention2.forward`` transposes key_states to the flash layout
(batch, seq_len, num_heads, head_dim) and then slices the 2-D padding mask with
``attention_mask[:, : key_states.shape[-2]]``, i.e. to ``num_heads`` columns instead of
``seq_len``. ``_flash_attention_forward`` unpads with that short mask: its token indices are
read against the flattened (batch * seq_len) keys, so the varlen segments mix tokens of
different rows, drop others, and the causal attention of each segment starts at the wrong
token.

Fix: slice with ``key_states.shape[-3]`` (the sequence axis in the flash layout).

Reproduction: a one-layer Whisper decoder (dims from a transformers WhisperConfig, random
weights) with the FA2 code path of v4.49: ``_update_causal_mask`` passes the 2-D
``decoder_attention_mask`` through when it holds a zero, ``_upad_input`` / ``pad_input`` as in
modeling_flash_attention_utils, and ``flash_attn_varlen_func`` written as a loop of causal
``F.scaled_dot_product_attention`` over the cu_seqlens segments (flash_attn does not run on
CPU). Labels of lengths 6 and 4 right-padded to 6, 4 decoder heads.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import WhisperConfig

FIXED = "--fixed" in sys.argv


def _get_unpad_data(attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, max_seqlen_in_batch


def index_first_axis(x, indices):
    return x[indices]


def pad_input(hidden_states, indices, batch, seqlen):
    output = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.view(batch, seqlen, *hidden_states.shape[1:])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False):
    """CPU stand-in for flash_attn's varlen kernel: one attention per packed segment."""
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        o = F.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1),
                                           dropout_p=dropout_p, is_causal=causal, scale=softmax_scale)
        out[qs:qe] = o.transpose(0, 1)
    return out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       dropout_p=dropout_p, is_causal=causal, scale=softmax_scale)
    return o.transpose(1, 2)


def _upad_input(query_layer, key_layer, value_layer, attention_mask, query_length):
    indices_k, cu_seqlens_k, max_seqlen_in_batch_k = _get_unpad_data(attention_mask)
    batch_size, kv_seq_len, num_key_value_heads, head_dim = key_layer.shape
    key_layer = index_first_axis(key_layer.reshape(batch_size * kv_seq_len, num_key_value_heads, head_dim), indices_k)
    value_layer = index_first_axis(value_layer.reshape(batch_size * kv_seq_len, num_key_value_heads, head_dim), indices_k)
    if query_length == kv_seq_len:
        query_layer = index_first_axis(query_layer.reshape(batch_size * kv_seq_len, -1, head_dim), indices_k)
        cu_seqlens_q, max_seqlen_in_batch_q, indices_q = cu_seqlens_k, max_seqlen_in_batch_k, indices_k
    else:
        raise NotImplementedError("only prefill / training shapes are reproduced here")
    return query_layer, key_layer, value_layer, indices_q, (cu_seqlens_q, cu_seqlens_k), (max_seqlen_in_batch_q, max_seqlen_in_batch_k)


def _flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length,
                             is_causal, dropout=0.0, softmax_scale=None):
    causal = is_causal and query_length != 1
    if attention_mask is not None:
        batch_size = query_states.shape[0]
        query_states, key_states, value_states, indices_q, cu_seq_lens, max_seq_lens = _upad_input(
            query_states, key_states, value_states, attention_mask, query_length)
        cu_seqlens_q, cu_seqlens_k = cu_seq_lens
        max_seqlen_in_batch_q, max_seqlen_in_batch_k = max_seq_lens
        attn_output_unpad = flash_attn_varlen_func(
            query_states, key_states, value_states, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_in_batch_q, max_seqlen_k=max_seqlen_in_batch_k,
            dropout_p=dropout, softmax_scale=softmax_scale, causal=causal)
        attn_output = pad_input(attn_output_unpad, indices_q, batch_size, query_length)
    else:
        attn_output = flash_attn_func(query_states, key_states, value_states, dropout, softmax_scale=softmax_scale,
                                      causal=causal)
    return attn_output


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
        query_states = torch.reshape(self.q_proj(hidden_states), (bsz, tgt_len, self.num_heads, self.head_dim))
        current_states = key_value_states if is_cross_attention else hidden_states
        key_states = self._shape(self.k_proj(current_states), -1, bsz)
        value_states = self._shape(self.v_proj(current_states), -1, bsz)

        # TODO: These transpose are quite inefficient but Flash Attention requires the layout
        # [batch_size, sequence_length, num_heads, head_dim]
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
        self.self_attn = WhisperFlashAttention2(self.embed_dim, config.decoder_attention_heads, is_decoder=True,
                                                is_causal=True)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.encoder_attn = WhisperFlashAttention2(self.embed_dim, config.decoder_attention_heads, is_decoder=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states, attention_mask=attention_mask)
        residual = hidden_states
        hidden_states = self.encoder_attn_layer_norm(hidden_states)
        hidden_states = residual + self.encoder_attn(hidden_states, key_value_states=encoder_hidden_states)
        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(F.gelu(self.fc1(hidden_states)))
        return residual + hidden_states


class WhisperDecoder(nn.Module):
    def __init__(self, config: WhisperConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
        self.embed_positions = nn.Embedding(config.max_target_positions, config.d_model)
        self.layers = nn.ModuleList([WhisperDecoderLayer(config) for _ in range(config.decoder_layers)])
        self.layer_norm = nn.LayerNorm(config.d_model)

    def _update_causal_mask(self, attention_mask, input_tensor):
        # flash_attention_2: the 2-D padding mask is used as is, and only when it masks something
        if attention_mask is not None and 0.0 in attention_mask:
            return attention_mask
        return None

    def forward(self, input_ids, attention_mask=None, encoder_hidden_states=None):
        inputs_embeds = self.embed_tokens(input_ids)
        positions = self.embed_positions(torch.arange(input_ids.shape[1]))
        hidden_states = inputs_embeds + positions
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=causal_mask,
                                          encoder_hidden_states=encoder_hidden_states)
        return self.layer_norm(hidden_states)


def main():
    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=64, d_model=32, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64,
                           max_target_positions=16, pad_token_id=63, bos_token_id=50,
                           eos_token_id=51, decoder_start_token_id=50)
    decoder = WhisperDecoder(config).eval()
    encoder_hidden_states = torch.randn(2, 10, config.d_model)
    decoder_input_ids = torch.tensor([[50, 11, 12, 13, 14, 15], [50, 21, 22, 23, 63, 63]])
    decoder_attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        out = decoder(decoder_input_ids, attention_mask=decoder_attention_mask,
                      encoder_hidden_states=encoder_hidden_states)
    print("decoder out", tuple(out.shape), "row0 last-token sum", round(float(out[0, -1, :8].sum()), 4))


if __name__ == "__main__":
    main()
