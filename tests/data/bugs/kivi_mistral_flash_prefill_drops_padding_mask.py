"""KIVI MistralFlashAttention_KIVI prefill calls flash attention with no padding mask.

Citation: jy-yuan/KIVI#47 (merge of QuiverDance/fix-flashattn-prefill-mask, commit
f138c4781774742275266e93418311b3fcfc156d, "fix: flash attention prefill mask for padded batches").

Bug: in ``models/mistral_kivi.py`` the prefill branch of ``MistralFlashAttention_KIVI.forward`` (no
``past_key_value`` yet) called ``self._flash_attention_forward(q, k, v, None, q_len)``.  The model
(``MistralModel_KIVI``) hands the flash layers the 2-D padding mask (``attention_mask if 0 in
attention_mask else None``), but the layer dropped it, so ``_flash_attention_forward`` took the
``flash_attn_func(causal=True)`` branch instead of unpadding and calling ``flash_attn_varlen_func``: the
real tokens of a left-padded prompt attended to the pad tokens in front of them.
Fix: pass ``attention_mask`` instead of ``None`` (the one-line diff of f138c47).

This program: a two-layer KIVI-style Mistral (config from ``transformers.MistralConfig`` with
``_flash_attn_2_enabled``), prefill of a left-padded batch of two prompts.  flash-attn is CUDA-only, so
``flash_attn_func`` / ``flash_attn_varlen_func`` are small torch stand-ins with the same signatures that
call ``F.scaled_dot_product_attention(is_causal=True)`` on the whole rows / on each unpadded sequence.
The KIVI key/value quantisation of the prefill cache (triton kernels) is left out: it does not touch the
prefill attention.  ``--fixed`` passes ``attention_mask``.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import MistralConfig

FIXED = "--fixed" in sys.argv


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """Torch stand-in for flash_attn.flash_attn_func; (b, s, h, d) layout."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         dropout_p=dropout_p, scale=softmax_scale, is_causal=causal)
    return out.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False):
    """Torch stand-in for flash_attn.flash_attn_varlen_func; (total, h, d) layout."""
    outs = []
    for i in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]].transpose(0, 1)
        ks = k[cu_seqlens_k[i]:cu_seqlens_k[i + 1]].transpose(0, 1)
        vs = v[cu_seqlens_k[i]:cu_seqlens_k[i + 1]].transpose(0, 1)
        o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], dropout_p=dropout_p,
                                           scale=softmax_scale, is_causal=causal)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, 0)


def _get_unpad_data(attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, max_seqlen_in_batch


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class MistralFlashAttention_KIVI(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.is_causal = True
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        # prefill (past_key_value is None): the "kivi with flash" branch
        key_states_repeat = repeat_kv(key_states, self.num_key_value_groups)
        value_states_repeat = repeat_kv(value_states, self.num_key_value_groups)
        attn_output = self._flash_attention_forward(
            query_states.transpose(1, 2), key_states_repeat.transpose(1, 2),
            value_states_repeat.transpose(1, 2), attention_mask if FIXED else None, q_len, dropout=0.0
        )
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size).contiguous()
        return self.o_proj(attn_output)

    def _flash_attention_forward(self, query_states, key_states, value_states, attention_mask,
                                 query_length, dropout=0.0, softmax_scale=None):
        # Contains at least one padding token in the sequence
        if attention_mask is not None:
            batch_size = query_states.shape[0]
            indices, cu_seqlens, max_seqlen = _get_unpad_data(attention_mask)
            b, s, h, d = query_states.shape
            q = query_states.reshape(b * s, h, d)[indices]
            k = key_states.reshape(b * s, h, d)[indices]
            v = value_states.reshape(b * s, h, d)[indices]
            out_unpad = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                               max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                               dropout_p=dropout, softmax_scale=softmax_scale, causal=self.is_causal)
            attn_output = out_unpad.new_zeros(batch_size * query_length, h, d)
            attn_output[indices] = out_unpad
            attn_output = attn_output.view(batch_size, query_length, h, d)
        else:
            attn_output = flash_attn_func(query_states, key_states, value_states, dropout,
                                          softmax_scale=softmax_scale, causal=self.is_causal)
        return attn_output


class MistralDecoderLayer_KIVI(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = MistralFlashAttention_KIVI(config)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.SiLU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MistralModel_KIVI(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([MistralDecoderLayer_KIVI(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        inputs_embeds = self.embed_tokens(input_ids)
        if getattr(self.config, "_flash_attn_2_enabled", False):
            # 2d mask is passed through the layers
            attention_mask = attention_mask if (attention_mask is not None and 0 in attention_mask) else None
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids)
        return self.norm(hidden_states)


def main():
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, sliding_window=None)
    config._flash_attn_2_enabled = True
    config.k_bits, config.v_bits, config.group_size, config.residual_length = 2, 2, 32, 32
    model = MistralModel_KIVI(config).eval()
    # tokenizer.padding_side = "left", as KIVI's batched generation requires
    input_ids = torch.tensor([[0, 0, 0, 7, 12, 5, 9, 3],
                              [4, 22, 8, 31, 6, 17, 2, 11]])
    attention_mask = (input_ids != config.pad_token_id).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        hidden = model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
    print("fixed" if FIXED else "buggy", "last-token hidden[0, :4]:", hidden[0, -1, :4].tolist())


if __name__ == "__main__":
    main()
