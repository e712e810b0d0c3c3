# Correct program (quiet batch quiet-r161a).
# Ported from SafeAILab/EAGLE @2320d52e443672367a7b8447160f81af8318d1b1, eagle/modelbsne1/ (EAGLE-1 with
# batch size > 1 over left-padded prompts):
#   modeling_llama_kv.py: _make_causal_mask, _expand_mask, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half,
#     apply_rotary_pos_emb (cos[position_ids]), LlamaMLP, repeat_kv, LlamaAttention.forward (eager softmax over
#     q @ k^T + additive mask, keys appended with KVCache.cat), LlamaDecoderLayer, LlamaModel.forward and
#     _prepare_decoder_attention_mask (causal + expanded 2-D mask, then the tree mask written as min() into the
#     last tree_len x tree_len block for every row);
#   kv_cache.py: KVCache (preallocated data, current_length shared by all rows), initialize_past_key_values;
#   utils.py: generate_tree_buffers, initialize_tree (position_ids = cumsum(attention_mask) - 1), generate_candidates,
#     tree_decoding (positions = tree depth + input_ids.shape[1] - number of zeros in the row's mask),
#     evaluate_posterior (greedy branch), update_inference_inputs (every row advances by max accept + 1; a row that
#     accepted fewer gets zeros in its attention_mask for the rest, holes in the middle of its mask; the accepted
#     nodes' K/V copied to prev_input_len.. by advanced indexing);
#   ea_model.py: EaModel.forward and eagenerate (greedy).
# Trimmed: greedy only (no logits processor), one device, no rope scaling, pretraining_tp = 1. The EAGLE draft head
# (cnets.Model.topK_genrate with its own stable_kv) is replaced by a small draft LM with the same vocabulary that
# keeps each row's tokens and returns the top-10 tokens of every expanded tree node in the layout topK_genrate
# returns (group by group, as generate_tree_buffers indexes them with TOPK * group + choice + 1).
# Target: a tiny random LLaMA (float32, GQA 4 heads / 2 KV heads), three prompts of lengths 5, 9, 7, left-padded.
# Checks, against a LLaMA forward written by hand over one unpadded row (no cache, no padding, explicit causal
# softmax, rotary at 0..n-1): every node of every verify tree, in every row, gets the logits of the row's text so
# far plus the node's root-to-node path; and each row's emitted tokens equal plain greedy decoding of that row.
import sys
import math
import copy
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.activations import ACT2FN

torch.manual_seed(0)
torch.set_num_threads(1)

TOPK = 10  # topk for sparse tree


