# Correct program (quiet batch quiet-ya).
# Ported from FasterDecoding/REST @50a5fc197382ed8df5b3e946dad2f8337511b541 (retrieval-based speculative
# decoding): DraftRetriever/src/lib.rs (Reader.search's prefix counting, get_draft_choices,
# generate_draft_buffers: draft_attn_mask with column 0 and the diagonal set and each node's ancestors,
# tree_indices, draft_position_ids = trie depth, retrieve_indices padded with -2 then +1), rest/model/utils.py
# (generate_candidates_and_draft_buffer, tree_decoding, evaluate_posterior, update_inference_inputs),
# rest/model/kv_cache.py (KVCache.cat into a preallocated buffer, current_length) and
# rest/model/modeling_llama_kv.py (_make_causal_mask with past_key_values_length, _expand_mask,
# _prepare_decoder_attention_mask writing `combined_attention_mask.min()` where draft_mask == 0 into the
# bottom-right draft_len x draft_len block, eager LlamaAttention with rotary on position_ids).
# The Rust suffix-array lookup is a Python scan over a small token corpus; HashSet order is made sorted.
# Self-check: the tokens REST accepts equal plain greedy decoding (full recompute, no cache), every
# retrieved path's verify logits equal that path run causally after the prefix, and drafts got accepted.
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class LlamaConfig:
    vocab_size = 40; hidden_size = 32; num_attention_heads = 4; num_hidden_layers = 2
    intermediate_size = 64; max_position_embeddings = 128; rms_norm_eps = 1e-6


# ----------------------------------------------------------------------------- kv_cache.py
class KVCache:
    def __init__(self, data, current_length):
        self.data = data
        self.current_length = current_length

    def cat(self, tensor, dim=2):
        dst = self.data.narrow(dim, self.current_length, tensor.shape[dim])
        dst.copy_(tensor)
        self.current_length.add_(tensor.shape[dim])
        return torch.narrow(self.data, 2, 0, self.current_length)


def initialize_past_key_values(config):
    past_key_values_data = torch.zeros(config.num_hidden_layers * 2, 1, config.num_attention_heads,
                                       config.max_position_embeddings,
                                       config.hidden_size // config.num_attention_heads)
    current_length_data = torch.zeros(config.num_hidden_layers * 2, dtype=torch.long)
    past_key_values = []
    for i in range(config.num_hidden_layers):
        past_key_values.append([KVCache(past_key_values_data[i * 2 + j], current_length_data[i * 2 + j])
                                for j in range(2)])
    return past_key_values, past_key_values_data, current_length_data


# ----------------------------------------------------------------------------- modeling_llama_kv.py
def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.tensor(torch.finfo(dtype).min, device=device), device=device)
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
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__(); self.weight = nn.Parameter(1 + 0.1 * torch.randn(d)); self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(config.hidden_size, config.hidden_size, bias=False) for _ in range(4))
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        t = torch.arange(config.max_position_embeddings).float()
        emb = torch.cat([torch.outer(t, inv_freq)] * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos()); self.register_buffer("sin_cached", emb.sin())

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        sp = lambda t: t.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        query_states, key_states, value_states = sp(self.q_proj(hidden_states)), sp(self.k_proj(hidden_states)), sp(self.v_proj(hidden_states))
        cos, sin = self.cos_cached[position_ids].unsqueeze(1), self.sin_cached[position_ids].unsqueeze(1)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        if past_key_value is not None:
            key_states = past_key_value[0].cat(key_states, dim=2)
            value_states = past_key_value[1].cat(value_states, dim=2)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
            attn_weights = torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min))
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, attention_mask, position_ids, past_key_value):
        h = h + self.self_attn(self.input_layernorm(h), attention_mask, position_ids, past_key_value)
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.draft_mask = None

    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
        combined_attention_mask = None
        if input_shape[-1] > 1:
            combined_attention_mask = _make_causal_mask(input_shape, torch.float32, device=inputs_embeds.device,
                                                        past_key_values_length=past_key_values_length)
        if attention_mask is not None:
            expanded_attn_mask = _expand_mask(attention_mask, inputs_embeds.dtype, tgt_len=input_shape[-1])
            combined_attention_mask = (expanded_attn_mask if combined_attention_mask is None
                                       else expanded_attn_mask + combined_attention_mask)
        # [MODIFIED] add draft mask
        if hasattr(self, "draft_mask") and self.draft_mask is not None:
            draft_mask = self.draft_mask
            draft_len = draft_mask.size(-1)
            combined_attention_mask[:, :, -draft_len:, -draft_len:][draft_mask == 0] = combined_attention_mask.min()
        return combined_attention_mask

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = 0
        if past_key_values is not None:
            past_key_values_length = past_key_values[0][0].current_length.item()
        if position_ids is None:
            position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length).unsqueeze(0)
        else:
            position_ids = position_ids.view(-1, seq_length).long()
        inputs_embeds = self.embed_tokens(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length + past_key_values_length), dtype=torch.bool)
        attention_mask = self._prepare_decoder_attention_mask(attention_mask, (batch_size, seq_length),
                                                              inputs_embeds, past_key_values_length)
        h = inputs_embeds
        for idx, layer in enumerate(self.layers):
            h = layer(h, attention_mask, position_ids, past_key_values[idx] if past_key_values is not None else None)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, position_ids=None):
        return self.lm_head(self.model(input_ids, position_ids=position_ids, past_key_values=past_key_values))


