# Citation: apple/ml-recurrent-drafter @bd8586bb9bbfa761644c36f932a0cd1eb3f1cdf9 (ReDrafter, PyTorch):
#   recurrent_drafting/attention.py (causal_mask from a padding mask, sliced to the last query_len rows; bias:
#   False -> finfo.min), recurrent_drafting/tree_attention.py (pack: beams deduplicated by shared prefix into one
#   packed row, _get_causal_mask = left-padded causal mask over the kv so far + the packed beams' tree mask
#   scattered into the bottom-right block; unpack), recurrent_drafting/kv_cache.py (View.cat into a preallocated
#   cache), recurrent_drafting/modeling_llama.py (SDPA with attn_mask=bias, RoPE from position_ids),
#   recurrent_drafting/recurrent_drafting.py (_comprehend_prompt, _verify_candidates with
#   position_ids = cache length - left pads + position_offsets, greedy acceptance, _update_kv_cache_and_input_ids
#   re-aligning the cache right and left-padding the batch again).
# A left-padded batch of two prompts, a tiny Llama (transformers LlamaConfig), three speculative steps of 4 beams of
# length 4 whose first token is the LLM's token and which share prefixes (so packing merges them). The drafter RNN
# is replaced by beams built here (one beam follows the reference continuation for a row-dependent number of tokens,
# the others diverge). Checked against each prompt alone, unpadded, recomputed from scratch with a double-loop
# causal mask: every unpacked verification logit (prompt + that beam) and the final greedy tokens.
from typing import Tuple

import torch
import torch.nn as nn
from transformers import LlamaConfig

torch.manual_seed(0)
PAD = 0


# ---- recurrent_drafting/attention.py
def causal_mask(padding_mask, query_len, device):
    batch_size, key_value_len = padding_mask.shape
    causal_mask = torch.tril(torch.full((key_value_len, key_value_len), fill_value=True, device=device))
    batch_causal_mask = causal_mask[None, :, :].repeat(batch_size, 1, 1)
    batch_causal_mask = batch_causal_mask.masked_fill(padding_mask[:, None, :].eq(0), False)
    assert query_len > 0
    return batch_causal_mask[:, -query_len:, :]


def bias(causal_mask, dtype):
    attn_bias = torch.zeros(causal_mask.shape, dtype=dtype, device=causal_mask.device)
    return attn_bias.masked_fill_(causal_mask.logical_not(), torch.finfo(dtype).min)


# ---- recurrent_drafting/tree_attention.py
def _dedup_prefix(beams):
    dtype = beams.dtype
    beam_length = beams.shape[2]
    prefix_target = torch.arange(1, beam_length + 1, dtype=dtype)
    matches = (beams[:, :, None] == beams[:, None, :]).to(dtype)
    seq_matches = (torch.cumsum(matches, dim=3) == prefix_target[None, None, None, :]).to(dtype)
    return torch.argmax(seq_matches, dim=2)


def _pack_beams(beams, prefix_tree):
    dtype = beams.dtype
    batch_size, beam_width, _ = beams.shape
    ith_row_has_value_i = torch.arange(beam_width)[None, :, None]
    pack_mask = (prefix_tree == ith_row_has_value_i).reshape(batch_size, -1)
    locations = torch.nonzero(pack_mask)
    flattened_beams = beams.view((batch_size, -1))
    selected_tokens = flattened_beams[locations[:, 0], locations[:, 1]]
    n_selected = pack_mask.sum(dim=1)
    max_n_selected = int(n_selected.max())
    starts = torch.cumsum(n_selected, dim=0) - n_selected
    select_indices = starts[:, None] + torch.arange(max_n_selected, dtype=dtype)
    select_indices = torch.minimum(select_indices, torch.full_like(select_indices, selected_tokens.numel() - 1)).view(-1)
    packed_beams = torch.gather(selected_tokens, dim=0, index=select_indices).reshape(batch_size, -1)
    packed_token_indices = torch.gather(locations[:, 1], dim=0, index=select_indices).reshape(batch_size, -1)
    return packed_beams, packed_token_indices


