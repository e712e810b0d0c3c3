# Correct program (quiet batch quiet-r115a).
# Ported from SafeAILab/EAGLE @cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b, EAGLE-2 greedy decoding, shrunk:
#   eagle/model/cnets.py  Model.topK_genrate (tree_mask_init = eye(top_k), tree_mask = cat((tree_mask[:, :, out_ids],
#     tree_mask_init), dim=3), parents / mask_index, the final tree_mask rows built by add_ of the parent row,
#     tree_position_ids = tree_mask.sum(1) - 1, retrieve_indices), Model._prepare_decoder_attention_mask, stable_kv;
#     the draft layer fc(cat(embeds, hidden)) + one decoder layer as eagle/model/cnets1.py
#   eagle/model/modeling_llama_kv.py  _make_causal_mask, _expand_mask, LlamaModel._prepare_decoder_attention_mask
#     (tree_mask written into the bottom-right corner with finfo.min), eager LlamaAttention over KVCache.cat
#   eagle/model/kv_cache.py  KVCache (preallocated data, current_length)
#   eagle/model/utils.py  initialize_tree, tree_decoding, evaluate_posterior (greedy), update_inference_inputs
#   eagle/model/ea_model.py  eagenerate loop
# Target and draft are built from transformers' LlamaConfig with tiny sizes and random weights.
# Checks: each node of the first verified tree gets the logits of a plain causal run over the prompt plus its
# root-to-node path; each drafted node's draft hidden equals a plain causal draft run over its chain; and the
# tokens eagenerate emits equal plain greedy decoding of the target.
import math

import torch
import torch.nn as nn
from transformers import LlamaConfig

torch.manual_seed(0)


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


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings, dtype=inv_freq.dtype)
        emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None], persistent=False)

    def forward(self, x, seq_len=None):
        return self.cos_cached[:, :, :seq_len], self.sin_cached[:, :, :seq_len]


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


