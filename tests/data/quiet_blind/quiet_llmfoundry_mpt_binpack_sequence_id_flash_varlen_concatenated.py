# Correct program (quiet batch quiet-r75a).
# Ported from mosaicml/llm-foundry @8c8dd48f72168c5d51e2f7b151595892a8fba43d:
#   llmfoundry/data/packing.py (BinPackCollator.pack / _trim_batch / _extract_trim_batch_idx /
#     _first_fit_bin_packing / _convert_to_batch, _combine_in_place, _pad_tensor: trimmed examples get
#     sequence_id 0, an example added to a bin gets sequence_id + 1 + max and its first label set to -100, bins are
#     re-padded on the right with input pad / label -100 / attention_mask 0 / sequence_id -1),
#   llmfoundry/models/mpt/modeling_mpt.py (MPTModel.forward with attn_impl='flash', attn_uses_sequence_id=True,
#     rope_impl='hf': pos from arange adjusted by cumsum(~attention_mask); _get_attn_mask_in_len_seq_one_hot /
#     gen_sequence_id_info -> attention_mask_in_length; gen_flash_attn_padding_info with
#     bert_padding.unpad_input_for_concatenated_sequences; get_targets / compute_loss_from_logits),
#   llmfoundry/models/layers/attention.py (GroupedQueryAttention with fused Wqkv and kv_n_heads < n_heads,
#     _apply_rotary_embeddings 'hf' branch, flash_attn_fn: index_first_axis with indices_q/k/v, repeat_kv_for_gqa,
#     flash_attn_varlen_func(causal=_reset_is_causal(...)), pad_input with indices_q).
# No flash-attn on CPU: index_first_axis / pad_input / unpad_input_for_concatenated_sequences follow
# flash_attn/bert_padding.py (Dao-AILab/flash-attention @3c0d49532cb3bc0a36b405f34590ff82cf582853), and
# flash_attn_varlen_func is a plain-torch stand-in with its arguments (each cu_seqlens span attended on its own).
# Self-check: every example run alone, unpadded and unpacked (no attention_mask, no sequence_id: one span per row),
# through the same weights; each packed token's logits must match its example's (RoPE positions run on across a
# packed row, which leaves each example's q.k unchanged), and the packed batch loss must equal the per-token mean
# of the examples' summed losses.
import math
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
CROSS_ENTROPY_IGNORE_INDEX = -100


# ---- flash_attn/bert_padding.py ----
def index_first_axis(input, indices):
    first_axis_dim, other_shape = input.shape[0], input.shape[1:]
    return input.reshape(first_axis_dim, -1)[indices].reshape(-1, *other_shape)


def pad_input(hidden_states, indices, batch, seqlen):
    output = torch.zeros((batch * seqlen, *hidden_states.shape[1:]), device=hidden_states.device,
                         dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    b, s = hidden_states.shape[:2]
    return (index_first_axis(hidden_states.reshape(b * s, *hidden_states.shape[2:]), indices), indices,
            cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch)


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    length = attention_mask_in_length.sum(dim=-1)
    seqlen = attention_mask_in_length.size(-1)
    attention_mask_2d = torch.arange(seqlen, device=length.device, dtype=length.dtype).expand(
        len(length), seqlen) < length.unsqueeze(1)
    real_indices_idx = torch.nonzero(attention_mask_in_length.flatten(), as_tuple=False).flatten()
    seqlens_in_batch = attention_mask_in_length.flatten()[real_indices_idx]
    indices = torch.nonzero(attention_mask_2d.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    b, s = hidden_states.shape[:2]
    return (index_first_axis(hidden_states.reshape(b * s, *hidden_states.shape[2:]), indices), indices,
            cu_seqlens, max_seqlen_in_batch)


class bert_padding:
    index_first_axis = staticmethod(index_first_axis)
    pad_input = staticmethod(pad_input)
    unpad_input = staticmethod(unpad_input)
    unpad_input_for_concatenated_sequences = staticmethod(unpad_input_for_concatenated_sequences)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, return_attn_probs=False, window_size=(-1, -1)):
    # plain-torch stand-in: each (cu_seqlens_q[i]:cu_seqlens_q[i+1]) span of queries attends its own key span
    out = torch.zeros_like(q)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe], k[ks:ke]) * scale
        if causal:
            lq, lk = qe - qs, ke - ks
            allowed = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
            scores = scores.masked_fill(~allowed, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[ks:ke])
    return out