# ----------------------------------------------------------------------------- DraftRetriever (lib.rs)
def pad_path(path, length, pad_value=-2):
    return path + [pad_value] * (length - len(path))


def get_draft_choices(paths):
    path_dict, cnt_dict = {}, {}
    for path in paths:
        for depth, item in enumerate(path):
            d = path_dict.setdefault(depth, {})
            if item not in d:
                d[item] = cnt_dict.get(depth, 0)
                cnt_dict[depth] = cnt_dict.get(depth, 0) + 1
    max_branch = max(len(v) for v in path_dict.values())
    draft_choices = set()
    for path in paths:
        for depth in range(len(path)):
            draft_choices.add(tuple(path_dict[p][path[p]] for p in range(depth + 1)))
    return [list(c) for c in sorted(draft_choices)], max_branch


def generate_draft_buffers(draft_choices, topk):
    sorted_draft_choices = sorted(draft_choices, key=lambda x: (len(x), x))
    draft_len = len(sorted_draft_choices) + 1
    depth_counts = [0] * draft_len
    prev_depth = 0
    for path in sorted_draft_choices:
        depth = len(path)
        if depth != prev_depth:
            depth_counts[depth - 1] = 0
        depth_counts[depth - 1] += 1
        prev_depth = depth
    draft_attn_mask = [[0] * draft_len for _ in range(draft_len)]
    for i in range(draft_len):
        draft_attn_mask[i][0] = 1
        draft_attn_mask[i][i] = 1
    start = 0
    for i in range(len(depth_counts)):
        for j in range(depth_counts[i]):
            cur = sorted_draft_choices[start + j]
            if len(cur) == 1:
                continue
            ancestor_idx = []
            for c in range(len(cur) - 1):
                index = next(k for k, x in enumerate(sorted_draft_choices)
                             if x[:min(c, len(x) - 1) + 1] == cur[:min(c, len(cur) - 1) + 1]) + 1
                ancestor_idx.append(index)
            for idx in ancestor_idx:
                draft_attn_mask[j + start + 1][idx] = 1
        start += depth_counts[i]
    draft_tree_indices = [0] * draft_len
    start = 0
    for i in range(len(depth_counts)):
        for j in range(depth_counts[i]):
            draft_tree_indices[start + j + 1] = sorted_draft_choices[start + j][-1] + topk * i + 1
        start += depth_counts[i]
    draft_position_ids = [0] * draft_len
    start = 0
    for i in range(len(depth_counts)):
        for j in range(start + 1, start + depth_counts[i] + 1):
            draft_position_ids[j] = i + 1
        start += depth_counts[i]
    retrieve_indices_nest, retrieve_paths = [], []
    for i in range(len(sorted_draft_choices)):
        cur = sorted_draft_choices[len(sorted_draft_choices) - 1 - i]
        retrieve_indice = []
        if cur in retrieve_paths:
            continue
        for c in range(len(cur)):
            retrieve_indice.append(sorted_draft_choices.index(cur[:c + 1]))
            retrieve_paths.append(cur[:c + 1])
        retrieve_indices_nest.append(retrieve_indice)
    max_length = max(len(x) for x in retrieve_indices_nest)
    retrieve_indices = [[v + 1 for v in pad_path(x, max_length, -2)] for x in retrieve_indices_nest]
    retrieve_indices = [[0] + x for x in retrieve_indices]
    return draft_attn_mask, draft_tree_indices, draft_position_ids, retrieve_indices