# ---------------------------------------------------------------- modeling_llama_kv.py
def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat(
            [torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask],
            dim=-1,
        )
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask, dtype, tgt_len=None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float().to(device) / self.dim))
        self.register_buffer("inv_freq", inv_freq)
        self._set_cos_sin_cache(
            seq_len=max_position_embeddings, device=self.inv_freq.device, dtype=torch.get_default_dtype()
        )

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len
        t = torch.arange(self.max_seq_len_cached, device=device, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :].to(dtype), persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :].to(dtype), persistent=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len=seq_len, device=x.device, dtype=x.dtype)
        return (
            self.cos_cached[:, :, :seq_len, ...].to(dtype=x.dtype),
            self.sin_cached[:, :, :seq_len, ...].to(dtype=x.dtype),
        )


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)
    sin = sin.squeeze(1).squeeze(0)
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, max_position_embeddings=self.max_position_embeddings)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        # [MODIFIED] Using KVCache mechanism for preallocated GPU memory optimization
        if past_key_value is not None:
            key_states = past_key_value[0].cat(key_states, dim=2)
            value_states = past_key_value[1].cat(value_states, dim=2)
        past_key_value = None

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)

        if attn_weights.size() != (bsz, self.num_heads, q_len, kv_seq_len):
            raise ValueError("Attention weights should be of size "
                             f"{(bsz, self.num_heads, q_len, kv_seq_len)}, but is {attn_weights.size()}")

        if attention_mask is not None:
            if attention_mask.size() != (bsz, 1, q_len, kv_seq_len):
                raise ValueError(f"Attention mask should be of size {(bsz, 1, q_len, kv_seq_len)}, "
                                 f"but is {attention_mask.size()}")
            attn_weights = attn_weights + attention_mask

        # upcast attention to fp32
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)
        attn_output = self.o_proj(attn_output)

        if not output_attentions:
            attn_weights = None
        return attn_output, attn_weights, past_key_value


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(config=config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, self_attn_weights, present_key_value = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=past_key_value,
            output_attentions=output_attentions,
            use_cache=use_cache,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states

        outputs = (hidden_states,)
        if output_attentions:
            outputs += (self_attn_weights,)
        if use_cache:
            outputs += (present_key_value,)
        return outputs


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # Copied from transformers.models.bart.modeling_bart.BartDecoder._prepare_decoder_attention_mask
    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
        # create causal mask
        # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
        combined_attention_mask = None
        if input_shape[-1] > 1:
            combined_attention_mask = _make_causal_mask(
                input_shape,
                torch.float32,  # [MODIFIED] force to cast to float32
                device=inputs_embeds.device,
                past_key_values_length=past_key_values_length,
            )

        if attention_mask is not None:
            # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
            expanded_attn_mask = _expand_mask(
                attention_mask, inputs_embeds.dtype, tgt_len=input_shape[-1]
            ).to(inputs_embeds.device)
            combined_attention_mask = (
                expanded_attn_mask
                if combined_attention_mask is None
                else expanded_attn_mask + combined_attention_mask
            )

        if hasattr(self, "tree_mask") and self.tree_mask is not None:
            tree_mask = self.tree_mask
            tree_len = tree_mask.size(-1)
            bs = combined_attention_mask.size(0)
            combined_attention_mask[:, :, -tree_len:, -tree_len:][
                tree_mask.repeat(bs, 1, 1, 1) == 0
            ] = combined_attention_mask.min()

        return combined_attention_mask

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=False):
        batch_size, seq_length = input_ids.shape
        seq_length_with_past = seq_length
        past_key_values_length = 0

        if past_key_values is not None:
            past_key_values_length = past_key_values[0][0].shape[2]
            seq_length_with_past = seq_length_with_past + past_key_values_length

        if position_ids is None:
            device = input_ids.device
            position_ids = torch.arange(
                past_key_values_length, seq_length + past_key_values_length, dtype=torch.long, device=device
            )
            position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
        else:
            position_ids = position_ids.view(-1, seq_length).long()

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length_with_past), dtype=torch.bool,
                                        device=inputs_embeds.device)
        attention_mask = self._prepare_decoder_attention_mask(
            attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length
        )

        hidden_states = inputs_embeds
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            layer_outputs = decoder_layer(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_value=past_key_value,
                output_attentions=output_attentions,
                use_cache=use_cache,
            )
            hidden_states = layer_outputs[0]
        hidden_states = self.norm(hidden_states)
        return (hidden_states,)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    @property
    def device(self):
        return self.lm_head.weight.device


# ---------------------------------------------------------------- kv_cache.py
class KVCache:
    def __init__(self, data, current_length):
        self.data = data
        self.current_length = current_length

    @property
    def shape(self):
        return (self.data.shape[0], self.data.shape[1], self.current_length.item(), self.data.shape[3])

    def cat(self, tensor, dim=2):
        dst = self.data.narrow(dim, self.current_length, tensor.shape[dim])
        dst.copy_(tensor)
        self.current_length.add_(tensor.shape[dim])
        return torch.narrow(self.data, 2, 0, self.current_length)


def initialize_past_key_values(model, bs=1):
    config = model.config
    batch_size = bs
    device = model.model.layers[0].self_attn.q_proj.weight.device
    past_key_values_data = torch.zeros(
        config.num_hidden_layers * 2,
        batch_size,
        config.num_key_value_heads,
        config.max_position_embeddings,
        config.hidden_size // config.num_attention_heads,
        device=device,
        dtype=model.dtype,
    )
    past_key_values_data_list = [past_key_values_data]
    # [IMPORTANT] It needs to be kept on CPU for quick access and updates.
    current_length_data = torch.zeros(config.num_hidden_layers * 2, dtype=torch.long, device="cpu")
    past_key_values = [] * config.num_hidden_layers
    for i in range(config.num_hidden_layers):
        past_key_values.append(
            [KVCache(past_key_values_data_list[0][2 * i + j], current_length_data[i * 2 + j]) for j in range(2)]
        )
    return past_key_values, past_key_values_data_list, current_length_data