# ---- llmfoundry/data/packing.py ----
def _combine_in_place(example, add_on):
    if "labels" in add_on:
        # Prevents the last token in example from being trained to
        # predict the first token in add_on, which would make no sense.
        add_on["labels"][0] = CROSS_ENTROPY_IGNORE_INDEX
    for k in example.keys():
        if k == "sequence_id":
            example[k] = torch.cat([example[k], add_on[k] + 1 + torch.max(example[k])])
        else:
            example[k] = torch.cat([example[k], add_on[k]])
    return example


def _pad_tensor(tensor, pad_value, max_seq_len, padding_side):
    if len(tensor) == max_seq_len:
        return tensor
    t = torch.full((max_seq_len,), pad_value, dtype=tensor.dtype, device=tensor.device)
    if padding_side == "left":
        t[-len(tensor):] = tensor
    elif padding_side == "right":
        t[:len(tensor)] = tensor
    else:
        raise ValueError(f"Unknown {padding_side=}")
    return t


class BinPackCollator:
    def __init__(self, collator, target_batch_size, max_seq_len, pad_token_id, padding_side, max_leftover_bins_to_keep=None):
        self.base_collator = collator
        self.out_size = int(target_batch_size)
        self.max_seq_len = int(max_seq_len)
        self.pad_token_id = int(pad_token_id)
        self.padding_side = padding_side
        self.max_leftover_bins_to_keep = max_leftover_bins_to_keep
        self._leftover_bins = []

    def __call__(self, examples):
        batch = self.base_collator(examples)
        return self.pack(batch)

    def pack(self, batch):
        assert "attention_mask" in batch
        assert "input_ids" in batch
        for key in batch.keys():
            assert key in ["input_ids", "labels", "attention_mask", "sequence_id"]
        sizes, trimmed_examples = self._trim_batch(batch)
        return self._pack_trimmed_examples(trimmed_examples, sizes)

    def _pack_trimmed_examples(self, trimmed_examples, sizes):
        packed_examples, n_packed_tokens, n_total_tokens, leftover_bins = self._first_fit_bin_packing(
            sizes=sizes, examples=trimmed_examples, num_bins=self.out_size, max_bin_size=self.max_seq_len,
            existing_bins=self._leftover_bins)
        self._leftover_bins = leftover_bins[:self.max_leftover_bins_to_keep]
        return self._convert_to_batch(packed_examples)

    def _convert_to_batch(self, packed_examples):
        pad_vals = {"input_ids": self.pad_token_id, "labels": CROSS_ENTROPY_IGNORE_INDEX, "attention_mask": 0,
                    "sequence_id": -1}
        keys = packed_examples[0].keys()
        batch = {}
        for key in keys:
            batch[key] = torch.stack([
                _pad_tensor(example[key], pad_vals[key], self.max_seq_len, self.padding_side)
                for example in packed_examples
            ])
        return batch

    def _first_fit_bin_packing(self, sizes, examples, num_bins, max_bin_size, existing_bins):
        bins = existing_bins
        sorted_sizes_and_examples = sorted(list(zip(sizes, examples)), key=lambda x: x[0], reverse=True)
        num_examples = len(sizes)
        assert num_examples >= max(0, num_bins - len(bins))
        for i, (size, example) in enumerate(sorted_sizes_and_examples):
            required_num_examples = max(0, num_bins - len(bins))
            n_remaining = num_examples - i
            assert n_remaining >= required_num_examples
            if n_remaining == required_num_examples:
                bins.append((size, example))
                continue
            added = False
            for bidx in range(len(bins)):
                if bins[bidx][0] + size <= max_bin_size:
                    bin_size, packed_example = bins.pop(bidx)
                    bin_size = bin_size + size
                    packed_example = _combine_in_place(packed_example, example)
                    bins.append((bin_size, packed_example))
                    added = True
                    break
            if not added:
                bins.append((size, example))
        sorted_bins = sorted(bins, key=lambda x: x[0], reverse=True)
        bin_sizes = [b for b, _ in sorted_bins]
        packed_examples = [e for _, e in sorted_bins]
        return packed_examples[:num_bins], sum(bin_sizes[:num_bins]), sum(sizes), sorted_bins[num_bins:]

    @classmethod
    def _trim_batch(cls, batch):
        sizes, trimmed_examples = [], []
        for idx in range(batch["attention_mask"].shape[0]):
            size, trimmed_example = cls._extract_trim_batch_idx(batch, idx)
            sizes.append(size)
            trimmed_examples.append(trimmed_example)
        return sizes, trimmed_examples

    @classmethod
    def _extract_trim_batch_idx(cls, batch, idx):
        example = {k: v[idx] for k, v in batch.items()}
        keep = example["attention_mask"] == 1
        size = int(keep.sum())
        trim_example = {k: v[keep] for k, v in example.items()}
        trim_example["sequence_id"] = torch.zeros_like(trim_example["input_ids"])
        return size, trim_example


