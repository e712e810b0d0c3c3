"""Longformer's `sliding_chunks3` local attention: the neighbouring chunks were taken with `roll`, which wraps.

Citation: allenai/longformer commit fe35b1f ("sliding chunks 3 no roll"; parent db83d0b), longformer/sliding_chunks.py
(sliding_chunks_matmul_qk_3 / sliding_chunks_matmul_pv_3) as called by longformer/longformer.py LongformerSelfAttention
(attention_mode 'sliding_chunks3').

The bug: the sequence is cut into non-overlapping chunks of w tokens and each chunk's queries are multiplied with the
keys of [previous chunk, own chunk, next chunk], stacked as `chunk_k.roll(shifts=1, dims=1)`, `chunk_k`,
`chunk_k.roll(shifts=-1, dims=1)` (the values the same way, and the padding mask `d_mask` through the same function).
`roll` wraps around the chunk axis: the first chunk's "previous chunk" is the sequence's last chunk and the last chunk's
"next chunk" is the first, so tokens at the start attend the keys at the end of the document and the other way round.

The fix: `F.pad(chunk_k[:, :-1], ..., (1, 0))` / `F.pad(chunk_k[:, 1:], ..., (0, 1))` (and the same for the values):
the chunk before the first one and the chunk after the last one are zeros instead of the far end of the sequence.

Tiny random-weight encoder (2 layers, window w = 2 on each side), the layers built as the project builds them
(LongformerConfig on top of RobertaConfig, attention_mask 0 / 1 / 2 turned into -10000 / 0 / +10000 as BertModel does),
a right-padded batch of two documents with global attention on <s>.
"""

import math
import sys
from typing import List

import torch
import torch.nn.functional as F
from torch import nn
from transformers import RobertaConfig

FIXED = "--fixed" in sys.argv

XLA_AVAILABLE = False


# ---- longformer/sliding_chunks.py ---------------------------------------------------------------------------------