# ---------------------------------------------------------------- utils.py
def pad_path(path, length, pad_value=-2):
    return path + [pad_value] * (length - len(path))


def generate_tree_buffers(tree_choices, device="cpu"):
    sorted_tree_choices = sorted(tree_choices, key=lambda x: (len(x), x))
    tree_len = len(sorted_tree_choices) + 1

    depth_counts = []
    prev_depth = 0
    for path in sorted_tree_choices:
        depth = len(path)
        if depth != prev_depth:
            depth_counts.append(0)
        depth_counts[depth - 1] += 1
        prev_depth = depth

    tree_attn_mask = torch.eye(tree_len, tree_len)
    tree_attn_mask[:, 0] = 1
    start = 0
    for i in range(len(depth_counts)):
        for j in range(depth_counts[i]):
            cur_tree_choice = sorted_tree_choices[start + j]
            if len(cur_tree_choice) == 1:
                continue
            ancestor_idx = []
            for c in range(len(cur_tree_choice) - 1):
                ancestor_idx.append(sorted_tree_choices.index(cur_tree_choice[:c + 1]) + 1)
            tree_attn_mask[j + start + 1, ancestor_idx] = 1
        start += depth_counts[i]

    tree_indices = torch.zeros(tree_len, dtype=torch.long)
    tree_indices[0] = 0
    start = 0
    bias = 0
    for i in range(len(depth_counts)):
        for j in range(depth_counts[i]):
            cur_tree_choice = sorted_tree_choices[start + j]
            cur_parent = cur_tree_choice[:-1]
            if j != 0:
                if cur_parent != parent:
                    bias += 1
                    parent = cur_parent
            else:
                parent = cur_parent
            tree_indices[start + j + 1] = cur_tree_choice[-1] + TOPK * (i + bias) + 1
        start += depth_counts[i]

    tree_position_ids = torch.zeros(tree_len, dtype=torch.long)
    start = 0
    for i in range(len(depth_counts)):
        tree_position_ids[start + 1: start + depth_counts[i] + 1] = i + 1
        start += depth_counts[i]

    retrieve_indices_nest = []
    retrieve_paths = []
    for i in range(len(sorted_tree_choices)):
        cur_tree_choice = sorted_tree_choices[-i - 1]
        retrieve_indice = []
        if cur_tree_choice in retrieve_paths:
            continue
        else:
            for c in range(len(cur_tree_choice)):
                retrieve_indice.append(sorted_tree_choices.index(cur_tree_choice[:c + 1]))
                retrieve_paths.append(cur_tree_choice[:c + 1])
        retrieve_indices_nest.append(retrieve_indice)
    max_length = max([len(x) for x in retrieve_indices_nest])
    retrieve_indices = [pad_path(path, max_length) for path in retrieve_indices_nest]
    retrieve_indices = torch.tensor(retrieve_indices, dtype=torch.long)
    retrieve_indices = retrieve_indices + 1
    retrieve_indices = torch.cat([torch.zeros((retrieve_indices.shape[0], 1), dtype=torch.long), retrieve_indices],
                                 dim=1)

    maxitem = retrieve_indices.max().item() + 5

    def custom_sort(lst):
        sort_keys = []
        for i in range(len(lst)):
            sort_keys.append(lst[i] if lst[i] >= 0 else maxitem)
        return sort_keys

    retrieve_indices = retrieve_indices.tolist()
    retrieve_indices = sorted(retrieve_indices, key=custom_sort)
    retrieve_indices = torch.tensor(retrieve_indices, dtype=torch.long)

    tree_buffers = {
        "tree_attn_mask": tree_attn_mask.unsqueeze(0).unsqueeze(0),
        "tree_indices": tree_indices,
        "tree_position_ids": tree_position_ids,
        "retrieve_indices": retrieve_indices,
    }
    tree_buffers = {k: v.clone().to(device) for k, v in tree_buffers.items()}
    return tree_buffers


def initialize_tree(input_ids, model, tree_attn_mask, past_key_values, logits_processor, attention_mask=None):
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    tree_logits, outputs, logits, hidden_state, sample_token = model(
        input_ids, past_key_values=past_key_values, output_orig=True, logits_processor=logits_processor,
        attention_mask=attention_mask, position_ids=position_ids
    )
    model.base_model.model.tree_mask = tree_attn_mask
    return tree_logits, logits, hidden_state, sample_token


