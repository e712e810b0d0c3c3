"""EAGLE batched (bs > 1) tree decoding: the left-padded prompt is prefilled at arange positions.

Citation: SafeAILab/EAGLE commit 3086270 ("fix a bug", branch bsne1, the batched EAGLE), model/utils.py
``initialize_tree``; the model is model/modeling_llama_kv.py of the same commit.

The batched EAGLE left-pads the prompts and hands ``attention_mask`` to the base model. ``tree_decoding``
numbers the draft tree from the real length of each row,
``position_ids = tree_position_ids[None, :] + input_ids.shape[1] - zero_num`` (zero_num = the row's pads),
but ``initialize_tree`` ran the prompt prefill with no ``position_ids``, so ``LlamaModel.forward`` gave every
row ``torch.arange(past_key_values_length, seq_length + past_key_values_length)``: a padded row's prompt keys
went into the KV cache ``zero_num`` places further on than the tree that then reads them.

The fix: ``initialize_tree`` builds ``position_ids = attention_mask.long().cumsum(-1) - 1`` (pads set to 1)
and passes them to the prefill.

Kept at toy sizes with random weights: the KV-cache Llama of modeling_llama_kv.py (KVCache.cat into a
preallocated buffer, ``_prepare_decoder_attention_mask`` with ``_make_causal_mask`` + ``_expand_mask`` and the
``tree_mask`` written into its lower-right corner, rotary ``cos[position_ids]``), ``generate_tree_buffers``,
``initialize_tree``, ``generate_candidates``, ``tree_decoding`` and a greedy ``evaluate_posterior``. The EAGLE
draft head is replaced by a seeded stand-in that proposes the top-k tokens (it only fills the tree).
"""

import math
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

FIXED = "--fixed" in sys.argv
TOPK = 3


# ---------------------------------------------------------------- model/kv_cache.py
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


def initialize_past_key_values(model, bs):
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    past_key_values_data = torch.zeros(
        config.num_hidden_layers * 2, bs, config.num_key_value_heads, config.max_position_embeddings, head_dim)
    current_length_data = torch.zeros(config.num_hidden_layers * 2, dtype=torch.long)
    past_key_values = [] * config.num_hidden_layers
    for i in range(config.num_hidden_layers):
        past_key_values.append([KVCache(past_key_values_data[i * 2 + j], current_length_data[i * 2 + j])
                                for j in range(2)])
    return past_key_values, past_key_values_data, current_length_data


# ---------------------------------------------------------------- model/modeling_llama_kv.py
def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length: int = 0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask: torch.Tensor, dtype: torch.dtype, tgt_len: Optional[int] = None):
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
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float() / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(max_position_embeddings, self.inv_freq.device, torch.get_default_dtype())

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
        return (self.cos_cached[:, :, :seq_len, ...].to(dtype=x.dtype),
                self.sin_cached[:, :, :seq_len, ...].to(dtype=x.dtype))


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

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, max_position_embeddings=config.max_position_embeddings)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

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
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, attention_mask=attention_mask,
                                       position_ids=position_ids, past_key_value=past_key_value)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
        combined_attention_mask = None
        if input_shape[-1] > 1:
            combined_attention_mask = _make_causal_mask(
                input_shape,
                torch.float32,  # [MODIFIED] force to cast to float32
                device=inputs_embeds.device,
                past_key_values_length=past_key_values_length,
            )
        if attention_mask is not None:
            expanded_attn_mask = _expand_mask(attention_mask, inputs_embeds.dtype, tgt_len=input_shape[-1]).to(
                inputs_embeds.device)
            combined_attention_mask = (
                expanded_attn_mask if combined_attention_mask is None
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

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None):
        batch_size, seq_length = input_ids.shape
        seq_length_with_past = seq_length
        past_key_values_length = 0
        if past_key_values is not None:
            past_key_values_length = past_key_values[0][0].shape[2]
            seq_length_with_past = seq_length_with_past + past_key_values_length

        if position_ids is None:
            device = input_ids.device
            position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length,
                                        dtype=torch.long, device=device)
            position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
        else:
            position_ids = position_ids.view(-1, seq_length).long()

        inputs_embeds = self.embed_tokens(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length_with_past), dtype=torch.bool,
                                        device=inputs_embeds.device)
        attention_mask = self._prepare_decoder_attention_mask(
            attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length)

        hidden_states = inputs_embeds
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states = decoder_layer(hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, past_key_value=past_key_value)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


# ---------------------------------------------------------------- model/ea_model.py (trimmed)
class EaModel(nn.Module):
    def __init__(self, base_model):
        super().__init__()
        self.base_model = base_model
        self.config = base_model.config
        g = torch.Generator().manual_seed(7)
        # stand-in for the EAGLE draft head: a fixed projection of the base hidden state to the vocab
        self.draft_proj = torch.randn(self.config.hidden_size, self.config.vocab_size, generator=g)

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, output_orig=False,
                position_ids=None, init=True, n_nodes=1):
        with torch.inference_mode():
            hidden_states = self.base_model.model(input_ids=input_ids, attention_mask=attention_mask,
                                                  past_key_values=past_key_values, position_ids=position_ids)
            orig = self.base_model.lm_head(hidden_states)
        if init:
            token = torch.argmax(orig[:, -1], dim=-1)[:, None]
            draft = hidden_states[:, -1] @ self.draft_proj
            order = torch.argsort(draft, dim=-1, descending=True)
            tree_logits = order[:, : n_nodes * TOPK].view(-1, n_nodes, TOPK)
            return (tree_logits,), None, orig, hidden_states, token
        return None, orig, hidden_states


