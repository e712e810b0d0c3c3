# Correct program (quiet batch quiet-r83b).
# Ported from yandex-research/specexec @c7f24b32638dcbb0ef2d1176719980631730c4e8:
#   specdec/trees.py (Tree: amask, reset_amask_to_prefix_len, process_candidates, add, reset_to_sequence,
#   invert_mask), specdec/specexec.py (SpecExecBase.grow_tree, validate_tree, and the simple
#   get_next_beams over cumulative log-probs), engine/engines.py (EngineRegular.forward slicing the mask to
#   cache_position.max() + 1, EngineRegular.reorder_cache_tokens, DynamicCachePlus.update writing keys at
#   cache_position), engine/Llama_modules.py (LlamaAttention_FI: rotary at position_ids, SDPA with the float
#   mask, is_causal=False).
# SpecExec keeps one (max_len, max_len) 0/1 mask for the whole tree: the prompt is a causal triangle, every
# added token copies its parent's row and sets its own diagonal. Draft and target run the rows of the tokens
# they take, inverted to a float mask, with position_ids = depth and cache_position = tree index; greedy
# validation keeps the longest accepted root path, compacts both caches to it and appends the target's token.
# Self-check: every target logit of the verify pass equals the target run alone on that node's root path
# (a hand-written causal double loop, no cache), and the generated text equals plain greedy decoding.
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

torch.manual_seed(0)

TOKENS = 0
POSITIONS = 1
PARENTS = 2
STATUS = 3


# ---------------------------------------------------------------- model (engine/Llama_modules.py, trimmed)
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaRotaryEmbedding_FI(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings, dtype=inv_freq.dtype)
        emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, dtype, seq_len=None):
        return self.cos_cached[:seq_len].to(dtype), self.sin_cached[:seq_len].to(dtype)


class DynamicCachePlus:
    """engine/engines.py DynamicCachePlus: keys are written at cache_position (padding the cache as needed)."""

    def __init__(self):
        self.key_cache = []
        self.value_cache = []

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if (cache_kwargs is not None) and ("cache_position" in cache_kwargs) and (len(self.key_cache) > layer_idx):
            cache_position = cache_kwargs["cache_position"]
            pad_size = max(cache_position.max().item() + 1 - self.key_cache[layer_idx].shape[-2], 0)
            self.key_cache[layer_idx] = F.pad(self.key_cache[layer_idx], (0, 0, 0, pad_size), value=0)
            self.key_cache[layer_idx][:, :, cache_position, :] = key_states
            self.value_cache[layer_idx] = F.pad(self.value_cache[layer_idx], (0, 0, 0, pad_size), value=0)
            self.value_cache[layer_idx][:, :, cache_position, :] = value_states
        else:  # empty cache: the first forward starts at cache position 0
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self):
        return 0 if not self.key_cache else self.key_cache[0].shape[-2]

    @classmethod
    def from_legacy_cache(cls, past):
        c = cls()
        for k, v in past:
            c.key_cache.append(k)
            c.value_cache.append(v)
        return c

    def __getitem__(self, i):
        return self.key_cache[i], self.value_cache[i]

    def __iter__(self):
        return iter(zip(self.key_cache, self.value_cache))


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class LlamaAttention_FI(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding_FI(self.head_dim, config.max_position_embeddings, ROPE_THETA)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_values, cache_position):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(value_states.dtype)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        key_states, value_states = past_key_values.update(
            key_states, value_states, self.layer_idx, {"cache_position": cache_position}
        )
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention_FI(config, layer_idx)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, **kw):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), **kw)
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaForCausalLM_FI(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dtype = torch.float32
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, cache_position):
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                cache_position=cache_position,
            )
        return self.lm_head(self.norm(hidden_states)), past_key_values