def reset_tree_mode(model):
    model.base_model.model.tree_mask = None
    model.base_model.model.tree_mode = None


def generate_candidates(tree_logits, tree_indices, retrieve_indices, sample_token, logits_processor):
    bs = sample_token.shape[0]
    sample_token = sample_token.to(tree_indices.device)
    candidates_logit = sample_token
    candidates_tree_logits = tree_logits[0]
    candidates = torch.cat([candidates_logit, candidates_tree_logits.view(bs, -1)], dim=-1)
    tree_candidates = candidates[:, tree_indices]
    tree_candidates_ext = torch.cat(
        [tree_candidates, torch.zeros((bs, 1), dtype=torch.long, device=tree_candidates.device) - 1], dim=-1)
    cart_candidates = tree_candidates_ext[:, retrieve_indices]
    cart_candidates_prob = None
    return cart_candidates, cart_candidates_prob, tree_candidates


def tree_decoding(model, tree_candidates, past_key_values, tree_position_ids, input_ids, retrieve_indices,
                  attention_mask=None):
    zero_num = attention_mask.shape[1] - attention_mask.long().sum(-1)
    zero_num = zero_num[:, None]
    position_ids = tree_position_ids[None, :] + input_ids.shape[1] - zero_num

    attention_mask = torch.cat(
        (attention_mask, torch.ones_like(tree_candidates, device=attention_mask.device, dtype=attention_mask.dtype)),
        dim=1)

    outputs, tree_logits, hidden_state = model(
        tree_candidates,
        attention_mask=attention_mask,
        output_orig=True,
        past_key_values=past_key_values,
        position_ids=position_ids,
        init=False,
    )
    logits = tree_logits[:, retrieve_indices]
    return logits, hidden_state, outputs


def evaluate_posterior(logits, candidates, logits_processor, cart_candidates_prob, op, p_indices, tree_candidates,
                       b_indices, finish_flag):
    # Greedy decoding
    bs = tree_candidates.size(0)
    posterior_mask = (candidates[:, :, 1:].to(logits.device) == torch.argmax(logits[:, :, :-1], dim=-1)).int()
    candidates_accept_length = (torch.cumprod(posterior_mask, dim=-1)).sum(dim=-1)
    accept_length = candidates_accept_length.max(dim=1).values
    best_candidate = torch.argmax(candidates_accept_length, dim=-1).to(torch.long)

    bt = tuple(range(bs))
    logits_batch = logits[bt, best_candidate, accept_length, :]
    accept_length = accept_length.tolist()
    for batch in range(bs):
        if finish_flag[batch]:
            accept_length[batch] = 0
    return best_candidate.tolist(), accept_length, logits_batch


@torch.no_grad()
def update_inference_inputs(input_ids, attention_mask, candidates, best_candidate, accept_length, retrieve_indices,
                            logits_processor, logits, tree_logits, new_token, past_key_values_data_list,
                            current_length_data, model, hidden_state, hidden_state_new, sample_p, finish_flag):
    new_outs = []
    finish_flag = copy.deepcopy(finish_flag)
    bs = len(best_candidate)
    prev_input_len = input_ids.shape[1]
    max_acccept_len = max(accept_length)

    retrieve_hidden_state_new = hidden_state_new[:, retrieve_indices[0]]

    ab = tuple(range(bs))
    select_indices = retrieve_indices.cpu()[ab, best_candidate, : max_acccept_len + 1, ...] + prev_input_len
    new_input_ids = candidates[ab, best_candidate, : max_acccept_len + 1, ...]

    draft_hidden = retrieve_hidden_state_new[ab, best_candidate, :max_acccept_len + 1]

    new_attention_mask = torch.zeros((bs, max_acccept_len + 1), dtype=torch.long)

    for batch in range(bs):
        new_attention_mask[batch, :accept_length[batch] + 1] = 1
        new_o = new_input_ids[batch, : accept_length[batch] + 1].tolist()
        new_outs.append(new_o)
        if model.tokenizer.eos_token_id in new_o:
            finish_flag[batch] = True
        new_token[batch] += accept_length[batch] + 1

    attention_mask = torch.cat((attention_mask, new_attention_mask.to(attention_mask.device)), dim=1)

    batch_dim_indices = torch.tensor(ab)[:, None].expand(-1, max_acccept_len + 1)

    for past_key_values_data in past_key_values_data_list:
        tgt = past_key_values_data[:, batch_dim_indices, :, select_indices, :]
        tgt = tgt.permute(2, 0, 3, 1, 4)
        dst = past_key_values_data[:, :, :, prev_input_len: prev_input_len + tgt.shape[-2], :]
        dst.copy_(tgt, non_blocking=True)

    input_ids = torch.cat((input_ids, new_input_ids.to(input_ids.device)), dim=1)

    current_length_data.fill_(prev_input_len + max_acccept_len + 1)

    prob = sample_p
    token = torch.argmax(prob, dim=-1)
    token = token[:, None]

    draft_input_ids = torch.cat((new_input_ids, torch.ones(bs, 1, dtype=torch.long, device=new_input_ids.device)),
                                dim=1)
    token_ = token[:, 0]
    draft_input_ids[ab, torch.tensor(accept_length, dtype=torch.long) + 1] = token_

    tree_logits = model.ea_layer.topK_genrate(draft_hidden, input_ids=draft_input_ids,
                                              head=model.base_model.lm_head, logits_processor=logits_processor,
                                              attention_mask=attention_mask, len_posi=input_ids.shape[1])

    return input_ids, tree_logits, new_token, None, token, attention_mask, finish_flag, new_outs