def _get_unpacker(beams, prefix_tree):
    dtype = beams.dtype
    batch_size, beam_width, beam_length = beams.shape
    ith_row_has_value_i = torch.arange(beam_width)[None, :, None]
    pack_mask = prefix_tree == ith_row_has_value_i
    n_selected_per_seq = pack_mask.sum(dim=-1)
    start_per_seq = n_selected_per_seq.cumsum(dim=-1) - n_selected_per_seq
    segment_index = torch.gather(start_per_seq, dim=1, index=prefix_tree.view(batch_size, -1)).view(
        batch_size, beam_width, beam_length)
    match = segment_index[:, :, :, None] == segment_index[:, :, None, :]
    seq_index = torch.arange(beam_length, dtype=dtype)
    lower_triangle = seq_index[:, None] > seq_index[None, :]
    offset = (match * lower_triangle[None, None, :, :]).sum(dim=-1)
    return segment_index + offset


def _get_causal_mask_of_packed_beams(unpacker, packed_token_indices):
    batch_size, beam_width, beam_length = unpacker.shape
    n_selected = packed_token_indices.shape[1]
    arange_batch = torch.arange(batch_size).unsqueeze(dim=1)
    arange_all_candidate_tokens = torch.arange(beam_length * beam_width)
    packed_token_beams = packed_token_indices // beam_length
    causal_mask_of_packed_beams = torch.full(size=(batch_size, n_selected, n_selected), fill_value=False,
                                             dtype=torch.bool)
    beam_blocks = arange_all_candidate_tokens // beam_length
    lower_triangular_mask = arange_all_candidate_tokens.unsqueeze(-1) - arange_all_candidate_tokens.unsqueeze(0) >= 0
    block_diagonal_mask = beam_blocks.unsqueeze(-1) - beam_blocks.unsqueeze(0) == 0
    causal_mask_of_beams = torch.logical_and(lower_triangular_mask, block_diagonal_mask)[None, :, :].expand(
        batch_size, -1, -1)
    selected_token_mask = causal_mask_of_beams[arange_batch, packed_token_indices]
    src_idx = packed_token_beams.unsqueeze(dim=-1) * beam_length + torch.arange(beam_length)[None, None, :]
    src_mask = torch.gather(selected_token_mask, dim=2, index=src_idx)
    tgt_idx = torch.gather(unpacker, dim=1,
                           index=packed_token_beams[:, :, None].expand(batch_size, n_selected, beam_length))
    causal_mask_of_packed_beams.scatter_(dim=2, index=tgt_idx, src=src_mask)
    return causal_mask_of_packed_beams


def _get_causal_mask(padding_mask, unpacker, packed_token_indices):
    batch_size, n_selected = packed_token_indices.shape
    previous_seq_len = padding_mask.shape[1]
    extended_padding_mask = torch.cat((padding_mask, torch.full((batch_size, n_selected), True)), dim=-1)
    mask = causal_mask(extended_padding_mask, previous_seq_len + n_selected, unpacker.device)
    mask[:, previous_seq_len:, previous_seq_len:] = _get_causal_mask_of_packed_beams(unpacker, packed_token_indices)
    return mask


def pack(beams, padding_mask):
    prefix_tree = _dedup_prefix(beams)
    unpacker = _get_unpacker(beams, prefix_tree)
    packed_beams, packed_token_indices = _pack_beams(beams, prefix_tree)
    position_offsets = packed_token_indices % beams.shape[2]
    mask = _get_causal_mask(padding_mask, unpacker, packed_token_indices)
    mask = mask[:, -packed_beams.shape[1]:, :]
    return packed_beams, unpacker, mask, position_offsets


