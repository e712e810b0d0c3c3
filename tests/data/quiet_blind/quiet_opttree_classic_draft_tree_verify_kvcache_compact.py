"""OPT-Tree (classic draft model): an adaptive draft tree grown by a small LLaMA, verified by the target in one pass.

Correct program (quiet batch quiet-r133a). Ported small from Jikai0Wang/OPT-Tree @4f87f54e8543f9038d10aac32f286d7f14b7407b:
opt_classic/tree.py (Tree: initialize, add, generate_attention_mask, update), opt_classic/model.py (SPModel.forward,
process_tree_mask, draft, spgenerate), opt_classic/utils.py (tree_decoding, verify), opt_classic/kv_cache.py (KVCache,
initialize_past_key_values) and opt_classic/modeling_llama_kv.py (LlamaModel._prepare_decoder_attention_mask,
_make_causal_mask, _expand_mask, the tree_attention_mask branch of LlamaModel.forward, LlamaAttention with KVCache.cat
for the target and torch.cat for the draft).

The draft model grows the tree one depth at a time over its prompt cache: each depth's nodes see the whole prompt
cache, their ancestors' cached keys and themselves (process_tree_mask). The target then verifies the final tree
(root token + nodes, positions by depth) over its preallocated KVCache: the prefix columns are all open and the tree
block holds each node's ancestors; the accepted path's keys are copied down to the prefix end and current_length
is reset. One change from tree.py: Tree.add writes `kv_cache_mask[rows, parents] = 1` a second time after the
concatenation; that second write is the reset of the per-depth block and is written here as `= 0`, so each depth's
block holds only its own parents.

Checks: the generated tokens equal plain greedy decoding by transformers' LlamaForCausalLM (same weights, no cache,
full recompute each step), and one verify pass's logits at every tree node equal that reference run on
prompt + the node's root-to-node path.
"""
import math
from typing import Optional

import torch
import torch.nn as nn
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM
from transformers.activations import ACT2FN


# ----------------------------------------------------------------------------- opt_classic/kv_cache.py
class KVCache:
    def __init__(self, data, current_length):
        self.data = data
        self.current_length = current_length

    @property
    def shape(self):
        return (self.data.shape[0], self.data.shape[1], self.current_length.item(), self.data.shape[3])

    def cat(self, tensor: torch.Tensor, dim: int = 2):
        dst = self.data.narrow(dim, self.current_length, tensor.shape[dim])
        dst.copy_(tensor)
        self.current_length.add_(tensor.shape[dim])
        return torch.narrow(self.data, 2, 0, self.current_length)


def initialize_past_key_values(model):
    config = model.config
    batch_size = 1
    past_key_values_data = torch.zeros(
        config.num_hidden_layers * 2,
        batch_size,
        config.num_key_value_heads,
        config.max_position_embeddings,
        config.hidden_size // config.num_attention_heads,
        dtype=model.lm_head.weight.dtype,
    )
    current_length_data = torch.zeros(config.num_hidden_layers * 2, dtype=torch.long, device="cpu")
    past_key_values = []
    for i in range(config.num_hidden_layers):
        past_key_values.append(
            [KVCache(past_key_values_data[i * 2 + j], current_length_data[i * 2 + j]) for j in range(2)]
        )
    return past_key_values, [past_key_values_data], current_length_data