# ---------------------------------------------------------------- draft (stands in for cnets.Model)
class DraftLM(nn.Module):
    """A small draft LM over the same vocabulary. It keeps each row's real tokens (the prompt's, then the ones
    accepted plus the new sample token) and, for every tree node that has children, returns its TOPK next tokens,
    grouped as generate_tree_buffers' tree_indices read them."""

    def __init__(self, lm, tree_choices):
        super().__init__()
        self.lm = lm
        sorted_tree_choices = sorted(tree_choices, key=lambda x: (len(x), x))
        # group number of each parent, in the order generate_tree_buffers counts them (i + bias)
        self.group_of_parent = {}
        depth_counts = {}
        for c in sorted_tree_choices:
            depth_counts[len(c)] = depth_counts.get(len(c), 0) + 1
        start, bias = 0, 0
        for i, d in enumerate(sorted(depth_counts)):
            for j in range(depth_counts[d]):
                cur_parent = tuple(sorted_tree_choices[start + j][:-1])
                if j != 0 and cur_parent != parent:
                    bias += 1
                parent = cur_parent
                self.group_of_parent.setdefault(cur_parent, i + bias)
            start += depth_counts[d]
        self.n_groups = max(self.group_of_parent.values()) + 1
        self.rows = None

    def reset_kv(self):
        self.rows = None

    @torch.no_grad()
    def topK_genrate(self, hidden_states, input_ids, head, logits_processor, attention_mask=None, len_posi=None):
        bs = input_ids.shape[0]
        if self.rows is None:
            # first call: input_ids is the padded prompt plus the sample token, attention_mask the prompt's
            self.rows = [input_ids[b, :-1][attention_mask[b].bool()].tolist() + [input_ids[b, -1].item()]
                         for b in range(bs)]
        else:
            # later calls: the accepted tokens then the sample token; the mask's new columns count the accepted
            n_new = attention_mask[:, -(input_ids.shape[1] - 1):].long().sum(-1)
            for b in range(bs):
                self.rows[b] += input_ids[b, : n_new[b] + 1].tolist()
        out = torch.zeros(bs, self.n_groups, TOPK, dtype=torch.long)
        for b in range(bs):
            for parent, g in sorted(self.group_of_parent.items(), key=lambda kv: kv[1]):
                path = [out[b, self.group_of_parent[parent[:k]], parent[k]].item() for k in range(len(parent))]
                ids = torch.tensor([self.rows[b] + path])
                h = self.lm.model(ids)[0]
                out[b, g] = self.lm.lm_head(h[0, -1]).topk(TOPK).indices
        return (out, None, None)