# ---------------------------------------------------------------- engine (engine/engines.py EngineRegular)
class EngineRegular:
    def __init__(self, model, max_len, device="cpu"):
        self.model = model
        self.config = model.config
        self.max_len = max_len
        self.device = device
        self.kv_cache = DynamicCachePlus()

    @torch.inference_mode()
    def forward(self, input_ids, attention_mask=None, position_ids=None, cache_position=None):
        attention_mask = attention_mask[..., : cache_position.max() + 1]
        assert attention_mask.shape[-2] == input_ids.shape[-1]
        logits, self.kv_cache = self.model.forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=self.kv_cache,
            cache_position=cache_position,
        )
        return logits

    @property
    def kv_len_used(self):
        return self.kv_cache.get_seq_length()

    def clear_kv(self):
        self.kv_cache = DynamicCachePlus()

    def reorder_cache_tokens(self, source_token_idxs, dest_token_idxs=None):
        cache_size = self.kv_cache[0][0].shape[-2]
        if source_token_idxs.dtype == torch.bool:
            source_token_idxs = torch.where(source_token_idxs)[0]
        left_edge = dest_token_idxs.min() if dest_token_idxs is not None else 0
        if source_token_idxs.max() >= cache_size:
            source_token_idxs = source_token_idxs[source_token_idxs < cache_size]
            dest_token_idxs = torch.arange(left_edge, left_edge + source_token_idxs.shape[-1], device=self.device)
        if dest_token_idxs is None:
            dest_token_idxs = torch.arange(source_token_idxs.shape[-1], device=self.device)
        new_cache = []
        for layer_cache_k, layer_cache_v in self.kv_cache:
            new_cache.append(
                (
                    torch.cat([layer_cache_k[:, :, :left_edge, :], layer_cache_k[:, :, source_token_idxs, :]], dim=-2),
                    torch.cat([layer_cache_v[:, :, :left_edge, :], layer_cache_v[:, :, source_token_idxs, :]], dim=-2),
                )
            )
        self.kv_cache = DynamicCachePlus.from_legacy_cache(tuple(new_cache))