# ----------------------------------------------------------------------------- opt_classic/modeling_llama_kv.py
def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
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
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        t = torch.arange(max_position_embeddings, dtype=inv_freq.dtype)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :], persistent=False)

    def forward(self, x, seq_len=None):
        return self.cos_cached[:, :, :seq_len].to(x.dtype), self.sin_cached[:, :, :seq_len].to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)
    sin = sin.squeeze(1).squeeze(0)
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, max_position_embeddings=config.max_position_embeddings,
                                               base=config.rope_parameters["rope_theta"])

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                return_kv=False, is_draft=False):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        if past_key_value is not None:
            if is_draft:
                key_states = torch.cat([past_key_value[0], key_states], dim=2)
                value_states = torch.cat([past_key_value[1], value_states], dim=2)
            else:
                key_states = past_key_value[0].cat(key_states, dim=2)
                value_states = past_key_value[1].cat(value_states, dim=2)

        past_key_value = (key_states, value_states) if return_kv else None

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            if attention_mask.size() != (bsz, 1, q_len, kv_seq_len):
                raise ValueError(
                    f"Attention mask should be of size {(bsz, 1, q_len, kv_seq_len)}, but is {attention_mask.size()}"
                )
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), past_key_value


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                return_kv=False, is_draft=False):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, present_key_value = self.self_attn(
            hidden_states, attention_mask=attention_mask, position_ids=position_ids,
            past_key_value=past_key_value, return_kv=return_kv, is_draft=is_draft,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present_key_value


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
        combined_attention_mask = None
        if input_shape[-1] > 1:
            combined_attention_mask = _make_causal_mask(
                input_shape, torch.float32, device=inputs_embeds.device,
                past_key_values_length=past_key_values_length,
            )
        if attention_mask is not None:
            expanded_attn_mask = _expand_mask(attention_mask, inputs_embeds.dtype, tgt_len=input_shape[-1]).to(
                inputs_embeds.device)
            combined_attention_mask = (
                expanded_attn_mask if combined_attention_mask is None else expanded_attn_mask + combined_attention_mask
            )
        return combined_attention_mask

    def forward(self, input_ids, attention_mask=None, tree_attention_mask=None, position_ids=None,
                past_key_values=None, return_kv=False, is_draft=False):
        batch_size, seq_length = input_ids.shape
        seq_length_with_past = seq_length
        past_key_values_length = 0
        if past_key_values is not None:
            past_key_values_length = past_key_values[0][0].shape[2]
            seq_length_with_past = seq_length_with_past + past_key_values_length

        if position_ids is None:
            position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length,
                                        dtype=torch.long, device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
        else:
            position_ids = position_ids.view(-1, seq_length).long()

        inputs_embeds = self.embed_tokens(input_ids)
        if tree_attention_mask is None:
            if attention_mask is None:
                attention_mask = torch.ones((batch_size, seq_length_with_past), dtype=torch.bool,
                                            device=inputs_embeds.device)
            attention_mask = self._prepare_decoder_attention_mask(
                attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length)
        else:
            if is_draft:
                attention_mask = tree_attention_mask
            else:
                input_len = tree_attention_mask.size(0)
                attention_mask = torch.zeros((input_len, past_key_values_length + input_len)).float().to(
                    inputs_embeds.device)
                tree_mask = torch.where(tree_attention_mask == 0, torch.finfo(torch.float32).min, tree_attention_mask)
                tree_mask = torch.where(tree_mask == 1, torch.tensor(0, dtype=torch.float32), tree_mask)
                attention_mask[-input_len:, -input_len:] = tree_mask
                attention_mask = attention_mask[None, None, :, :]

        hidden_states = inputs_embeds
        next_cache = ()
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = decoder_layer(
                hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                past_key_value=past_key_value, return_kv=return_kv, is_draft=is_draft,
            )
            next_cache += (present,)
        hidden_states = self.norm(hidden_states)
        if return_kv:
            return hidden_states, next_cache
        return (hidden_states,)


class KVLlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


# ----------------------------------------------------------------------------- opt_classic/tree.py
class Tree:
    def __init__(self, nnodes, device, threshold, max_depth):
        self.nnodes = nnodes
        self.device = device
        self.threshold = threshold
        self.depth = 0
        self.weight = 0
        self.max_depth = max_depth
        self.weight_matrix = torch.zeros([max_depth, self.nnodes], device=self.device)
        self.input_ids_matrix = torch.zeros([max_depth, self.nnodes], dtype=torch.long, device=self.device)
        self.parents_matrix = torch.zeros([max_depth, self.nnodes], dtype=torch.long, device=self.device)
        self.kv_mask = torch.zeros([self.nnodes, 0], dtype=torch.int8, device=self.device)
        self.tri = torch.eye(self.nnodes, dtype=torch.int8, device=self.device)
        self.rows = torch.arange(self.nnodes, device=self.device)
        self.position_id = torch.zeros([self.nnodes], dtype=torch.long, device=self.device)
        self.kv_cache_mask = torch.zeros([self.nnodes, self.nnodes], dtype=torch.int8, device=self.device)

    def initialize(self, logits):
        logits, ids = torch.topk(logits[0][-1], k=self.nnodes, dim=-1)
        self.weight_matrix[self.depth].copy_(logits)
        self.input_ids_matrix[self.depth].copy_(ids)
        self.parents_matrix[0].copy_(self.rows)
        output_dict = {"input_ids": ids,
                       "position_ids": self.position_id + 1,
                       "attention_mask": self.tri,
                       "parent_last": self.rows,
                       "is_final": False}
        self.depth += 1
        return output_dict

    def add(self, logits):
        logits, ids = torch.topk(logits[0], k=self.nnodes, dim=-1)
        last_layer_weights = self.weight_matrix[self.depth - 1].unsqueeze(1)
        logits = logits * last_layer_weights
        flat_logits, flat_ids = logits.view(-1), ids.view(-1)
        global_top_logits, global_top_idx = torch.topk(flat_logits, k=self.nnodes, dim=-1)
        input_ids = flat_ids[global_top_idx]
        parents = global_top_idx // self.nnodes
        self.parents_matrix[self.depth].copy_(parents)
        self.weight_matrix[self.depth].copy_(global_top_logits)
        self.input_ids_matrix[self.depth].copy_(input_ids)
        self.kv_cache_mask[self.rows, parents] = 1
        self.kv_mask = torch.cat([self.kv_mask[parents], self.kv_cache_mask], dim=1)
        self.kv_cache_mask[self.rows, parents] = 0
        attention_mask = torch.cat([self.kv_mask, self.tri], dim=1)
        output_dict = {"input_ids": input_ids,
                       "position_ids": self.position_id + (self.depth + 1),
                       "attention_mask": attention_mask,
                       "parent_last": parents,
                       "is_final": False}
        self.depth += 1
        return output_dict

    def generate_attention_mask(self, parents):
        attention_mask = self.tri
        grandp = parents.clone()
        for _ in range(self.depth - 2):
            attention_mask[self.rows, grandp] = 1
            grandp = grandp[parents]
        return attention_mask

    def update(self, logits):
        if self.depth == 0:
            return self.initialize(logits)
        outputs = self.add(logits)
        top_weights, top_index = torch.topk(self.weight_matrix[:self.depth - 1].view(-1), k=self.nnodes, dim=-1)
        weight = top_weights.sum()
        if weight - self.weight > self.threshold and self.depth < self.max_depth:
            self.weight = weight
        else:
            rows = top_index // self.nnodes
            cols = top_index % self.nnodes
            sorted_indices = torch.argsort(rows)
            rows = rows[sorted_indices]
            cols = cols[sorted_indices]
            index = torch.arange(self.nnodes * (self.depth - 1), device=self.device).view(-1, self.nnodes)
            input_ids = self.input_ids_matrix[rows, cols]
            position_ids = rows + 1
            parents = self.parents_matrix[rows, cols]
            source_idx = index[rows, cols]
            parent_idx = index[torch.clamp_min(rows - 1, 0), parents]
            parents_index = torch.nonzero(source_idx.unsqueeze(0) == parent_idx.unsqueeze(1))[:, 1]
            attention_mask = self.generate_attention_mask(parents_index)
            outputs = {"input_ids": input_ids,
                       "position_ids": position_ids,
                       "attention_mask": attention_mask,
                       "parent_last": parents_index,
                       "is_final": True}
        return outputs


# ----------------------------------------------------------------------------- opt_classic/utils.py
def tree_decoding(model, draft_input_ids, past_key_values, draft_position_ids, tree_attention_mask):
    outputs, tree_logits, hidden_state = model(
        draft_input_ids,
        tree_attention_mask=tree_attention_mask,
        output_orig=True,
        past_key_values=past_key_values,
        position_ids=draft_position_ids,
        init=False,
    )
    return tree_logits, hidden_state, outputs


def verify(input_ids, logits, draft, position_ids, tree_attention_mask, past_key_values_data, current_length_data,
           parent, model, nodes, threshold, max_depth):
    next = torch.argmax(logits, dim=-1)

    parent = torch.where(parent == torch.arange(parent.size(0), device=parent.device), -1, parent)
    parent = torch.cat([torch.tensor([0], device=parent.device), parent + 1], dim=-1)

    correct = torch.where(draft[0] != next[0][parent], 0, torch.ones(draft.size(1), device=draft.device))
    correct[0] = 1
    last_sum = torch.sum(correct)
    while True:
        correct = torch.where(correct[parent] == 0, 0, correct)
        if torch.sum(correct) == last_sum:
            break
        last_sum = torch.sum(correct)

    id = torch.argmax(correct * position_ids)
    best_candidate = []
    best_candidate_id = []
    max_id = id
    parent[0] = -1
    while id != -1:
        best_candidate.append(draft[0][id].item())
        best_candidate_id.append(id)
        id = parent[id].item()
    best_candidate.reverse()
    best_candidate_id.reverse()
    next_token = next[0][max_id].unsqueeze(0).unsqueeze(0)
    accept_length = len(best_candidate) - 1

    start = current_length_data[0].item() - draft.size(1)
    select_indices = torch.tensor(best_candidate_id) + start
    for data in past_key_values_data:
        tgt = data[..., select_indices.to(data.device), :]
        dst = data[..., start: start + tgt.shape[-2], :]
        dst.copy_(tgt, non_blocking=True)
    current_length_data.fill_(start + tgt.shape[-2])

    input_ids = torch.cat([input_ids, torch.tensor(best_candidate, device=input_ids.device).unsqueeze(0)], dim=-1)
    next_draft, next_position_ids, next_tree_attention_mask, parent = model.draft(
        torch.cat((input_ids, next_token.to(input_ids.device)), dim=1), nodes, threshold, max_depth)

    next_draft = torch.cat([next_token, next_draft], dim=-1)
    next_position_ids = torch.cat([torch.tensor([next_position_ids[0] - 1]), next_position_ids], dim=-1)
    next_tree_attention_mask = torch.cat(
        [torch.zeros(1, next_tree_attention_mask.size(1), dtype=next_tree_attention_mask.dtype),
         next_tree_attention_mask], dim=0)
    next_tree_attention_mask = torch.cat(
        [torch.ones(next_tree_attention_mask.size(0), 1, dtype=next_tree_attention_mask.dtype),
         next_tree_attention_mask], dim=1)
    return input_ids, best_candidate, accept_length, next_draft, next_position_ids, next_tree_attention_mask, parent


# ----------------------------------------------------------------------------- opt_classic/model.py
class SPModel(nn.Module):
    def __init__(self, base_model, draft_model, eos_token_id):
        super().__init__()
        self.base_model = base_model
        self.config = base_model.config
        self.draft_model = draft_model
        self.eos_token_id = eos_token_id
        self.draft_stable_kv = None

    def forward(self, input_ids=None, attention_mask=None, tree_attention_mask=None, past_key_values=None,
                output_orig=False, position_ids=None, init=True, nodes=None, threshold=None, max_depth=None):
        with torch.inference_mode():
            outputs = self.base_model.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                tree_attention_mask=tree_attention_mask,
                past_key_values=past_key_values,
                position_ids=position_ids,
            )
            if output_orig:
                orig = self.base_model.lm_head(outputs[0])
            hidden_states = outputs[0].clone()
        if init:
            token = torch.argmax(orig[:, -1])
            token = token[None, None]
            input_ids = torch.cat((input_ids, token.to(input_ids.device)), dim=1)
            input_ids, position_ids, tree_attention_mask, parent = self.draft(input_ids, nodes, threshold, max_depth)
            return input_ids, position_ids, tree_attention_mask, token, parent
        return outputs, orig, hidden_states

    def process_tree_mask(self, tree_attention_mask, init_len):
        attention_mask = torch.full((tree_attention_mask.size(0), init_len), 0, device=tree_attention_mask.device)
        tree_mask = torch.where(tree_attention_mask == 0, torch.finfo(torch.float32).min, 0)
        attention_mask = torch.cat([attention_mask, tree_mask], dim=-1)
        attention_mask = attention_mask[None, None, :, :]
        return attention_mask

    @torch.no_grad()
    def draft(self, input_ids, nodes, threshold, max_depth):
        len_posi = input_ids.shape[1] - 1
        if self.draft_stable_kv is not None:
            kv_len = self.draft_stable_kv[0][0].shape[2]
            draft_outputs = self.draft_model.model(
                input_ids=input_ids[:, kv_len:], past_key_values=self.draft_stable_kv, return_kv=True, is_draft=True)
        else:
            draft_outputs = self.draft_model.model(input_ids=input_ids, return_kv=True, is_draft=True)

        self.draft_stable_kv = draft_outputs[1]
        past_key_values = self.draft_stable_kv
        init_len = past_key_values[0][0].size(2)

        last_hidden = draft_outputs[0][:, -1]
        last_headout = self.draft_model.lm_head(last_hidden)
        tree = Tree(nodes, last_hidden.device, threshold, max_depth)
        logits = last_headout.unsqueeze(0)
        while True:
            tree_output = tree.update(torch.softmax(logits, dim=-1, dtype=torch.float32))
            input_ids = tree_output["input_ids"].unsqueeze(0)
            position_ids = tree_output["position_ids"] + len_posi
            if tree_output["is_final"]:
                break
            tree_attention_mask_with_kv = self.process_tree_mask(tree_output["attention_mask"], init_len)
            draft_outputs = self.draft_model.model(
                input_ids=input_ids,
                position_ids=position_ids,
                past_key_values=past_key_values,
                tree_attention_mask=tree_attention_mask_with_kv,
                return_kv=True,
                is_draft=True,
            )
            past_key_values = draft_outputs[1]
            logits = self.draft_model.lm_head(draft_outputs[0])
        return input_ids, position_ids, tree_output["attention_mask"], tree_output["parent_last"]

    @torch.no_grad()
    def spgenerate(self, input_ids, max_new_tokens=24, max_length=100, nodes=8, threshold=0.05, max_depth=5,
                   on_verify=None):
        assert input_ids.shape[0] == 1, "Only support batch size 1 for now!!"
        input_ids = input_ids.clone()
        self.draft_stable_kv = None
        past_key_values, past_key_values_data, current_length_data = initialize_past_key_values(self.base_model)

        input_len = input_ids.shape[1]
        draft_input_ids, draft_position_ids, tree_attention_mask, last_token, parent = self(
            input_ids=input_ids, past_key_values=past_key_values, output_orig=True,
            nodes=nodes, threshold=threshold, max_depth=max_depth)

        draft_input_ids = torch.cat([last_token, draft_input_ids], dim=-1)
        draft_position_ids = torch.cat([torch.tensor([draft_position_ids[0] - 1]), draft_position_ids], dim=-1)
        tree_attention_mask = torch.cat(
            [torch.zeros(1, tree_attention_mask.size(1), dtype=tree_attention_mask.dtype), tree_attention_mask], dim=0)
        tree_attention_mask = torch.cat(
            [torch.ones(tree_attention_mask.size(0), 1, dtype=tree_attention_mask.dtype), tree_attention_mask], dim=1)

        new_token = 0
        accepted = []
        for idx in range(max_length):
            assert past_key_values[0][0].shape[2] == draft_position_ids[0]
            prefix = input_ids.clone()
            logits, hidden_state_new, outputs = tree_decoding(
                self, draft_input_ids, past_key_values, draft_position_ids, tree_attention_mask)
            if on_verify is not None:
                on_verify(prefix, draft_input_ids, tree_attention_mask, logits)
            input_ids, best_candidate, accept_length, draft_input_ids, draft_position_ids, tree_attention_mask, parent = verify(
                input_ids, logits, draft_input_ids, draft_position_ids, tree_attention_mask,
                past_key_values_data, current_length_data, parent, self, nodes, threshold, max_depth)
            new_token += accept_length + 1
            accepted.append(accept_length)
            if self.eos_token_id in input_ids[0, input_len:].tolist():
                break
            if new_token > max_new_tokens:
                break
        return input_ids, accepted