# ---------------------------------------------------------------- ea_model.py
class EaModel(nn.Module):
    def __init__(self, base_model, ea_layer, tokenizer):
        super().__init__()
        self.base_model = base_model
        self.config = base_model.config
        self.tokenizer = tokenizer
        self.ea_layer = ea_layer

    def forward(self, input_ids=None, attention_mask=None, labels=None, past_key_values=None, output_orig=False,
                position_ids=None, init=True, logits_processor=None):
        with torch.inference_mode():
            outputs = self.base_model.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                position_ids=position_ids,
            )
            if output_orig:
                orig = self.base_model.lm_head(outputs[0])
            hidden_states = outputs[0].clone()
        if init:
            token = torch.argmax(orig[:, -1], dim=-1)
            token = token[:, None]
            input_ids = torch.cat((input_ids, token.to(input_ids.device)), dim=1)
            ea_logits = self.ea_layer.topK_genrate(hidden_states, input_ids, self.base_model.lm_head,
                                                   logits_processor, attention_mask=attention_mask)
            if output_orig:
                return ea_logits, outputs, orig, hidden_states, token
            return ea_logits, hidden_states, token
        else:
            if output_orig:
                return outputs, orig, hidden_states

    @torch.no_grad()
    def eagenerate(self, input_ids, attention_mask=None, max_new_tokens=512, max_length=2048, tree_choices=None,
                   on_verify=None):
        bs = input_ids.shape[0]
        logits_processor = None
        input_ids = input_ids.clone()
        self.ea_layer.reset_kv()

        tree_buffers = generate_tree_buffers(tree_choices, device=self.base_model.device)
        tree_buffers["retrieve_indices_head"] = tree_buffers["retrieve_indices"].to(self.base_model.device)
        self.tree_buffers = tree_buffers
        self.tree_choices = tree_choices
        tree_buffers["retrieve_indices_batch"] = tree_buffers["retrieve_indices"].expand(bs, -1, -1)

        out_inputids = [ids.tolist() for ids in input_ids]
        out_idx = [0] * bs
        out_newtokens = [0] * bs

        past_key_values, past_key_values_data, current_length_data = initialize_past_key_values(self.base_model,
                                                                                                bs=bs)
        self.past_key_values = past_key_values
        self.past_key_values_data = past_key_values_data
        self.current_length_data = current_length_data

        reset_tree_mode(self)
        tree_logits, logits, hidden_state, sample_token = initialize_tree(
            input_ids, self, tree_buffers["tree_attn_mask"], past_key_values, logits_processor,
            attention_mask=attention_mask
        )
        new_token = [0] * bs
        finish_flag = [False] * bs
        accepts = []

        for idx in range(max_length):
            candidates, cart_candidates_prob, tree_candidates = generate_candidates(
                tree_logits, tree_buffers["tree_indices"], tree_buffers["retrieve_indices"], sample_token,
                logits_processor
            )
            logits, hidden_state_new, outputs = tree_decoding(
                self, tree_candidates, past_key_values, tree_buffers["tree_position_ids"], input_ids,
                tree_buffers["retrieve_indices_head"], attention_mask=attention_mask
            )
            if on_verify is not None:
                on_verify(input_ids, attention_mask, tree_candidates, self.base_model.lm_head(hidden_state_new))
            best_candidate, accept_length, sample_p = evaluate_posterior(
                logits, candidates, logits_processor, cart_candidates_prob, None, None, tree_candidates, None,
                finish_flag
            )
            accepts.append(list(accept_length))
            input_ids, tree_logits, new_token, hidden_state, sample_token, attention_mask, newfinish_flag, new_outs = \
                update_inference_inputs(
                    input_ids, attention_mask, candidates, best_candidate, accept_length,
                    tree_buffers["retrieve_indices_batch"], logits_processor, logits, tree_logits, new_token,
                    past_key_values_data, current_length_data, self, hidden_state, hidden_state_new, sample_p,
                    finish_flag
                )
            min_uf_newtokens = max_length + 10
            for batch in range(bs):
                if not finish_flag[batch]:
                    out_idx[batch] += 1
                    out_newtokens[batch] = new_token[batch]
                    out_inputids[batch].extend(new_outs[batch])
                    min_uf_newtokens = min(min_uf_newtokens, new_token[batch])
            finish_flag = newfinish_flag
            if min(finish_flag):
                break
            if min_uf_newtokens > max_new_tokens:
                break
            if input_ids.shape[1] + 10 + len(tree_choices) > max_length:
                break
        return out_inputids, accepts