def unpack(packed_tensor, unpacker):
    last_dim_size = packed_tensor.shape[2]
    batch_size, beam_width, beam_length = unpacker.shape
    idx = unpacker.view(batch_size, beam_width * beam_length, 1).expand(-1, -1, last_dim_size)
    return torch.gather(packed_tensor, 1, idx).reshape(batch_size, beam_width, beam_length, -1)


# ---- recurrent_drafting/kv_cache.py
class View:
    def __init__(self, cache, layer, kv):
        self._cache, self._layer, self._kv = cache, layer, kv
        self.length = 0

    @property
    def shape(self):
        _, _, batch_size, n_heads, _, head_dim = self._cache.shape
        return (batch_size, n_heads, self.length, head_dim)

    def cat(self, new_kv):
        new_length = new_kv.shape[2]
        assert self.length + new_length <= self._cache.shape[4]
        self._cache[self._layer, self._kv, :, :, self.length:self.length + new_length, :] = new_kv
        self.length += new_length
        return self._cache[self._layer, self._kv, :, :, 0:self.length, :]

    def slice(self, prev):
        return self._cache[self._layer, self._kv, :, :, prev:self.length, :]


class Cache:
    def __init__(self, batch_size, max_length, n_layers, n_heads, head_dim, dtype):
        self._cache = torch.zeros([n_layers, 2, batch_size, n_heads, max_length, head_dim], dtype=dtype)
        self.sliced = tuple((View(self._cache, layer, 0), View(self._cache, layer, 1)) for layer in range(n_layers))


# ---- recurrent_drafting/modeling_llama.py (tiny, same layout)
class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    def rotate_half(x):
        x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)
    cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.n_kv_heads = config.num_key_value_heads
        self.n_kv_groups = self.num_heads // self.n_kv_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        rope_theta = config.rope_parameters["rope_theta"]  # transformers 5 keeps config.rope_theta here
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        emb = torch.cat([torch.outer(torch.arange(2048).float(), inv_freq)] * 2, dim=-1)
        self.cos_cached, self.sin_cached = emb.cos()[None, None], emb.sin()[None, None]

    def forward(self, hidden_states, position_ids, past_key_value, attention_bias):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, self.cos_cached, self.sin_cached,
                                                        position_ids)
        past_key, past_value = past_key_value
        key_states = past_key.cat(key_states)  # in-place
        value_states = past_value.cat(value_states)  # in-place
        key_states = torch.repeat_interleave(key_states, dim=1, repeats=self.n_kv_groups)
        value_states = torch.repeat_interleave(value_states, dim=1, repeats=self.n_kv_groups)
        attn_output = torch.nn.functional.scaled_dot_product_attention(query_states, key_states, value_states,
                                                                       attn_mask=attention_bias)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_ids, past_key_value, attention_bias):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_ids,
                                                       past_key_value, attention_bias)
        h = self.post_attention_layernorm(hidden_states)
        return hidden_states + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, position_ids, past_key_values):
        hidden_states = self.embed_tokens(input_ids)
        attention_bias = bias(attention_mask.unsqueeze(dim=1), dtype=hidden_states.dtype)
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, attention_bias=attention_bias, position_ids=position_ids,
                                  past_key_value=past_key_values[i])
        hidden_states = self.norm(hidden_states)
        return self.lm_head(hidden_states).float(), hidden_states


# ---- recurrent_drafting/recurrent_drafting.py (greedy path)
def _select_one_per_row(x, batch_index):
    return x[torch.arange(x.shape[0]), batch_index]


def _count_left_paddings(tokens, pad_token_id):
    return torch.sum(torch.cumprod(torch.eq(tokens, pad_token_id), dim=-1), dim=-1)