def finetuning_collator(examples, max_seq_len, pad_token_id):
    """Right-padded (prompt, response) batch; labels -100 on the prompt and the padding."""
    batch = {"input_ids": [], "labels": [], "attention_mask": []}
    for prompt, response in examples:
        ids = torch.tensor(prompt + response)
        labels = ids.clone()
        labels[:len(prompt)] = CROSS_ENTROPY_IGNORE_INDEX
        batch["input_ids"].append(_pad_tensor(ids, pad_token_id, max_seq_len, "right"))
        batch["labels"].append(_pad_tensor(labels, CROSS_ENTROPY_IGNORE_INDEX, max_seq_len, "right"))
        batch["attention_mask"].append(_pad_tensor(torch.ones_like(ids), 0, max_seq_len, "right"))
    return {k: torch.stack(v) for k, v in batch.items()}


# ---- llmfoundry/models/mpt/modeling_mpt.py (flash branch) ----
def _get_attn_mask_in_len_seq_one_hot(sequence_id, S, attn_uses_sequence_id, attn_impl, attention_mask):
    attention_mask_in_length = None
    sequence_id_one_hot = None
    if (sequence_id is not None) and attn_uses_sequence_id and (attn_impl == "flash"):
        if (attention_mask is not None) and (attention_mask[:, 0].sum() != attention_mask.shape[0]):
            raise NotImplementedError(
                "Left padding is not supported with flash attention when attn_uses_sequence_id is set to True.")
        if S != sequence_id.shape[-1]:
            raise ValueError(f"Sequence length ({S}) does not match length of sequences in sequence_id "
                             f"({sequence_id.shape[-1]}).")
        if attention_mask is not None:
            sequence_id = sequence_id.masked_fill(~attention_mask, 0)
        sequence_id_one_hot = torch.nn.functional.one_hot(sequence_id)
        if attention_mask is not None:
            sequence_id_one_hot = sequence_id_one_hot.masked_fill(~attention_mask.unsqueeze(-1), 0)
        attention_mask_in_length = sequence_id_one_hot.sum(dim=1)
        attention_mask_in_length = torch.nn.functional.pad(
            attention_mask_in_length, (0, S - attention_mask_in_length.shape[-1]), mode="constant", value=0)
    return attention_mask_in_length, sequence_id_one_hot


def gen_sequence_id_info(sequence_id, S, attn_uses_sequence_id, attn_impl, attention_mask, device):
    attention_mask_in_length, sequence_id_one_hot = _get_attn_mask_in_len_seq_one_hot(
        sequence_id, S, attn_uses_sequence_id, attn_impl, attention_mask)
    if sequence_id_one_hot is not None:
        pos_id_within_seq = sequence_id_one_hot.cumsum(dim=1)
        pos_id_within_seq = sequence_id_one_hot * pos_id_within_seq
        pos_id_within_seq = pos_id_within_seq.sum(dim=-1) - 1
        return attention_mask_in_length, pos_id_within_seq
    return None, torch.arange(S, device=device)[None, :]