class Reader:                       # stand-in for the suffix-array datastore
    def __init__(self, corpus, long=4):
        self.corpus, self.long = corpus, long

    def search(self, this_token, choices=64):
        results = []
        for seq in self.corpus:
            for s in range(len(seq) - len(this_token)):
                if seq[s:s + len(this_token)] == this_token:
                    results.append(seq[s + len(this_token): s + len(this_token) + self.long])
        results = [r for r in results if r]
        if not results:
            return [], [], [], [], []
        paths = sorted({tuple(r[:j + 1]) for r in results for j in range(len(r))})[:choices]
        paths = [list(p) for p in paths]
        draft_choices, max_branch = get_draft_choices(paths)
        mask, tree_indices, position_ids, retrieve_indices = generate_draft_buffers(draft_choices, max_branch)
        max_length = max(len(p) for p in paths)
        return [pad_path(p, max_length, -2) for p in paths], mask, tree_indices, position_ids, retrieve_indices


# ----------------------------------------------------------------------------- rest/model/utils.py
def generate_candidates_and_draft_buffer(logits, input_ids, datastore, token_spans, max_num_draft=64):
    candidates_logit = torch.argmax(logits[:, -1]).unsqueeze(0)
    input_ids_extend = torch.cat([input_ids.squeeze(0), candidates_logit], dim=-1)
    retrieved_token_list = []
    for token_span in token_spans:
        this_token = input_ids_extend.squeeze(0)[-token_span:].tolist()
        retrieved_token_list, _draft_attn_mask, _tree_indices, _draft_position_ids, _retrieve_indices = \
            datastore.search(this_token, choices=max_num_draft)
        if len(retrieved_token_list) != 0:
            break
    if len(retrieved_token_list) == 0:
        random_index = 7
        retrieved_position_token_list = [[random_index]]
        _draft_attn_mask = [[1., 0.], [1., 1.]]
        _tree_indices = [0, 1]
        _draft_position_ids = [0, 1]
        _retrieve_indices = [[0, 1]]
    else:
        retrieved_position_token_list = [list(row) for row in zip(*retrieved_token_list)]
        retrieved_position_token_list = [[x for i, x in enumerate(sub) if sub.index(x) == i and x != -2]
                                         for sub in retrieved_position_token_list]
        TOPK = max(len(r) for r in retrieved_position_token_list)
        retrieved_position_token_list = [pad_path(r, TOPK) for r in retrieved_position_token_list]
    draft_buffers = {
        "draft_attn_mask": torch.tensor(_draft_attn_mask).unsqueeze(0).unsqueeze(0),
        "tree_indices": torch.tensor(_tree_indices),
        "draft_position_ids": torch.tensor(_draft_position_ids),
        "retrieve_indices": torch.tensor(_retrieve_indices),
    }
    candidates_draft_logits = torch.tensor(retrieved_position_token_list, dtype=torch.long).contiguous()
    candidates = torch.cat([candidates_logit, candidates_draft_logits.view(-1)], dim=-1)
    tree_candidates = candidates[draft_buffers["tree_indices"]]
    tree_candidates_ext = torch.cat([tree_candidates, torch.zeros((1), dtype=torch.long)], dim=0)
    cart_candidates = tree_candidates_ext[draft_buffers["retrieve_indices"]]
    return cart_candidates, tree_candidates.unsqueeze(0), draft_buffers


def tree_decoding(model, tree_candidates, past_key_values, draft_position_ids, input_ids, retrieve_indices):
    position_ids = draft_position_ids + input_ids.shape[1]
    tree_logits = model(tree_candidates, past_key_values=past_key_values, position_ids=position_ids)
    return tree_logits[0, retrieve_indices], tree_logits


def evaluate_posterior(logits, candidates):
    posterior_mask = (candidates[:, 1:] == torch.argmax(logits[:, :-1], dim=-1)).int()
    candidates_accept_length = (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)
    accept_length = candidates_accept_length.max()
    if accept_length == 0:
        best_candidate = torch.tensor(0, dtype=torch.long)
    else:
        best_candidate = torch.argmax(candidates_accept_length).to(torch.long)
    return best_candidate, accept_length