def _comprehend_prompt(llm, input_ids, cache, pad_token_id):
    mask = causal_mask(input_ids != pad_token_id, input_ids.shape[1], input_ids.device)
    position_ids = torch.arange(input_ids.shape[1], dtype=torch.long).expand(input_ids.shape) - _count_left_paddings(
        input_ids, pad_token_id).unsqueeze(dim=-1)
    logits, hidden = llm(input_ids, past_key_values=cache.sliced, attention_mask=mask, position_ids=position_ids)
    return hidden[:, -1, :], torch.argmax(logits[:, -1, :], dim=-1)


def _verify_candidates(llm, input_ids, beams, cache, pad_token_id):
    packed_beams, unpacker, attention_mask, position_offsets = pack(
        beams, padding_mask=(input_ids != pad_token_id).to(input_ids.dtype))
    past_kv_len = cache.sliced[0][0].length - _count_left_paddings(input_ids, pad_token_id).unsqueeze(dim=-1)
    logits, hidden = llm(packed_beams, attention_mask=attention_mask, past_key_values=cache.sliced,
                         position_ids=past_kv_len + position_offsets)
    hidden_states = unpack(hidden, unpacker)
    logits = unpack(logits, unpacker)
    # cache.unpack(input_ids.shape[-1], unpacker): the packed keys laid out again beam by beam
    n_cand = unpacker.shape[1] * unpacker.shape[2]
    L = input_ids.shape[-1]
    c = cache._cache
    idx = (L + unpacker.view(1, 1, c.shape[2], 1, n_cand, 1)).expand(c.shape[0], 2, -1, c.shape[3], -1, c.shape[5])
    c[:, :, :, :, L:L + n_cand, :] = torch.clone(torch.gather(c, 4, idx))
    for key, value in cache.sliced:
        key.length = value.length = L + n_cand
    return hidden_states, logits


def _update_kv_cache_and_input_ids(input_ids, n_tokens_in_seq, seq_in_beam, beams, cache, pad_token_id):
    batch_size, beam_width, beam_length = beams.shape
    num_prev_left_pads = _count_left_paddings(input_ids, pad_token_id)
    n_tokens_in_seq_with_init = n_tokens_in_seq + 1
    seq_len = input_ids.shape[1] - num_prev_left_pads + n_tokens_in_seq_with_init
    max_seq_len = torch.max(seq_len)
    num_realigned_left_pads = max_seq_len - seq_len
    selected_seqs = _select_one_per_row(beams, seq_in_beam)
    _, _, _, n_heads, _, head_dim = cache._cache.shape
    past_kv_length = input_ids.shape[1]
    seq_idx = seq_in_beam[:, None].expand(batch_size, n_heads).reshape(-1)
    for past_key, past_value in cache.sliced:
        present_key = past_key.slice(past_kv_length).reshape(batch_size * n_heads, beam_width, beam_length, head_dim)
        present_value = past_value.slice(past_kv_length).reshape(batch_size * n_heads, beam_width, beam_length,
                                                                 head_dim)
        past_key.length = past_value.length = past_kv_length
        past_key.cat(_select_one_per_row(present_key, seq_idx).reshape(batch_size, n_heads, beam_length, head_dim))
        past_value.cat(_select_one_per_row(present_value, seq_idx).reshape(batch_size, n_heads, beam_length, head_dim))
    combined_key_value = cache._cache[:, :, :, :, :cache.sliced[0][0].length, :].clone()
    for i in range(batch_size):
        start = num_prev_left_pads[i]
        end = input_ids.shape[1] + n_tokens_in_seq_with_init[i]
        cache._cache[:, :, i, :, num_realigned_left_pads[i]:max_seq_len, :] = combined_key_value[:, :, i, :, start:end, :]
    appended_input_ids = torch.full((batch_size, int(max_seq_len)), pad_token_id, dtype=input_ids.dtype)
    for i in range(batch_size):
        start = num_realigned_left_pads[i]
        end = start + input_ids.shape[1] - num_prev_left_pads[i]
        appended_input_ids[i, start:end] = input_ids[i, num_prev_left_pads[i]:]
        start = end
        end = start + n_tokens_in_seq_with_init[i]
        appended_input_ids[i, start:end] = selected_seqs[i, :n_tokens_in_seq_with_init[i]]
    for key, value in cache.sliced:
        key.length = value.length = appended_input_ids.shape[1]
    return appended_input_ids