# ---------------------------------------------------------------- reference, written by hand
@torch.no_grad()
def ref_logits(m, ids):
    """One unpadded row, no cache: every position's logits, explicit causal softmax, rotary at 0..n-1."""
    cfg = m.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // H
    n = len(ids)
    x = m.model.embed_tokens.weight[torch.tensor(ids)]
    pos = torch.arange(n, dtype=torch.float32)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = pos[:, None] * inv[None, :]
    c, s = torch.cos(ang), torch.sin(ang)

    def rope(t):  # t: (heads, n, D), halves rotated
        a, b = t[..., : D // 2], t[..., D // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    def rms(t, w, eps):
        return w * (t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps))

    for layer in m.model.layers:
        at = layer.self_attn
        h = rms(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
        q = rope((h @ at.q_proj.weight.T).view(n, H, D).transpose(0, 1))
        k = rope((h @ at.k_proj.weight.T).view(n, KV, D).transpose(0, 1))
        v = (h @ at.v_proj.weight.T).view(n, KV, D).transpose(0, 1)
        k = k.repeat_interleave(H // KV, dim=0)  # query head hh reads KV head hh // (H // KV)
        v = v.repeat_interleave(H // KV, dim=0)
        out = torch.zeros(H, n, D)
        for i in range(n):  # query i reads keys 0..i only
            sc = torch.einsum("hd,hjd->hj", q[:, i], k[:, : i + 1]) / math.sqrt(D)
            w = torch.exp(sc - sc.max(-1, keepdim=True).values)
            out[:, i] = torch.einsum("hj,hjd->hd", w / w.sum(-1, keepdim=True), v[:, : i + 1])
        x = x + out.transpose(0, 1).reshape(n, H * D) @ at.o_proj.weight.T
        h = rms(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        mlp = layer.mlp
        x = x + (F.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    x = rms(x, m.model.norm.weight, cfg.rms_norm_eps)
    return x @ m.lm_head.weight.T


def main():
    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-6, hidden_act="silu", pad_token_id=0)
    base = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in base.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.25)
    draft_lm = copy.deepcopy(base)
    with torch.no_grad():
        for p in draft_lm.parameters():
            if p.dim() > 1:
                p.add_(torch.randn_like(p) * 0.02)

    tree_choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]
    tokenizer = types.SimpleNamespace(eos_token_id=config.vocab_size)  # an id the model never emits
    model = EaModel(base, DraftLM(draft_lm, tree_choices), tokenizer).eval()

    prompts = [[5, 17, 3, 29, 11], [7, 2, 41, 19, 33, 8, 25, 14, 6], [30, 12, 9, 44, 21, 38, 4]]
    L = max(len(p) for p in prompts)
    input_ids = torch.tensor([[config.pad_token_id] * (L - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])

    tree_attn_mask = generate_tree_buffers(tree_choices)["tree_attn_mask"][0, 0]
    worst = [0.0]
    n_nodes = [0]

    def on_verify(ids, mask, tree_candidates, node_logits):
        for b in range(ids.shape[0]):
            text = ids[b][mask[b].bool()].tolist()
            for node in range(tree_candidates.shape[1]):
                path = tree_candidates[b, tree_attn_mask[node].nonzero().flatten()].tolist()
                want = ref_logits(base, text + path)[-1]
                worst[0] = max(worst[0], (node_logits[b, node] - want).abs().max().item())
                n_nodes[0] += 1

    max_new_tokens = 16
    out, accepts = model.eagenerate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                    max_length=96, tree_choices=tree_choices, on_verify=on_verify)

    assert worst[0] < 1e-4, worst[0]
    flat = [a for step in accepts for a in step]
    for b, p in enumerate(prompts):
        gen = out[b][L:]
        ids = list(p)
        ref = []
        with torch.no_grad():
            for _ in range(len(gen)):
                lg = ref_logits(base, ids)[-1]
                top2 = lg.topk(2).values
                assert top2[0] - top2[1] > 1e-4, "near tie in the reference"
                t = int(lg.argmax())
                ref.append(t)
                ids.append(t)
        assert gen == ref, (b, gen, ref)
        assert len(gen) > max_new_tokens
    assert max(flat) >= 2 and min(flat) == 0, accepts
    assert any(len(set(step)) > 1 for step in accepts), accepts  # rows advanced by different amounts
    print(f"{n_nodes[0]} tree nodes over {len(accepts)} verify steps match the plain reference "
          f"(max |diff| {worst[0]:.2e}); accept lengths per step {accepts}; "
          f"emitted tokens per row {[len(o) - L for o in out]} equal plain greedy decoding")


if __name__ == "__main__":
    main()