def sliding_chunks_matmul_qk_3(q: torch.Tensor, k: torch.Tensor, w: int, padding_value: float):
    bsz, seqlen, num_heads, head_dim = q.size()
    assert seqlen % w == 0
    assert q.size() == k.size()
    # chunk seqlen into non-overlapping chunks of size w
    chunk_q = q.view(bsz, seqlen // w, w, num_heads, head_dim)
    chunk_k = k.view(bsz, seqlen // w, w, num_heads, head_dim)
    if FIXED:
        chunk_k_expanded = torch.stack((
            F.pad(chunk_k[:, :-1], (0, 0, 0, 0, 0, 0, 1, 0), value=0.0),
            chunk_k,
            F.pad(chunk_k[:, 1:], (0, 0, 0, 0, 0, 0, 0, 1), value=0.0),
        ), dim=-1)
    else:
        chunk_k_expanded = torch.stack((
            chunk_k.roll(shifts=1, dims=1),
            chunk_k,
            chunk_k.roll(shifts=-1, dims=1)
        ), dim=-1)
    diagonal_attn = torch.einsum('bcxhd,bcyhde->bcxhey', (chunk_q, chunk_k_expanded))  # multiply
    return diagonal_attn.reshape(bsz, seqlen, num_heads, 3 * w)


def sliding_chunks_matmul_pv_3(prob: torch.Tensor, v: torch.Tensor, w: int):
    bsz, seqlen, num_heads, head_dim = v.size()
    chunk_prob = prob.view(bsz, seqlen // w, w, num_heads, 3, w)
    chunk_v = v.view(bsz, seqlen // w, w, num_heads, head_dim)
    if FIXED:
        chunk_v_extended = torch.stack((
            F.pad(chunk_v[:, :-1], (0, 0, 0, 0, 0, 0, 1, 0), value=0.0),
            chunk_v,
            F.pad(chunk_v[:, 1:], (0, 0, 0, 0, 0, 0, 0, 1), value=0.0),
        ), dim=-1)
    else:
        chunk_v_extended = torch.stack((
            chunk_v.roll(shifts=1, dims=1),
            chunk_v,
            chunk_v.roll(shifts=-1, dims=1)
        ), dim=-1)
    context = torch.einsum('bcwhpd,bcdhep->bcwhe', (chunk_prob, chunk_v_extended))
    return context.reshape(bsz, seqlen, num_heads, head_dim)


# ---- longformer/longformer.py --------------------------------------------------------------------------------------

class LongformerConfig(RobertaConfig):
    def __init__(self, attention_window: List[int] = None, attention_dilation: List[int] = None,
                 autoregressive: bool = False, attention_mode: str = 'sliding_chunks', **kwargs):
        super().__init__(**kwargs)
        self.attention_window = attention_window
        self.attention_dilation = attention_dilation
        self.autoregressive = autoregressive
        self.attention_mode = attention_mode


class LongformerSelfAttention(nn.Module):
    def __init__(self, config, layer_id):
        super(LongformerSelfAttention, self).__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(
                "The hidden size (%d) is not a multiple of the number of attention "
                "heads (%d)" % (config.hidden_size, config.num_attention_heads))
        self.num_heads = config.num_attention_heads
        self.head_dim = int(config.hidden_size / config.num_attention_heads)
        self.embed_dim = config.hidden_size

        self.query = nn.Linear(config.hidden_size, self.embed_dim)
        self.key = nn.Linear(config.hidden_size, self.embed_dim)
        self.value = nn.Linear(config.hidden_size, self.embed_dim)

        self.query_global = nn.Linear(config.hidden_size, self.embed_dim)
        self.key_global = nn.Linear(config.hidden_size, self.embed_dim)
        self.value_global = nn.Linear(config.hidden_size, self.embed_dim)

        self.dropout = config.attention_probs_dropout_prob

        self.layer_id = layer_id
        self.attention_window = config.attention_window[self.layer_id]
        self.attention_dilation = config.attention_dilation[self.layer_id]
        self.attention_mode = config.attention_mode
        self.autoregressive = config.autoregressive
        assert self.attention_window > 0
        assert self.attention_dilation > 0
        assert self.attention_mode in ['tvm', 'sliding_chunks', 'sliding_chunks2', 'sliding_chunks3']
        if not self.attention_mode == 'tvm':
            assert not self.autoregressive  # not supported
            assert self.attention_dilation == 1  # dilation is not supported

    def forward(self, hidden_states, attention_mask=None):
        '''
        The `attention_mask` is changed in `BertModel.forward` from 0, 1, 2 to
            -ve: no attention
              0: local attention
            +ve: global attention
        '''
        if attention_mask is not None:
            attention_mask = attention_mask.squeeze(dim=2).squeeze(dim=1)
            key_padding_mask = attention_mask < 0
            extra_attention_mask = attention_mask > 0
            remove_from_windowed_attention_mask = attention_mask != 0

            num_extra_indices_per_batch = extra_attention_mask.long().sum(dim=1)
            max_num_extra_indices_per_batch = num_extra_indices_per_batch.max()
            if max_num_extra_indices_per_batch <= 0:
                extra_attention_mask = None
            else:
                extra_attention_mask_nonzeros = extra_attention_mask.nonzero(as_tuple=True)
                zero_to_max_range = torch.arange(0, max_num_extra_indices_per_batch,
                                                 device=num_extra_indices_per_batch.device)
                selection_padding_mask = zero_to_max_range < num_extra_indices_per_batch.unsqueeze(dim=-1)
                selection_padding_mask_nonzeros = selection_padding_mask.nonzero(as_tuple=True)
                selection_padding_mask_zeros = (selection_padding_mask == 0).nonzero(as_tuple=True)
        else:
            remove_from_windowed_attention_mask = None
            extra_attention_mask = None
            key_padding_mask = None

        hidden_states = hidden_states.transpose(0, 1)
        seq_len, bsz, embed_dim = hidden_states.size()
        assert embed_dim == self.embed_dim
        q = self.query(hidden_states)
        k = self.key(hidden_states)
        v = self.value(hidden_states)
        q /= math.sqrt(self.head_dim)

        q = q.view(seq_len, bsz, self.num_heads, self.head_dim).transpose(0, 1)
        k = k.view(seq_len, bsz, self.num_heads, self.head_dim).transpose(0, 1)
        # attn_weights = (bsz, seq_len, num_heads, window*2+1)
        attn_weights = sliding_chunks_matmul_qk_3(q, k, self.attention_window, padding_value=0)

        if remove_from_windowed_attention_mask is not None:
            remove_from_windowed_attention_mask = remove_from_windowed_attention_mask.unsqueeze(dim=-1).unsqueeze(dim=-1)
            # cast to float/half then replace 1's with -inf
            float_mask = remove_from_windowed_attention_mask.type_as(q).masked_fill(remove_from_windowed_attention_mask, -10000.0)
            repeat_size = 1 if isinstance(self.attention_dilation, int) else len(self.attention_dilation)
            float_mask = float_mask.repeat(1, 1, repeat_size, 1)
            ones = float_mask.new_ones(size=float_mask.size())  # tensor of ones
            # diagonal mask with zeros everywhere and -inf inplace of padding
            d_mask = sliding_chunks_matmul_qk_3(ones, float_mask, self.attention_window, padding_value=0)
            attn_weights += d_mask

        # the extra attention
        if extra_attention_mask is not None:
            selected_k = k.new_zeros(bsz, max_num_extra_indices_per_batch, self.num_heads, self.head_dim)
            selected_k[selection_padding_mask_nonzeros] = k[extra_attention_mask_nonzeros]
            selected_attn_weights = torch.einsum('blhd,bshd->blhs', (q, selected_k))
            selected_attn_weights[selection_padding_mask_zeros[0], :, :, selection_padding_mask_zeros[1]] = -10000
            attn_weights = torch.cat((selected_attn_weights, attn_weights), dim=-1)

        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)  # use fp32 for numerical stability
        if key_padding_mask is not None:
            # softmax sometimes inserts NaN if all positions are masked, replace them with 0
            attn_weights_float = torch.masked_fill(attn_weights_float, key_padding_mask.unsqueeze(-1).unsqueeze(-1), 0.0)

        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = F.dropout(attn_weights_float.type_as(attn_weights), p=self.dropout, training=self.training)
        v = v.view(seq_len, bsz, self.num_heads, self.head_dim).transpose(0, 1)
        attn = 0
        if extra_attention_mask is not None:
            selected_attn_probs = attn_probs.narrow(-1, 0, max_num_extra_indices_per_batch)
            selected_v = v.new_zeros(bsz, max_num_extra_indices_per_batch, self.num_heads, self.head_dim)
            selected_v[selection_padding_mask_nonzeros] = v[extra_attention_mask_nonzeros]
            attn = torch.matmul(selected_attn_probs.transpose(1, 2), selected_v.transpose(1, 2).type_as(selected_attn_probs)).transpose(1, 2)
            attn_probs = attn_probs.narrow(-1, max_num_extra_indices_per_batch, attn_probs.size(-1) - max_num_extra_indices_per_batch).contiguous()

        attn += sliding_chunks_matmul_pv_3(attn_probs, v, self.attention_window)

        attn = attn.type_as(hidden_states)
        assert list(attn.size()) == [bsz, seq_len, self.num_heads, self.head_dim]
        attn = attn.transpose(0, 1).reshape(seq_len, bsz, embed_dim).contiguous()

        # For this case, we'll just recompute the attention for these indices
        # and overwrite the attn tensor.
        if extra_attention_mask is not None:
            selected_hidden_states = hidden_states.new_zeros(max_num_extra_indices_per_batch, bsz, embed_dim)
            selected_hidden_states[selection_padding_mask_nonzeros[::-1]] = hidden_states[extra_attention_mask_nonzeros[::-1]]

            q = self.query_global(selected_hidden_states)
            k = self.key_global(hidden_states)
            v = self.value_global(hidden_states)
            q /= math.sqrt(self.head_dim)

            q = q.contiguous().view(max_num_extra_indices_per_batch, bsz * self.num_heads, self.head_dim).transpose(0, 1)
            k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
            v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
            attn_weights = torch.bmm(q, k.transpose(1, 2))
            assert list(attn_weights.size()) == [bsz * self.num_heads, max_num_extra_indices_per_batch, seq_len]

            attn_weights = attn_weights.view(bsz, self.num_heads, max_num_extra_indices_per_batch, seq_len)
            attn_weights[selection_padding_mask_zeros[0], :, selection_padding_mask_zeros[1], :] = -10000.0
            if key_padding_mask is not None:
                attn_weights = attn_weights.masked_fill(
                    key_padding_mask.unsqueeze(1).unsqueeze(2),
                    -10000.0,
                )
            attn_weights = attn_weights.view(bsz * self.num_heads, max_num_extra_indices_per_batch, seq_len)
            attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
            attn_probs = F.dropout(attn_weights_float.type_as(attn_weights), p=self.dropout, training=self.training)
            selected_attn = torch.bmm(attn_probs, v)
            assert list(selected_attn.size()) == [bsz * self.num_heads, max_num_extra_indices_per_batch, self.head_dim]

            selected_attn_4d = selected_attn.view(bsz, self.num_heads, max_num_extra_indices_per_batch, self.head_dim)
            nonzero_selected_attn = selected_attn_4d[selection_padding_mask_nonzeros[0], :, selection_padding_mask_nonzeros[1]]
            attn[extra_attention_mask_nonzeros[::-1]] = nonzero_selected_attn.view(len(selection_padding_mask_nonzeros[0]), -1).type_as(hidden_states)

        context_layer = attn.transpose(0, 1)
        return (context_layer,)


# ---- a Roberta-shaped encoder around it (RobertaModel with layer.attention.self replaced) --------------------------

class Layer(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.self = LongformerSelfAttention(config, layer_id=layer_id)
        self.attn_out = nn.Linear(config.hidden_size, config.hidden_size)
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.inter = nn.Linear(config.hidden_size, config.intermediate_size)
        self.out = nn.Linear(config.intermediate_size, config.hidden_size)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, extended_attention_mask):
        a = self.self(hidden_states, attention_mask=extended_attention_mask)[0]
        h = self.ln1(hidden_states + self.attn_out(a))
        return self.ln2(h + self.out(F.gelu(self.inter(h))))


class Longformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layer = nn.ModuleList([Layer(config, i) for i in range(config.num_hidden_layers)])

    def forward(self, input_ids, attention_mask):
        # RoBERTa position ids: padding_idx + cumsum over real tokens, pads at padding_idx
        not_pad = input_ids.ne(self.config.pad_token_id).long()
        position_ids = torch.cumsum(not_pad, dim=1) * not_pad + self.config.pad_token_id
        h = self.ln(self.word_embeddings(input_ids) + self.position_embeddings(position_ids))
        # BertModel.get_extended_attention_mask: 0 / 1 / 2 -> -10000 / 0 / +10000
        extended_attention_mask = attention_mask[:, None, None, :].to(h.dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        for layer in self.layer:
            h = layer(h, extended_attention_mask)
        return h


def pad_to_window_size(input_ids, attention_mask, one_sided_window_size, pad_token_id):
    '''longformer.sliding_chunks.pad_to_window_size: pad to a multiple of 2w'''
    w = 2 * one_sided_window_size
    seqlen = input_ids.size(1)
    padding_len = (w - seqlen % w) % w
    input_ids = F.pad(input_ids, (0, padding_len), value=pad_token_id)
    attention_mask = F.pad(attention_mask, (0, padding_len), value=False)  # no attention on the padding tokens
    return input_ids, attention_mask


def main():
    torch.manual_seed(0)
    w = 2
    config = LongformerConfig(
        attention_window=[w, w], attention_dilation=[1, 1], attention_mode='sliding_chunks3',
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0,
    )
    model = Longformer(config).eval()

    docs = [
        [0, 11, 23, 7, 31, 18, 5, 42, 9, 36, 21, 2],
        [0, 14, 8, 27, 33, 2],
    ]
    longest = max(len(d) for d in docs)
    input_ids = torch.full((len(docs), longest), config.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(len(docs), longest, dtype=torch.long)
    for i, d in enumerate(docs):
        input_ids[i, :len(d)] = torch.tensor(d)
        attention_mask[i, :len(d)] = 1
    attention_mask[:, 0] = 2  # global attention on <s>
    input_ids, attention_mask = pad_to_window_size(input_ids, attention_mask, w, config.pad_token_id)

    with torch.no_grad():
        hidden = model(input_ids, attention_mask)

    torch.set_printoptions(precision=4, sci_mode=False)
    print("attention_mode:", config.attention_mode, "window:", w, "seq_len:", input_ids.size(1))
    for i, d in enumerate(docs):
        print(f"doc {i}: first token after <s>: {hidden[i, 1, :6]}")
        print(f"doc {i}: last real token:      {hidden[i, len(d) - 1, :6]}")


if __name__ == "__main__":
    main()