# ---------------------------------------------------------------- tree (specdec/trees.py)
class Tree:
    def __init__(self, prefix_tokens, draft_engine):
        self.device = draft_engine.device
        self.end = 0
        self.engine = draft_engine
        self.engine.clear_kv()
        self.max_len = self.engine.max_len
        self.PROMPT = torch.tensor(10)
        self.GENERATED = torch.tensor(15)
        self.PROCESSED = torch.tensor(20)
        self.CANDIDATE = torch.tensor(30)
        self.data = torch.zeros(4, self.max_len, dtype=torch.int64)
        self.log_probs = torch.zeros(self.max_len, dtype=torch.float32)
        self.amask = torch.zeros((1, 1, self.max_len, self.max_len), dtype=torch.float16)
        prefix_tokens = torch.as_tensor(prefix_tokens)
        self.prefix_len = prefix_tokens.flatten().shape[-1]
        self.data[TOKENS, : self.prefix_len] = prefix_tokens.flatten()
        self.data[POSITIONS, : self.prefix_len] = torch.arange(self.prefix_len)
        self.data[PARENTS, 1 : self.prefix_len] = torch.arange(self.prefix_len - 1)
        self.data[STATUS, : self.prefix_len - 1] = self.PROMPT
        self.data[STATUS, self.prefix_len - 1] = self.CANDIDATE
        self.end = self.prefix_len
        self.reset_amask_to_prefix_len(self.prefix_len)

    def reset_amask_to_prefix_len(self, px_len=None):
        px_len = self.prefix_len if px_len is None else px_len
        self.amask.zero_()
        _causal_mask = torch.tril(torch.ones(px_len, px_len, dtype=self.amask.dtype))
        self.amask[..., :px_len, :px_len] = _causal_mask

    tokens = property(lambda self: self.data[TOKENS, : self.end])
    positions = property(lambda self: self.data[POSITIONS, : self.end])
    parents = property(lambda self: self.data[PARENTS, : self.end])
    status = property(lambda self: self.data[STATUS, : self.end])

    @property
    def size(self):
        return self.end

    @torch.inference_mode()
    def process_candidates(self, lim=None):
        candidate_idxs = torch.where(self.data[STATUS, : self.end] == self.CANDIDATE)[0]
        assert candidate_idxs.numel() > 0
        if lim is not None:
            candidate_idxs = candidate_idxs[:lim]
        if self.engine.kv_len_used < candidate_idxs.min():
            input_idxs = torch.cat([torch.arange(self.engine.kv_len_used, candidate_idxs.min()), candidate_idxs])
        else:
            input_idxs = candidate_idxs
        input_ids = self.data[TOKENS, input_idxs].unsqueeze(0)
        position_ids = self.data[POSITIONS, input_idxs].unsqueeze(0)
        attention_mask = self.amask[..., input_idxs, :]
        logits = self.engine.forward(
            input_ids=input_ids,
            attention_mask=self.invert_mask(attention_mask, dtype=self.engine.model.dtype),
            position_ids=position_ids,
            cache_position=input_idxs,
        )
        self.data[STATUS, candidate_idxs] = self.PROCESSED
        beam_scores = self.log_probs[candidate_idxs]
        beam_positions = self.data[POSITIONS, candidate_idxs]
        out_logits = logits[0, -candidate_idxs.shape[-1] :, :]
        return out_logits, candidate_idxs, beam_scores, beam_positions

    def add(self, token_ids, positions, parent_idxs, log_probs, new_status=None):
        new_status = self.CANDIDATE if new_status is None else new_status
        add_size = token_ids.numel()
        if add_size > self.max_len - self.end:
            raise ValueError("tree capacity exceeded")
        self.data[TOKENS, self.end : self.end + add_size] = token_ids.view(-1)
        self.data[POSITIONS, self.end : self.end + add_size] = positions.view(-1)
        self.data[PARENTS, self.end : self.end + add_size] = parent_idxs.view(-1)
        self.data[STATUS, self.end : self.end + add_size] = new_status
        self.log_probs[self.end : self.end + add_size] = log_probs.view(-1)
        amask_draft = self.amask[..., parent_idxs.view(-1), : self.end]
        new_amask_eye = torch.eye(add_size)[None, None, ...]
        amask_draft = torch.cat((amask_draft, new_amask_eye), dim=-1)
        self.amask[..., self.end : self.end + add_size, : self.end + add_size] = amask_draft
        self.end += add_size

    def reset_to_sequence(self, sequence_mask, target_engine=None):
        assert torch.all(sequence_mask[: self.prefix_len])
        sequence_idxs = torch.where(sequence_mask != 0)[0]
        if target_engine:
            target_engine.reorder_cache_tokens(sequence_mask)
        self.engine.reorder_cache_tokens(sequence_mask[: self.engine.kv_len_used])
        new_len = sum(sequence_mask).item()
        if torch.any(sequence_mask[self.prefix_len :]):
            source_idxs = sequence_idxs[sequence_idxs >= self.prefix_len]
            dest_idxs = torch.arange(self.prefix_len, new_len)
            self.data[TOKENS, dest_idxs] = self.data[TOKENS, source_idxs]
            self.data[POSITIONS, dest_idxs] = dest_idxs
            self.data[PARENTS, dest_idxs] = dest_idxs - 1
            self.data[STATUS, dest_idxs] = self.GENERATED
        self.end = new_len
        self.prefix_len = self.end
        self.data[STATUS, : self.prefix_len] = self.PROMPT
        self.log_probs[self.end :].zero_()
        self.data[:, self.end :].zero_()
        self.reset_amask_to_prefix_len()

    @staticmethod
    def invert_mask(mask, dtype=torch.float32):
        if mask.min() == 0:
            min_dtype = torch.finfo(dtype).min
            mask = (mask.eq(0.0)).to(dtype=dtype) * min_dtype
        return mask