def gen_flash_attn_padding_info(bsz, S, past_key_len, device, attention_mask_in_length=None, attention_mask=None):
    flash_attn_padding_info = {}
    if attention_mask_in_length is None:
        key_padding_mask = attention_mask
        if key_padding_mask is None:
            key_padding_mask = torch.ones((bsz, past_key_len + S), dtype=torch.bool, device=device)
        query_padding_mask = key_padding_mask[:, -S:]
        unpadding_function = bert_padding.unpad_input
    else:
        key_padding_mask = attention_mask_in_length
        query_padding_mask = attention_mask_in_length
        unpadding_function = bert_padding.unpad_input_for_concatenated_sequences

    _, indices_q, cu_seqlens_q, max_seqlen_q, *_ = unpadding_function(
        torch.empty(bsz, S, 1, device=device), query_padding_mask)
    _, indices_k, cu_seqlens_k, max_seqlen_k, *_ = unpadding_function(
        torch.empty(bsz, past_key_len + S, 1, device=device), key_padding_mask)
    _, indices_v, *_ = unpadding_function(torch.empty(bsz, past_key_len + S, 1, device=device), key_padding_mask)

    flash_attn_padding_info["indices_q"] = indices_q
    flash_attn_padding_info["indices_k"] = indices_k
    flash_attn_padding_info["indices_v"] = indices_v
    flash_attn_padding_info["cu_seqlens_q"] = cu_seqlens_q
    flash_attn_padding_info["cu_seqlens_k"] = cu_seqlens_k
    flash_attn_padding_info["max_seqlen_q"] = max_seqlen_q
    flash_attn_padding_info["max_seqlen_k"] = max_seqlen_k
    return flash_attn_padding_info


# ---- llmfoundry/models/layers/attention.py ----
def repeat_kv_for_gqa(hidden, n_rep):
    if n_rep == 1:
        return hidden
    b, s, kv_n_heads, d = hidden.shape
    hidden = hidden[:, :, :, None, :].expand(b, s, kv_n_heads, n_rep, d)
    return hidden.reshape(b, s, kv_n_heads * n_rep, d)


def _reset_is_causal(num_query_tokens, num_key_tokens, original_is_causal):
    if original_is_causal and num_query_tokens != num_key_tokens:
        if num_query_tokens != 1:
            raise NotImplementedError("MPT does not support query and key with different number of tokens, "
                                      "unless number of query tokens is 1.")
        return False
    return original_is_causal