# ---------------------------------------------------------------- model/utils.py
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
    return {
        "tree_attn_mask": tree_attn_mask.unsqueeze(0).unsqueeze(0).to(device),
        "tree_indices": tree_indices.to(device),
        "tree_position_ids": tree_position_ids.to(device),
        "retrieve_indices": retrieve_indices.to(device),
    }


def initialize_tree(input_ids, model, tree_attn_mask, past_key_values, attention_mask=None, n_nodes=1):
    if FIXED:
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        tree_logits, outputs, logits, hidden_state, sample_token = model(
            input_ids, past_key_values=past_key_values, output_orig=True, attention_mask=attention_mask,
            position_ids=position_ids, n_nodes=n_nodes
        )
    else:
        tree_logits, outputs, logits, hidden_state, sample_token = model(
            input_ids, past_key_values=past_key_values, output_orig=True, attention_mask=attention_mask,
            n_nodes=n_nodes
        )
    model.base_model.model.tree_mask = tree_attn_mask
    return tree_logits, logits, hidden_state, sample_token


def generate_candidates(tree_logits, tree_indices, retrieve_indices, sample_token):
    bs = sample_token.shape[0]
    candidates_logit = sample_token
    candidates_tree_logits = tree_logits[0]
    candidates = torch.cat([candidates_logit, candidates_tree_logits.view(bs, -1)], dim=-1)
    tree_candidates = candidates[:, tree_indices]
    tree_candidates_ext = torch.cat(
        [tree_candidates, torch.zeros((bs, 1), dtype=torch.long, device=tree_candidates.device) - 1], dim=-1)
    cart_candidates = tree_candidates_ext[:, retrieve_indices]
    return cart_candidates, tree_candidates


def tree_decoding(model, tree_candidates, past_key_values, tree_position_ids, input_ids, retrieve_indices,
                  attention_mask=None):
    zero_num = attention_mask.shape[1] - attention_mask.long().sum(-1)
    zero_num = zero_num[:, None]
    position_ids = tree_position_ids[None, :] + input_ids.shape[1] - zero_num
    attention_mask = torch.cat(
        (attention_mask, torch.ones_like(tree_candidates, device=attention_mask.device, dtype=attention_mask.dtype)),
        dim=1)
    outputs, tree_logits, hidden_state = model(
        tree_candidates, attention_mask=attention_mask, output_orig=True, past_key_values=past_key_values,
        position_ids=position_ids, init=False,
    )
    logits = tree_logits[:, retrieve_indices]
    return logits, hidden_state, outputs


def evaluate_posterior(logits, candidates):
    # greedy
    posterior_mask = (candidates[:, :, 1:] == torch.argmax(logits[:, :, :-1], dim=-1)).int()
    candidates_accept_length = (torch.cumprod(posterior_mask, dim=-1)).sum(dim=-1)
    accept_length, best_candidate = candidates_accept_length.max(dim=-1)
    return best_candidate, accept_length, logits


def main():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    base = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in base.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model = EaModel(base).eval()

    tree_choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    tree_buffers = generate_tree_buffers(tree_choices)
    n_nodes = int(tree_buffers["tree_indices"].max()) // TOPK + 1

    pad_token_id = 0
    prompts = [[5, 17, 33, 8, 41], [12, 3, 29, 50, 7, 19, 44, 26]]
    max_len = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_token_id] * (max_len - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])

    past_key_values, past_key_values_data, current_length_data = initialize_past_key_values(base, len(prompts))
    model.base_model.model.tree_mask = None
    tree_logits, logits, hidden_state, sample_token = initialize_tree(
        input_ids, model, tree_buffers["tree_attn_mask"], past_key_values, attention_mask=attention_mask,
        n_nodes=n_nodes)
    candidates, tree_candidates = generate_candidates(
        tree_logits, tree_buffers["tree_indices"], tree_buffers["retrieve_indices"], sample_token)
    logits, hidden_state_new, outputs = tree_decoding(
        model, tree_candidates, past_key_values, tree_buffers["tree_position_ids"], input_ids,
        tree_buffers["retrieve_indices"], attention_mask=attention_mask)
    best_candidate, accept_length, _ = evaluate_posterior(logits, candidates)

    for b in range(len(prompts)):
        best = candidates[b, best_candidate[b], : accept_length[b] + 1].tolist()
        nxt = int(torch.argmax(logits[b, best_candidate[b], accept_length[b]]))
        print(f"row {b}: tree tokens {tree_candidates[b].tolist()}")
        print(f"row {b}: verify argmax {torch.argmax(logits[b], dim=-1).tolist()}")
        print(f"row {b}: accepted {best} then {nxt} (accept_length {int(accept_length[b])})")


if __name__ == "__main__":
    main()