# ---------------------------------------------------------------- SpecExec (specdec/specexec.py, greedy)
class SpecExec:
    def __init__(self, draft_engine, target_engine):
        self.draft_engine = draft_engine
        self.target_engine = target_engine
        self.verify_log = []  # (node tokens on root path, target logits row) for the self-check

    def get_next_beams(self, logits, parent_pos, parent_idxs, beam_scores, num_beams=None):
        logprobs = torch.log_softmax(logits, dim=-1)
        vocab_size = logprobs.shape[-1]
        flat_log_probs = (beam_scores.unsqueeze(-1) + logprobs).flatten()
        flat_best = flat_log_probs.topk(k=num_beams, largest=True)
        best_hypo_ids = flat_best.indices // vocab_size
        best_child_token_ids = flat_best.indices % vocab_size
        return best_child_token_ids, parent_pos[best_hypo_ids] + 1, parent_idxs[best_hypo_ids], flat_best.values

    @torch.inference_mode()
    def grow_tree(self, max_budget, max_beam_len, max_n_beams):
        for next_position in range(self.tree.prefix_len, self.tree.prefix_len + max_beam_len):
            draft_logits, parent_indices, parent_scores, parent_positions = self.tree.process_candidates(lim=max_n_beams)
            ids, pos, par, scores = self.get_next_beams(
                draft_logits, parent_pos=parent_positions, parent_idxs=parent_indices, beam_scores=parent_scores,
                num_beams=max_n_beams,
            )
            if ids.shape[-1] == 0:
                break
            if self.tree.end - self.tree.prefix_len >= max_budget:
                break
            self.tree.add(ids, pos, par, scores, new_status=self.tree.CANDIDATE)

    @torch.inference_mode()
    def validate_tree(self):
        tree = self.tree
        target_token_map_bool = tree.status[: tree.end] >= tree.PROCESSED
        target_token_map_bool[: tree.prefix_len] = False
        target_token_idxs = torch.where(target_token_map_bool)[0]
        target_parent_idxs = tree.parents[: tree.end][target_token_map_bool]

        input_token_map_bool = target_token_map_bool.clone()
        input_token_map_bool[target_parent_idxs] = True
        if self.target_engine.kv_len_used == 0:
            input_token_map_bool[: tree.prefix_len] = True

        input_ids = tree.tokens[input_token_map_bool].unsqueeze(0)
        cache_position = torch.where(input_token_map_bool)[0]
        amask_target = tree.amask[:, :, cache_position, : self.target_engine.max_len]
        position_ids = tree.positions[input_token_map_bool].unsqueeze(0)

        target_logits = self.target_engine.forward(
            input_ids=input_ids,
            attention_mask=tree.invert_mask(amask_target, dtype=self.target_engine.model.dtype),
            position_ids=position_ids,
            cache_position=cache_position,
        )
        target_logits = target_logits.squeeze(0)
        for row, idx in enumerate(cache_position.tolist()):
            path = torch.where(tree.amask[0, 0, idx, : tree.end] != 0)[0]
            self.verify_log.append((tree.tokens[path].clone(), target_logits[row].clone()))

        all_target_token_choices = target_logits.argmax(dim=-1)  # temperature 0
        interim_t = torch.ones_like(tree.tokens)
        interim_t[input_token_map_bool] = all_target_token_choices
        draft_token_choices = tree.tokens[target_token_map_bool]
        target_token_choices = interim_t[target_parent_idxs]
        accept_flags = draft_token_choices == target_token_choices
        accept_idxs = target_token_idxs[accept_flags]

        accept_mask = torch.zeros(tree.end)
        accept_mask[: tree.prefix_len] = 1
        accept_mask[accept_idxs] = 1
        accepted_amask = amask_target[0, 0, :, : tree.end] * accept_mask
        mask_row_sums = amask_target[0, 0, :, : tree.end].sum(axis=1)
        seq_lengths = accepted_amask.sum(axis=1)
        best_sequence_index = (mask_row_sums * (mask_row_sums == seq_lengths)).argmax()
        best_sequence_mask = amask_target[0, 0, best_sequence_index, : tree.end].to(torch.bool)

        fresh_token_idxs = torch.where(best_sequence_mask[tree.prefix_len :])[0] + tree.prefix_len
        fresh_token_ids = tree.tokens[fresh_token_idxs].tolist()
        last_accepted_token_position = fresh_token_idxs[-1] if fresh_token_idxs.numel() else tree.prefix_len - 1
        tree.reset_to_sequence(best_sequence_mask, target_engine=self.target_engine)

        extra_token_id = interim_t[last_accepted_token_position]
        tree.add(
            token_ids=extra_token_id,
            positions=tree.positions[tree.size - 1] + 1,
            parent_idxs=torch.tensor([tree.size - 1]),
            log_probs=torch.tensor(0.0),
            new_status=tree.CANDIDATE,
        )
        tree.prefix_len = tree.end
        tree.data[STATUS, : tree.prefix_len - 1] = tree.PROMPT
        fresh_token_ids.append(extra_token_id.item())
        return fresh_token_ids

    def generate(self, prefix_tokens, max_new_tokens, max_budget=48, max_beam_len=4, max_n_beams=6):
        self.target_engine.clear_kv()
        self.tree = Tree(prefix_tokens, self.draft_engine)
        out, accepted = [], []
        while len(out) < max_new_tokens:
            self.grow_tree(max_budget, max_beam_len, max_n_beams)
            fresh = self.validate_tree()
            accepted.append(len(fresh))
            out.extend(fresh)
        return out[:max_new_tokens], accepted