# ----------------------------------------------------------------------------- reference and checks
def build_models():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=47,
                         rms_norm_eps=1e-6, attn_implementation="eager")
    reference = HFLlamaForCausalLM(config).eval()
    base_model = KVLlamaForCausalLM(config).eval()
    missing, unexpected = base_model.load_state_dict(reference.state_dict(), strict=False)
    assert not missing and all("rotary" in k for k in unexpected), (missing, unexpected)

    # draft: the target's first two layers (a layer-skip style small model), same embeddings and head
    draft_config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 2})
    draft_model = KVLlamaForCausalLM(draft_config).eval()
    draft_state = {k: v for k, v in reference.state_dict().items() if not k.startswith("model.layers.2.")}
    missing, _ = draft_model.load_state_dict(draft_state, strict=False)
    assert not missing, missing
    return config, reference, base_model, draft_model


@torch.no_grad()
def greedy_reference(reference, input_ids, n_tokens):
    ids = input_ids.clone()
    for _ in range(n_tokens):
        logits = reference(input_ids=ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=-1)
    return ids


def main():
    config, reference, base_model, draft_model = build_models()
    model = SPModel(base_model, draft_model, eos_token_id=config.eos_token_id)
    prompt = torch.tensor([[1, 17, 5, 33, 9, 28, 14, 40, 6, 22, 3]])

    checked = []

    @torch.no_grad()
    def check_verify(prefix, draft_input_ids, tree_attention_mask, logits):
        # every tree node against the reference run on prefix + its root-to-node path
        mask = tree_attention_mask.bool()
        for node in range(draft_input_ids.size(1)):
            path = torch.nonzero(mask[node]).flatten()
            ids = torch.cat([prefix, draft_input_ids[:, path]], dim=-1)
            ref = reference(input_ids=ids, use_cache=False).logits[0, -1]
            torch.testing.assert_close(logits[0, node], ref, atol=1e-4, rtol=1e-4)
        checked.append(draft_input_ids.size(1))

    output_ids, accepted = model.spgenerate(prompt, max_new_tokens=12, nodes=8, threshold=0.05, max_depth=5,
                                            on_verify=check_verify)
    n_new = output_ids.shape[1] - prompt.shape[1]
    expected = greedy_reference(reference, prompt, n_new)
    assert torch.equal(output_ids, expected), (output_ids, expected)
    print(f"verify passes: {len(accepted)}, accepted per pass: {accepted}, tree sizes: {checked}")
    print(f"new tokens: {n_new}, equal to greedy decoding by the target: True")


if __name__ == "__main__":
    main()