def initialize_past_key_values(model, max_length=128):
    config = model.config
    past_key_values_data = torch.zeros(
        config.num_hidden_layers * 2, 1, config.num_key_value_heads, max_length,
        config.hidden_size // config.num_attention_heads,
    )
    current_length_data = torch.zeros(config.num_hidden_layers * 2, dtype=torch.long)
    past_key_values = [
        [KVCache(past_key_values_data[i * 2 + j], current_length_data[i * 2 + j]) for j in range(2)]
        for i in range(config.num_hidden_layers)
    ]
    return past_key_values, [past_key_values_data], current_length_data


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
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, config.max_position_embeddings,
                                               config.rope_parameters["rope_theta"])

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        if isinstance(past_key_value, list):          # target: EAGLE's preallocated KVCache
            key_states = past_key_value[0].cat(key_states, dim=2)
            value_states = past_key_value[1].cat(value_states, dim=2)
        elif past_key_value is not None:              # draft: tuple cache, torch.cat (stable_kv stays untouched)
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        present = (key_states, value_states)
        key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=1)
        value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=1)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), present


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, index=1):
        super().__init__()
        self.index = index
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        if self.index != 0:
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value):
        residual = hidden_states
        if self.index != 0:
            hidden_states = self.input_layernorm(hidden_states)
        hidden_states, present = self.self_attn(hidden_states, attention_mask, position_ids, past_key_value)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
    combined_attention_mask = None
    if input_shape[-1] > 1:
        combined_attention_mask = _make_causal_mask(
            input_shape, torch.float32, device=inputs_embeds.device, past_key_values_length=past_key_values_length
        )
    if attention_mask is not None:
        expanded_attn_mask = _expand_mask(attention_mask, torch.float32, tgt_len=input_shape[-1])
        combined_attention_mask = (
            expanded_attn_mask if combined_attention_mask is None else expanded_attn_mask + combined_attention_mask
        )
    if hasattr(self, "tree_mask") and self.tree_mask is not None:
        tree_mask = self.tree_mask
        _, _, tree_shape0, tree_shape1 = tree_mask.shape
        combined_attention_mask[:, :, -tree_shape0:, -tree_shape1:][tree_mask == 0] = torch.finfo(torch.float32).min
    return combined_attention_mask


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.tree_mask = None

    _prepare_decoder_attention_mask = _prepare_decoder_attention_mask

    def forward(self, input_ids, position_ids=None, past_key_values=None):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length)[None]
        inputs_embeds = self.embed_tokens(input_ids)
        attention_mask = torch.ones((batch_size, seq_length + past_key_values_length), dtype=torch.bool)
        attention_mask = self._prepare_decoder_attention_mask(
            attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length
        )
        hidden_states = inputs_embeds
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states, _ = decoder_layer(hidden_states, attention_mask, position_ids, past_key_value)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class Model(nn.Module):  # the EAGLE draft head
    def __init__(self, config, total_tokens=12, depth=4, top_k=3):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, index) for index in range(config.num_hidden_layers)])
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.logsoftmax = nn.LogSoftmax(dim=-1)
        self.top_k, self.total_tokens, self.depth = top_k, total_tokens - 1, depth
        self.init_tree()

    def init_tree(self):
        self.tree_mask_init = torch.eye(self.top_k)[None, None]
        self.position_ids = torch.zeros(self.top_k, dtype=torch.long)

    def reset(self):
        self.tree_mask = None

    def reset_kv(self):
        self.stable_kv = None

    _prepare_decoder_attention_mask = _prepare_decoder_attention_mask

    def forward(self, hidden_states, input_ids, position_ids=None, past_key_values=None, use_cache=True):
        batch_size, seq_length, _ = hidden_states.shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        with torch.no_grad():
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length)
            position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
        else:
            position_ids = position_ids.view(-1, seq_length).long()
        attention_mask = torch.ones((batch_size, seq_length + past_key_values_length), dtype=torch.bool)
        attention_mask = self._prepare_decoder_attention_mask(
            attention_mask, (batch_size, seq_length), hidden_states, past_key_values_length
        )
        hidden_states = self.fc(torch.cat((inputs_embeds, hidden_states), dim=-1))
        next_decoder_cache = ()
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = decoder_layer(hidden_states, attention_mask, position_ids, past_key_value)
            next_decoder_cache += (present,)
        return hidden_states, next_decoder_cache

    @torch.no_grad()
    def topK_genrate(self, hidden_states, input_ids, head, logits_processor):
        total_tokens, depth, top_k = self.total_tokens, self.depth, self.top_k
        sample_token = input_ids[:, -1]
        scores_list, parents_list, ss_token = [], [], []
        input_ids = input_ids[:, 1:]
        len_posi = input_ids.shape[1]
        self.reset()
        if hasattr(self, "stable_kv") and self.stable_kv is not None:
            kv_len = self.stable_kv[0][0].shape[2]
            out_hidden, past_key_values = self(hidden_states, input_ids=input_ids[:, kv_len:],
                                               past_key_values=self.stable_kv, use_cache=True)
        else:
            out_hidden, past_key_values = self(hidden_states, input_ids=input_ids, use_cache=True)
        self.stable_kv = past_key_values
        last_hidden = out_hidden[:, -1]
        last_headout = head(last_hidden)
        last_p = self.logsoftmax(last_headout)
        top = torch.topk(last_p, top_k, dim=-1)
        topk_index, topk_p = top.indices, top.values
        scores = topk_p[0]
        scores_list.append(scores[None])
        parents_list.append(torch.zeros(1, dtype=torch.long))
        ss_token.append(topk_index)
        input_ids = topk_index
        input_hidden = last_hidden[None].repeat(1, top_k, 1)
        tree_mask = self.tree_mask_init
        topk_cs_index = torch.arange(top_k)
        self.trace = [(input_hidden, input_ids, tree_mask)]   # kept for the check below
        for i in range(depth):
            self.tree_mask = tree_mask
            position_ids = len_posi + self.position_ids
            out_hidden, past_key_values = self(input_hidden, input_ids=input_ids, past_key_values=past_key_values,
                                               position_ids=position_ids, use_cache=True)
            len_posi += 1
            self.trace[-1] += (out_hidden,)
            bias1 = top_k if i > 0 else 0
            bias2 = max(0, i - 1)
            bias = 1 + top_k ** 2 * bias2 + bias1
            parents = (topk_cs_index + bias)
            parents_list.append(parents)
            last_headout = head(out_hidden[0])
            last_p = self.logsoftmax(last_headout)
            top = torch.topk(last_p, top_k, dim=-1)
            topk_index, topk_p = top.indices, top.values
            cu_scores = topk_p + scores[:, None]
            topk_cs = torch.topk(cu_scores.view(-1), top_k, dim=-1)
            topk_cs_index, topk_cs_p = topk_cs.indices, topk_cs.values
            scores = topk_cs_p
            out_ids = topk_cs_index // top_k
            input_hidden = out_hidden[:, out_ids]
            input_ids = topk_index.view(-1)[topk_cs_index][None]
            ss_token.append(topk_index)
            scores_list.append(cu_scores)
            tree_mask = torch.cat((tree_mask[:, :, out_ids], self.tree_mask_init), dim=3)
            self.trace.append((input_hidden, input_ids, tree_mask, out_ids))

        scores_list = torch.cat(scores_list, dim=0).view(-1)
        ss_token_list = torch.cat(ss_token, dim=0).view(-1)
        top_scores = torch.topk(scores_list, total_tokens, dim=-1)
        top_scores_index = top_scores.indices
        top_scores_index = torch.sort(top_scores_index).values
        draft_tokens = ss_token_list[top_scores_index]
        draft_tokens = torch.cat((sample_token, draft_tokens), dim=0)
        draft_parents = torch.cat(parents_list, dim=0)[top_scores_index // top_k].long()
        mask_index = torch.searchsorted(top_scores_index, draft_parents - 1, right=False)
        mask_index[draft_parents == 0] = -1
        mask_index = mask_index + 1
        mask_index_list = mask_index.tolist()
        tree_mask = torch.eye(total_tokens + 1).bool()
        tree_mask[:, 0] = True
        for i in range(total_tokens):
            tree_mask[i + 1].add_(tree_mask[mask_index_list[i]])
        tree_position_ids = torch.sum(tree_mask, dim=1) - 1
        tree_mask = tree_mask.float()[None, None]
        draft_tokens = draft_tokens[None]

        max_depth = torch.max(tree_position_ids) + 1
        noleaf_index = torch.unique(mask_index).tolist()
        noleaf_num = len(noleaf_index) - 1
        leaf_num = total_tokens - noleaf_num
        retrieve_indices = (torch.zeros(leaf_num, max_depth.item(), dtype=torch.long) - 1).tolist()
        rid = 0
        position_ids_list = tree_position_ids.tolist()
        for i in range(total_tokens + 1):
            if i not in noleaf_index:
                cid = i
                depth = position_ids_list[i]
                for j in reversed(range(depth + 1)):
                    retrieve_indices[rid][j] = cid
                    cid = mask_index_list[cid - 1]
                rid += 1
        retrieve_indices = torch.tensor(retrieve_indices, dtype=torch.long)
        return draft_tokens, retrieve_indices, tree_mask, tree_position_ids


class EaModel(nn.Module):
    def __init__(self, base_model, ea_layer):
        super().__init__()
        self.base_model, self.ea_layer = base_model, ea_layer

    def forward(self, input_ids, past_key_values=None, position_ids=None):
        hidden_states = self.base_model.model(input_ids, position_ids=position_ids, past_key_values=past_key_values)
        return self.base_model.lm_head(hidden_states), hidden_states


def initialize_tree(input_ids, model, past_key_values):
    orig, hidden_states = model(input_ids, past_key_values=past_key_values)
    token = torch.argmax(orig[:, -1])[None, None]
    input_ids = torch.cat((input_ids, token), dim=1)
    draft_tokens, retrieve_indices, tree_mask, tree_position_ids = model.ea_layer.topK_genrate(
        hidden_states, input_ids, model.base_model.lm_head, None)
    return draft_tokens, retrieve_indices, tree_mask, tree_position_ids, orig, hidden_states, token


def tree_decoding(model, tree_candidates, past_key_values, tree_position_ids, input_ids, retrieve_indices):
    position_ids = tree_position_ids + input_ids.shape[1]
    if position_ids is not None and position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    tree_logits, hidden_state = model(tree_candidates, past_key_values=past_key_values, position_ids=position_ids)
    logits = tree_logits[0, retrieve_indices]
    return logits, hidden_state, tree_logits


def evaluate_posterior(logits, candidates):
    posterior_mask = (candidates[:, 1:] == torch.argmax(logits[:, :-1], dim=-1)).int()
    candidates_accept_length = (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)
    accept_length = candidates_accept_length.max()
    if accept_length == 0:
        best_candidate = torch.tensor(0, dtype=torch.long)
    else:
        best_candidate = torch.argmax(candidates_accept_length).to(torch.long)
    return best_candidate, accept_length, logits[best_candidate, accept_length]


@torch.no_grad()
def update_inference_inputs(input_ids, candidates, best_candidate, accept_length, retrieve_indices, new_token,
                            past_key_values_data_list, current_length_data, model, hidden_state_new, sample_p):
    prev_input_len = input_ids.shape[1]
    select_indices = retrieve_indices[best_candidate, : accept_length + 1] + prev_input_len
    input_ids = torch.cat([input_ids, candidates[None, best_candidate, : accept_length + 1]], dim=-1)
    for past_key_values_data in past_key_values_data_list:
        tgt = past_key_values_data[..., select_indices, :]
        dst = past_key_values_data[..., prev_input_len: prev_input_len + tgt.shape[-2], :]
        dst.copy_(tgt, non_blocking=True)
    current_length_data.fill_(prev_input_len + tgt.shape[-2])
    retrieve_hidden_state_new = hidden_state_new[:, retrieve_indices]
    accept_hidden_state_new = retrieve_hidden_state_new[:, best_candidate, : accept_length + 1]
    token = torch.argmax(sample_p)[None, None]
    draft_tokens, retrieve_indices, tree_mask, tree_position_ids = model.ea_layer.topK_genrate(
        accept_hidden_state_new, input_ids=torch.cat((input_ids, token), dim=1),
        head=model.base_model.lm_head, logits_processor=None)
    new_token += accept_length + 1
    return input_ids, draft_tokens, retrieve_indices, tree_mask, tree_position_ids, new_token, None, token


config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
draft_config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
base_model = LlamaForCausalLM(config).eval()
ea_layer = Model(draft_config, total_tokens=12, depth=4, top_k=3).eval()
ea_layer.embed_tokens.weight.data.copy_(base_model.model.embed_tokens.weight.data)
model = EaModel(base_model, ea_layer)


def reference_logits(ids):  # plain causal run of the target, no cache, no tree
    base_model.model.tree_mask = None
    return base_model.lm_head(base_model.model(ids))


def check_draft_tree(ea_layer, hidden_seq, ids_seq):
    # every node the draft expanded at depth step i: a plain causal draft run over stable prefix + its chain
    ea_layer.tree_mask = None
    top_k = ea_layer.top_k
    chains = [[j] for j in range(top_k)]          # per node of the current step: its node index at every step
    for i, (input_hidden, input_ids, tree_mask, *rest) in enumerate(ea_layer.trace[:-1]):
        out_hidden = rest[-1]
        if i > 0:
            chains = [chains[o] + [j] for j, o in enumerate(ea_layer.trace[i][3].tolist())]
        for j in range(top_k):
            hs = [ea_layer.trace[s][0][0, chains[j][s]] for s in range(i + 1)]
            toks = [ea_layer.trace[s][1][0, chains[j][s]] for s in range(i + 1)]
            h = torch.cat([hidden_seq, torch.stack(hs)[None]], dim=1)
            t = torch.cat([ids_seq, torch.stack(toks)[None]], dim=1)
            ref, _ = ea_layer(h, t)
            assert torch.allclose(out_hidden[0, j], ref[0, -1], atol=1e-5), (i, j)


with torch.no_grad():
    prompt = torch.randint(0, config.vocab_size, (1, 9))
    max_new = 8

    # plain greedy decoding of the target
    ref_ids = prompt.clone()
    for _ in range(max_new + ea_layer.depth + 2):
        ref_ids = torch.cat([ref_ids, reference_logits(ref_ids)[:, -1].argmax(-1, keepdim=True)], dim=1)

    # eagenerate (greedy)
    past_key_values, past_key_values_data, current_length_data = initialize_past_key_values(base_model)
    padding = torch.zeros(1, 1, dtype=torch.long) - 1
    input_ids = prompt.clone()
    ea_layer.reset_kv()
    base_model.model.tree_mask = None
    draft_tokens, retrieve_indices, tree_mask, tree_position_ids, logits, hidden_state, sample_token = \
        initialize_tree(input_ids, model, past_key_values)
    draft_ids_seq, draft_hidden_seq = torch.cat([input_ids, sample_token], 1)[:, 1:], hidden_state
    new_token, accepted = 0, []
    for idx in range(max_new):
        check_draft_tree(ea_layer, draft_hidden_seq, draft_ids_seq)
        base_model.model.tree_mask = tree_mask
        logits, hidden_state_new, tree_logits = tree_decoding(
            model, draft_tokens, past_key_values, tree_position_ids, input_ids, retrieve_indices)
        # every tree node: the target's logits over prompt + its root-to-node path
        parent_of = {}
        for row in retrieve_indices.tolist():
            path = [c for c in row if c >= 0]
            for a, b in zip(path, path[1:]):
                parent_of[b] = a
        for node in range(draft_tokens.shape[1]):
            chain = [node]
            while chain[-1] in parent_of:
                chain.append(parent_of[chain[-1]])
            ref = reference_logits(torch.cat([input_ids, draft_tokens[:, chain[::-1]]], dim=1))[0, -1]
            base_model.model.tree_mask = tree_mask
            assert torch.allclose(tree_logits[0, node], ref, atol=1e-4), (idx, node)
        draft_tokens = torch.cat((draft_tokens, padding), dim=1)
        candidates = draft_tokens[0, retrieve_indices]
        best_candidate, accept_length, sample_p = evaluate_posterior(logits, candidates)
        accepted.append(int(accept_length))
        input_ids, draft_tokens, retrieve_indices, tree_mask, tree_position_ids, new_token, hidden_state, \
            sample_token = update_inference_inputs(
                input_ids, candidates, best_candidate, accept_length, retrieve_indices, new_token,
                past_key_values_data, current_length_data, model, hidden_state_new, sample_p)
        draft_ids_seq = torch.cat([input_ids, sample_token], 1)[:, 1:]
        draft_hidden_seq = torch.cat([draft_hidden_seq, hidden_state_new[:, retrieve_indices][:, best_candidate,
                                      : accept_length + 1]], dim=1)
        assert current_length_data[0].item() == input_ids.shape[1]
        if new_token >= max_new:
            break

    n = input_ids.shape[1]
    assert torch.equal(input_ids, ref_ids[:, :n]), (input_ids, ref_ids)
    print("steps", idx + 1, "accepted", accepted, "tokens", n - prompt.shape[1], "ok")