# ---------------------------------------------------------------- reference: causal double loop, no cache
@torch.no_grad()
def reference_logits(model, tokens):
    """Run `model` on one token path with an explicit per-query loop over keys 0..i (no mask tensor)."""
    h = model.embed_tokens(tokens[None])
    L = tokens.shape[0]
    pos = torch.arange(L)[None]
    for layer in model.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_proj(x).view(1, L, a.num_heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(1, L, a.num_key_value_heads, a.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(1, L, a.num_key_value_heads, a.head_dim).transpose(1, 2)
        cos, sin = a.rotary_emb(q.dtype)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, pos)
        k, v = repeat_kv(k, a.num_key_value_groups), repeat_kv(v, a.num_key_value_groups)
        o = torch.zeros_like(q)
        for i in range(L):
            s = (q[:, :, i : i + 1] @ k[:, :, : i + 1].transpose(-1, -2)) / math.sqrt(a.head_dim)
            o[:, :, i] = (s.softmax(-1) @ v[:, :, : i + 1])[:, :, 0]
        h = h + a.o_proj(o.transpose(1, 2).reshape(1, L, -1))
        y = layer.post_attention_layernorm(h)
        h = h + layer.down_proj(F.silu(layer.gate_proj(y)) * layer.up_proj(y))
    return model.lm_head(model.norm(h))[0]


if __name__ == "__main__":
    config = LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
    )
    ROPE_THETA = 10000.0
    target = LlamaForCausalLM_FI(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    draft = LlamaForCausalLM_FI(config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():  # a draft close to the target, so that several tokens are accepted per step
        for p in draft.parameters():
            p.add_(0.1 * torch.randn_like(p))

    spec = SpecExec(EngineRegular(draft, max_len=160), EngineRegular(target, max_len=160))
    prompt = torch.randint(0, config.vocab_size, (7,))
    n_new = 24
    out, accepted = spec.generate(prompt, n_new)

    # 1) each verify row equals the target run alone on that node's root path
    worst, seen = 0.0, {}
    for path_tokens, logit_row in spec.verify_log:
        key = tuple(path_tokens.tolist())
        if key not in seen:
            seen[key] = reference_logits(target, path_tokens)[-1]
        ref = seen[key]
        worst = max(worst, (ref - logit_row).abs().max().item())
    assert worst < 1e-4, worst

    # 2) the speculative output equals plain greedy decoding (full recompute each step)
    seq = prompt.clone()
    greedy = []
    for _ in range(n_new):
        nxt = reference_logits(target, seq)[-1].argmax().item()
        greedy.append(nxt)
        seq = torch.cat([seq, torch.tensor([nxt])])
    assert out == greedy, (out, greedy)
    assert max(accepted) > 1, accepted
    print(f"ok: {len(spec.verify_log)} verify rows match (max err {worst:.2e}); accepted per step {accepted}")
    sys.exit(0)