def flash_attn_fn(query, key, value, n_heads, kv_n_heads, past_key_value=None, softmax_scale=None, attn_bias=None,
                  key_padding_mask=None, is_causal=False, dropout_p=0.0, training=False, needs_weights=False,
                  should_repeat_kv_for_gqa=True, sliding_window_size=-1, alibi_slopes=None,
                  flash_attn_padding_info=None, attn_logit_softcapping=None):
    if key_padding_mask is not None:
        raise ValueError("key_padding_mask should be None for flash attn.")
    if flash_attn_padding_info is None:
        raise ValueError("flash_attn_padding_info is required for flash attn.")
    if past_key_value is not None:
        if len(past_key_value) != 0:
            key = torch.cat([past_key_value[0], key], dim=1)
            value = torch.cat([past_key_value[1], value], dim=1)
        past_key_value = (key, value)
    if attn_bias is not None:
        raise NotImplementedError("attn_bias not implemented for flash attn.")

    batch_size, seqlen = query.shape[:2]
    indices_q = flash_attn_padding_info["indices_q"]
    indices_k = flash_attn_padding_info["indices_k"]
    indices_v = flash_attn_padding_info["indices_v"]
    cu_seqlens_q = flash_attn_padding_info["cu_seqlens_q"]
    cu_seqlens_k = flash_attn_padding_info["cu_seqlens_k"]
    max_seqlen_q = flash_attn_padding_info["max_seqlen_q"]
    max_seqlen_k = flash_attn_padding_info["max_seqlen_k"]

    query_unpad = bert_padding.index_first_axis(query.reshape(batch_size * seqlen, -1), indices_q)
    query_unpad = query_unpad.reshape(query_unpad.shape[0], n_heads, -1)
    key_unpad = bert_padding.index_first_axis(key.reshape(key.shape[0] * key.shape[1], -1), indices_k)
    key_unpad = key_unpad.reshape(key_unpad.shape[0], kv_n_heads, -1)
    value_unpad = bert_padding.index_first_axis(value.reshape(value.shape[0] * value.shape[1], -1), indices_v)
    value_unpad = value_unpad.reshape(value_unpad.shape[0], kv_n_heads, -1)

    if should_repeat_kv_for_gqa:
        if kv_n_heads == 1:
            key_unpad = key_unpad.expand(key_unpad.size(0), n_heads, key_unpad.size(-1))
            value_unpad = value_unpad.expand(value_unpad.size(0), n_heads, value_unpad.size(-1))
        elif kv_n_heads < n_heads:
            key_unpad = repeat_kv_for_gqa(key_unpad.view(1, key_unpad.size(0), kv_n_heads, -1),
                                          n_heads // kv_n_heads).view(key_unpad.size(0), n_heads, -1)
            value_unpad = repeat_kv_for_gqa(value_unpad.view(1, value_unpad.size(0), kv_n_heads, -1),
                                            n_heads // kv_n_heads).view(value_unpad.size(0), n_heads, -1)

    dropout_p = dropout_p if training else 0.0
    reset_is_causal = _reset_is_causal(query.size(1), key.size(1), is_causal)
    output_unpad = flash_attn_varlen_func(
        q=query_unpad, k=key_unpad, v=value_unpad, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale,
        causal=reset_is_causal, return_attn_probs=needs_weights,
        window_size=(sliding_window_size, sliding_window_size))
    output = bert_padding.pad_input(output_unpad.reshape(output_unpad.shape[0], -1), indices_q, batch_size, seqlen)
    return output, None, past_key_value


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    # transformers >= 4.38 form
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class LlamaRotaryEmbeddingFoundry(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_model, n_heads, kv_n_heads):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.kv_n_heads = kv_n_heads
        self.head_dim = d_model // n_heads
        self.softmax_scale = 1 / math.sqrt(self.d_model / self.n_heads)
        self.attn_dropout_p = 0.0
        self.Wqkv = nn.Linear(d_model, d_model + 2 * kv_n_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.attn_fn = flash_attn_fn

    def get_qkv(self, x):
        qkv = self.Wqkv(x)
        query, key, value = qkv.split(
            [self.d_model, self.kv_n_heads * self.head_dim, self.kv_n_heads * self.head_dim], dim=2)
        return query, key, value

    def _apply_rotary_embeddings(self, rotary_emb_w_meta_info, query, key, value):
        rotary_emb = rotary_emb_w_meta_info["rotary_emb"]
        offset_info = rotary_emb_w_meta_info["offset_info"]
        bsz, seqlen = query.shape[:2]
        query = query.view(bsz, seqlen, -1, self.head_dim)
        key = key.view(bsz, seqlen, -1, self.head_dim)
        (cos, sin) = rotary_emb(x=value, position_ids=offset_info)
        query, key = apply_rotary_pos_emb(q=query, k=key, cos=cos, sin=sin, position_ids=None, unsqueeze_dim=2)
        return query.view(bsz, seqlen, -1), key.view(bsz, seqlen, -1), value

    def forward(self, x, past_key_value=None, attn_bias=None, attention_mask=None, rotary_emb_w_meta_info=None,
                is_causal=True, needs_weights=False, alibi_slopes=None, flash_attn_padding_info=None):
        query, key, value = self.get_qkv(x)
        if rotary_emb_w_meta_info is not None:
            query, key, value = self._apply_rotary_embeddings(rotary_emb_w_meta_info, query, key, value)
        # get_implementation_specific_args for flash: key_padding_mask stays None, padding info goes in
        context, attn_weights, past_key_value = self.attn_fn(
            query, key, value, n_heads=self.n_heads, kv_n_heads=self.kv_n_heads, past_key_value=past_key_value,
            softmax_scale=self.softmax_scale, attn_bias=attn_bias, is_causal=is_causal, dropout_p=self.attn_dropout_p,
            training=self.training, needs_weights=needs_weights, alibi_slopes=alibi_slopes,
            flash_attn_padding_info=flash_attn_padding_info)
        return self.out_proj(context), attn_weights, past_key_value


class MPTBlock(nn.Module):
    def __init__(self, d_model, n_heads, kv_n_heads, expansion_ratio):
        super().__init__()
        self.norm_1 = nn.LayerNorm(d_model)
        self.attn = GroupedQueryAttention(d_model, n_heads, kv_n_heads)
        self.norm_2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, expansion_ratio * d_model, bias=False), nn.GELU(approximate="none"),
                                 nn.Linear(expansion_ratio * d_model, d_model, bias=False))

    def forward(self, x, past_key_value=None, attn_bias=None, rotary_emb_w_meta_info=None, attention_mask=None,
                is_causal=True, alibi_slopes=None, flash_attn_padding_info=None):
        a = self.norm_1(x)
        b, attn_weights, past_key_value = self.attn(
            a, past_key_value=past_key_value, attn_bias=attn_bias, rotary_emb_w_meta_info=rotary_emb_w_meta_info,
            attention_mask=attention_mask, is_causal=is_causal, alibi_slopes=alibi_slopes,
            flash_attn_padding_info=flash_attn_padding_info)
        x = x + b
        x = x + self.ffn(self.norm_2(x))
        return x, attn_weights, past_key_value


class MPTConfig:
    def __init__(self, **kw):
        self.d_model = 64
        self.n_heads = 4
        self.n_layers = 2
        self.expansion_ratio = 2
        self.max_seq_len = 32
        self.vocab_size = 101
        self.attn_config = {"attn_impl": "flash", "attn_uses_sequence_id": True, "alibi": False, "rope": True,
                            "rope_impl": "hf", "rope_theta": 10000, "kv_n_heads": 2}
        self.learned_pos_emb = False
        self.__dict__.update(kw)


class MPTForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.attn_impl = config.attn_config["attn_impl"]
        self.attn_uses_sequence_id = config.attn_config["attn_uses_sequence_id"]
        self.rope = config.attn_config["rope"]
        self.rope_impl = config.attn_config["rope_impl"]
        self.learned_pos_emb = config.learned_pos_emb
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        nn.init.normal_(self.wte.weight, std=0.02)  # init_config 'kaiming_normal_' / emb_init_std scale, trimmed
        self.blocks = nn.ModuleList([
            MPTBlock(config.d_model, config.n_heads, config.attn_config["kv_n_heads"], config.expansion_ratio)
            for _ in range(config.n_layers)])
        self.norm_f = nn.LayerNorm(config.d_model)
        self.rotary_embedding = LlamaRotaryEmbeddingFoundry(config.d_model // config.n_heads,
                                                            config.attn_config["rope_theta"])
        self.is_causal = True

    def forward(self, input_ids, attention_mask=None, sequence_id=None, position_ids=None):
        # MPTModel.forward (flash path, no kv cache) + MPTForCausalLM's tied lm head
        if attention_mask is not None:
            attention_mask = attention_mask.bool()
        if self.training and attention_mask is not None and attention_mask[:, 0].sum() != attention_mask.shape[0]:
            raise NotImplementedError("MPT does not support training with left padding.")
        bsz = input_ids.size(0)
        x = self.wte(input_ids)
        S = x.size(1)
        past_position = 0
        rotary_emb_w_meta_info = None
        if self.learned_pos_emb or (self.rope and self.rope_impl == "hf"):
            if position_ids is None:
                pos = torch.arange(past_position, S + past_position, dtype=torch.long,
                                   device=input_ids.device).unsqueeze(0)
            else:
                pos = position_ids
            if attention_mask is not None:
                # adjust the position indices to account for padding tokens
                pos = torch.clamp(pos - torch.cumsum((~attention_mask).to(torch.int32), dim=1)[:, past_position:],
                                  min=0)
            rotary_emb_w_meta_info = {"impl": self.rope_impl, "rotary_emb": self.rotary_embedding,
                                      "offset_info": pos, "seq_len": S + past_position}
        # _attn_bias: "flash will incorporate any attention_mask inside the attention module"
        attn_bias = None
        attention_mask_in_length, pos_id_within_seq = gen_sequence_id_info(
            sequence_id=sequence_id, S=S, attn_uses_sequence_id=self.attn_uses_sequence_id, attn_impl=self.attn_impl,
            attention_mask=attention_mask, device=x.device)
        flash_attn_padding_info = {}
        if self.attn_impl == "flash":
            flash_attn_padding_info = gen_flash_attn_padding_info(
                bsz, S, past_position, x.device, attention_mask_in_length, attention_mask)
        for block in self.blocks:
            x, _, _ = block(x, past_key_value=None, attn_bias=attn_bias,
                            rotary_emb_w_meta_info=rotary_emb_w_meta_info, attention_mask=attention_mask,
                            is_causal=self.is_causal, flash_attn_padding_info=flash_attn_padding_info)
        x = self.norm_f(x)
        return F.linear(x, self.wte.weight)


def get_targets(labels):
    targets = torch.roll(labels, shifts=-1)
    targets[:, -1] = CROSS_ENTROPY_IGNORE_INDEX
    return targets


def compute_loss_from_logits(logits, labels, loss_fn):
    targets = get_targets(labels)
    losses = loss_fn(logits.view(-1, logits.size(-1)), targets.view(-1))
    if torch.all(targets == loss_fn.ignore_index):
        return losses.sum()
    return losses.sum() / (targets != loss_fn.ignore_index).sum()


def main():
    config = MPTConfig()
    model = MPTForCausalLM(config)
    model.train()  # composer trains in train mode; no dropout in this config
    loss_fn = nn.CrossEntropyLoss(ignore_index=CROSS_ENTROPY_IGNORE_INDEX, reduction="none")
    g = torch.Generator().manual_seed(3)

    def rand_ids(n):
        return torch.randint(1, config.vocab_size, (n,), generator=g).tolist()

    # six (prompt, response) examples, packed 6 -> 3 rows of max_seq_len 16 (packing_ratio 2)
    examples = [(rand_ids(p), rand_ids(r)) for p, r in [(3, 6), (2, 3), (4, 4), (1, 3), (5, 6), (2, 2)]]
    max_seq_len, pad_token_id = 16, 0
    collator = BinPackCollator(
        collator=lambda ex: finetuning_collator(ex, max_seq_len, pad_token_id), target_batch_size=3,
        max_seq_len=max_seq_len, pad_token_id=pad_token_id, padding_side="right")
    batch = collator(examples)
    assert (batch["sequence_id"] >= 0).sum(1).tolist() == batch["attention_mask"].sum(1).tolist()
    assert int(batch["sequence_id"].max()) >= 1  # some row holds more than one example

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   sequence_id=batch["sequence_id"])
    loss = compute_loss_from_logits(logits, batch["labels"], loss_fn)

    # reference: each example alone, unpadded, one span per row
    total, count, seen = 0.0, 0, 0
    for prompt, response in examples:
        ids = torch.tensor([prompt + response])
        labels = ids.clone()
        labels[0, :len(prompt)] = CROSS_ENTROPY_IGNORE_INDEX
        ref = model(input_ids=ids)
        targets = get_targets(labels)
        total = total + loss_fn(ref[0], targets[0]).sum()
        count += int((targets != CROSS_ENTROPY_IGNORE_INDEX).sum())
        # locate the example in the packed batch
        found = False
        for row in range(batch["input_ids"].shape[0]):
            for sid in batch["sequence_id"][row].unique().tolist():
                if sid < 0:
                    continue
                where = batch["sequence_id"][row] == sid
                if torch.equal(batch["input_ids"][row][where], ids[0]):
                    torch.testing.assert_close(logits[row][where], ref[0], atol=3e-5, rtol=1e-4)
                    found = True
        assert found
        seen += 1
    assert seen == len(examples)
    torch.testing.assert_close(loss, total / count, atol=1e-5, rtol=1e-5)

    loss.backward()  # the packed step trains
    assert model.blocks[0].attn.Wqkv.weight.grad is not None
    print(f"ok: packed loss {loss.item():.4f} over {count} targets matches the examples run alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