def update_inference_inputs(input_ids, candidates, best_candidate, accept_length, retrieve_indices, logits,
                            new_token, past_key_values_data, current_length_data):
    prev_input_len = input_ids.shape[1]
    select_indices = retrieve_indices[best_candidate, : accept_length + 1] + prev_input_len
    input_ids = torch.cat([input_ids, candidates[None, best_candidate, : accept_length + 1]], dim=-1)
    tgt = past_key_values_data[..., select_indices, :]
    dst = past_key_values_data[..., prev_input_len: prev_input_len + tgt.shape[-2], :]
    dst.copy_(tgt, non_blocking=True)
    current_length_data.fill_(prev_input_len + tgt.shape[-2])
    logits = logits[None, best_candidate, accept_length: accept_length + 1]
    new_token += accept_length + 1
    return input_ids, logits, new_token


# ----------------------------------------------------------------------------- run
config = LlamaConfig()
model = LlamaForCausalLM(config).eval()
with torch.no_grad():
    model.lm_head.weight[0] = 0.0   # token 0 (the pad of cart_candidates) has logit 0, never the argmax here

prompt = torch.tensor([[5, 11, 3, 17, 9, 22]])
N_NEW = 24


def greedy_reference(ids, n):
    ids = ids.clone()
    for _ in range(n):
        nxt = model(ids)[0, -1].argmax()
        assert nxt.item() != 0
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids


with torch.no_grad():
    ref = greedy_reference(prompt, N_NEW + 8)
    cont = ref[0, prompt.shape[1]:].tolist()
    # corpus: the true continuation with a few tokens changed, and decoys sharing its suffixes
    noisy = list(cont); noisy[6] = (noisy[6] + 1) % 39 + 1; noisy[13] = (noisy[13] + 3) % 39 + 1
    decoy = [cont[k] if k % 3 else (cont[k] + 5) % 39 + 1 for k in range(len(cont))]
    datastore = Reader([prompt[0].tolist() + noisy, decoy, cont[:8] + [2, 4, 6, 8]])
    token_spans = [3, 2, 1]

    past_key_values, past_key_values_data, current_length_data = initialize_past_key_values(config)
    input_ids = prompt.clone()
    model.model.draft_mask = None
    logits = model(input_ids, past_key_values=past_key_values)
    new_token, max_accept = 0, 0
    while new_token < N_NEW:
        candidates, tree_candidates, draft_buffers = generate_candidates_and_draft_buffer(
            logits, input_ids, datastore, token_spans)
        model.model.draft_mask = draft_buffers["draft_attn_mask"]
        prefix_len = input_ids.shape[1]
        logits, tree_logits = tree_decoding(model, tree_candidates, past_key_values,
                                            draft_buffers["draft_position_ids"], input_ids,
                                            draft_buffers["retrieve_indices"])
        # reference for the verify step: each retrieved path run causally (no cache, no tree) after the prefix
        model.model.draft_mask = None
        for r, path_idx in enumerate(draft_buffers["retrieve_indices"].tolist()):
            real = [k for k in path_idx if k >= 0]
            seq = torch.cat([input_ids, tree_candidates[:, real]], dim=1)
            ref_logits = model(seq)[0, prefix_len:]
            assert torch.allclose(logits[r, :len(real)], ref_logits, atol=1e-4), r
        best_candidate, accept_length = evaluate_posterior(logits, candidates)
        max_accept = max(max_accept, int(accept_length))
        input_ids, logits, new_token = update_inference_inputs(
            input_ids, candidates, best_candidate, accept_length, draft_buffers["retrieve_indices"], logits,
            new_token, past_key_values_data, current_length_data)
        assert current_length_data[0].item() == input_ids.shape[1]

    n = input_ids.shape[1]
    assert torch.equal(input_ids, ref[:, :n]), (input_ids, ref[:, :n])
    assert max_accept >= 2, max_accept
    # the cache after compaction holds exactly what a fresh prefill of the accepted tokens would
    pkv2, data2, _ = initialize_past_key_values(config)
    model(input_ids, past_key_values=pkv2)
    assert torch.allclose(past_key_values_data[..., :n, :], data2[..., :n, :], atol=1e-5)
print("ok", n - prompt.shape[1], "tokens, longest accept", max_accept)