def _greedy_accept(input_ids, beams, logits_by_llm, cache, pad_token_id):
    beams_by_llm = torch.argmax(logits_by_llm, dim=-1)
    compare = beams[:, :, 1:] == beams_by_llm[:, :, :-1]
    n_tokens_in_seq, seq_in_beam = torch.max(torch.sum(torch.cumprod(compare, dim=-1), dim=-1), dim=-1)
    input_ids = _update_kv_cache_and_input_ids(input_ids, n_tokens_in_seq, seq_in_beam, beams, cache, pad_token_id)
    next_tokens = _select_one_per_row(_select_one_per_row(beams_by_llm, seq_in_beam), n_tokens_in_seq)
    return input_ids, next_tokens, n_tokens_in_seq


# ---- reference: one sequence alone, from scratch, double-loop causal mask
def reference_logits(llm, ids):
    n = len(ids)
    keep = torch.zeros(1, n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            keep[0, i, j] = j <= i
    cfg = llm.config
    cache = Cache(1, n, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                  torch.float32)
    logits, _ = llm(torch.tensor([ids]), keep, torch.arange(n)[None], cache.sliced)
    return logits[0]


def reference_greedy(llm, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(reference_logits(llm, ids)[-1].argmax()))
    return ids


def main():
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD, rms_norm_eps=1e-6)
    llm = LlamaForCausalLM(config).eval()
    prompts = [[5, 17, 3, 9, 22, 11, 6], [14, 2, 30, 8]]
    W, BL, steps = 4, 4, 3
    gold = [reference_greedy(llm, p, 1 + steps * BL) for p in prompts]

    with torch.no_grad():
        P = max(len(p) for p in prompts)
        input_ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])
        cache = Cache(2, 64, config.num_hidden_layers, config.num_key_value_heads,
                      config.hidden_size // config.num_attention_heads, torch.float32)
        _, next_tokens = _comprehend_prompt(llm, input_ids, cache, PAD)
        g = torch.Generator().manual_seed(1)
        for step in range(steps):
            beams = torch.randint(1, config.vocab_size, (2, W, BL), generator=g)
            beams[:, :, 0] = next_tokens[:, None]
            for b in range(2):
                done = len(input_ids[b]) - int(_count_left_paddings(input_ids[b:b + 1], PAD))
                good = gold[b][done:done + BL]
                k = (step + b) % BL + 1  # beam 1 follows the reference for k tokens
                beams[b, 1, :k] = torch.tensor(good[:k])
                beams[b, 2, :2] = beams[b, 1, :2]  # beam 2 shares a prefix with beam 1
                beams[b, 3, :3] = beams[b, 0, :3]  # beam 3 shares a prefix with beam 0
            _, logits = _verify_candidates(llm, input_ids, beams, cache, PAD)
            for b in range(2):
                prefix = input_ids[b, int(_count_left_paddings(input_ids[b:b + 1], PAD)):].tolist()
                for w in range(W):
                    ref = reference_logits(llm, prefix + beams[b, w].tolist())[-BL:]
                    assert torch.allclose(logits[b, w], ref, atol=1e-4), (step, b, w)
            input_ids, next_tokens, _ = _greedy_accept(input_ids, beams, logits, cache, PAD)

        for b in range(2):
            out = input_ids[b, int(_count_left_paddings(input_ids[b:b + 1], PAD)):].tolist() + [int(next_tokens[b])]
            assert out == gold[b][:len(out)], (b, out, gold[b])
            assert len(out) > len(prompts[b]) + steps, b
    print("ok: ReDrafter packed beam tree verification over a left-padded KV cache matches per-sequence reference")


if __name__ == "__main__":
    main()
