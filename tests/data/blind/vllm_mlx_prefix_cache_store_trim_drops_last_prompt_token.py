# vllm-mlx (waybarrios/vllm-mlx#311, commit 0fba551, merged as 192e490, "fix: prefix cache off-by-one for PREFIX
# and LCP matches"): vllm_mlx/mllm_batch_generator.py MLLMBatchGenerator._maybe_store_prefix_cache stored a finished
# request's prompt KV with total_trim = output_count + 1 + S, so the stored cache offset was len(key) - 1 while the
# key still held every prompt token. The exact-match path re-ran the last prompt token and came out right, but a
# PREFIX or LCP hit from MemoryAwarePrefixCache.fetch returns remaining = tokens[match_length:], so the token at
# match_length - 1 was in neither the cached KV nor the remaining tokens: the next turn (a system prompt or tool
# list after [gMASK]<sop>, or a second user turn after a cached first one) attends to a prefix missing one key and is
# RoPE-rotated one position early. The fix stores offset == len(key) (total_trim = output_count + S) and moves the
# trim-by-1 to the exact-match fetch path (_trim_cache_offset(cached_kv, 1)).
# Ported from MLX to torch: mlx_lm's KVCache / llama language model and causal mask written as torch ops, the batch
# generator trimmed to one request at a time (completion_batch_size=1, so batch.cache is the request's cache list).
import bisect
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- mlx_lm/models/base.py
def create_causal_mask(N: int, offset: int = 0, window_size: Optional[int] = None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds <= rinds + window_size)
    return mask


def create_attention_mask(h, cache=None, window_size=None):
    N = h.shape[1]
    if cache is not None and hasattr(cache, "make_mask"):
        return cache.make_mask(N, window_size=window_size)
    if N == 1:
        return None
    return create_causal_mask(N, window_size=window_size)


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask):
    # mx.fast.scaled_dot_product_attention with a boolean mask (True = attend)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)


# ---- mlx_lm/models/cache.py
class KVCache:
    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        prev = self.offset
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            v_head_dim = values.shape[3]
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            k_shape = (B, n_kv_heads, n_steps * self.step, k_head_dim)
            v_shape = (B, n_kv_heads, n_steps * self.step, v_head_dim)
            new_k = torch.zeros(k_shape, dtype=keys.dtype)
            new_v = torch.zeros(v_shape, dtype=values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v

        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def make_mask(self, N, window_size=None):
        if N == 1:
            return None
        return create_causal_mask(N, self.offset, window_size=window_size)


def make_prompt_cache(model):
    return [KVCache() for _ in range(len(model.layers))]


# ---- mlx_lm/models/llama.py (the language model)
@dataclass
class ModelArgs:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    vocab_size: int = 48
    rope_theta: float = 10000.0


def rope(x, offset, base):
    # nn.RoPE(head_dim, traditional=False, base=base)(x, offset=offset)
    L, D = x.shape[2], x.shape[3]
    half = D // 2
    inv = base ** (-torch.arange(0, half, dtype=torch.float32) / half)
    pos = torch.arange(offset, offset + L, dtype=torch.float32)
    theta = pos[:, None] * inv[None]
    cos, sin = theta.cos(), theta.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = dim // self.n_heads
        self.scale = self.head_dim**-0.5
        self.rope_theta = args.rope_theta
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)

        if cache is not None:
            queries = rope(queries, cache.offset, self.rope_theta)
            keys = rope(keys, cache.offset, self.rope_theta)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = rope(queries, 0, self.rope_theta)
            keys = rope(keys, 0, self.rope_theta)

        rep = self.n_heads // self.n_kv_heads
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = x + r
        r = self.mlp(self.post_attention_layernorm(h))
        return h + r


class LanguageModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.num_hidden_layers)])
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @torch.no_grad()
    def forward(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        return self.lm_head(self.norm(h))


# ---- vllm_mlx/memory_cache.py
def _trim_cache_offset(cache: List[Any], trim_by: int) -> List[Any]:
    trimmed = []
    for layer_cache in cache:
        if hasattr(layer_cache, "offset") and hasattr(layer_cache, "keys") and not isinstance(
            layer_cache.keys, (list, tuple)
        ):
            orig_cls = type(layer_cache)
            tc = orig_cls.__new__(orig_cls)
            tc.keys = layer_cache.keys
            tc.values = layer_cache.values
            tc.offset = max(layer_cache.offset - trim_by, 0)
            for attr in ("max_size", "keep", "step", "_idx"):
                if hasattr(layer_cache, attr):
                    setattr(tc, attr, getattr(layer_cache, attr))
            trimmed.append(tc)
        else:
            trimmed.append(layer_cache)
    return trimmed


class _CacheEntry:
    def __init__(self, tokens, cache):
        self.tokens = tokens
        self.cache = cache


class MemoryAwarePrefixCache:
    def __init__(self):
        self._entries: "OrderedDict[tuple, _CacheEntry]" = OrderedDict()
        self._sorted_keys: List[tuple] = []
        self._last_match_type = None

    def fetch(self, tokens: List[int]):
        if not tokens:
            self._last_match_type = "miss"
            return None, tokens
        tokens_key = tuple(tokens)

        # --- O(1) exact match ---
        if tokens_key in self._entries:
            entry = self._entries[tokens_key]
            self._entries.move_to_end(tokens_key)
            self._last_match_type = "exact"
            return entry.cache, []

        # --- prefix & supersequence match via sorted index ---
        best_match = None
        best_length = 0
        best_super = None
        sorted_keys = self._sorted_keys
        if sorted_keys:
            idx = bisect.bisect_left(sorted_keys, tokens_key)
            for i in range(idx - 1, -1, -1):
                cached_key = sorted_keys[i]
                cached_len = len(cached_key)
                if cached_len >= len(tokens_key):
                    continue
                if tokens_key[:cached_len] == cached_key:
                    if cached_len > best_length:
                        best_match = self._entries[cached_key]
                        best_length = cached_len
                    break
                if cached_key[0] != tokens_key[0]:
                    break
            for i in range(idx, len(sorted_keys)):
                cached_key = sorted_keys[i]
                cached_len = len(cached_key)
                if cached_len < len(tokens_key):
                    continue
                if cached_key[: len(tokens_key)] == tokens_key:
                    if best_super is None or cached_len > len(best_super.tokens):
                        best_super = self._entries[cached_key]
                else:
                    break

        # --- Supersequence match handling ---
        if best_super is not None:
            excess = len(best_super.tokens) - len(tokens)
            self._entries.move_to_end(best_super.tokens)
            self._last_match_type = "supersequence"
            if excess > 0:
                return _trim_cache_offset(best_super.cache, excess), []
            return best_super.cache, []

        # --- Prefix match ---
        if best_match is not None:
            self._entries.move_to_end(best_match.tokens)
            remaining = tokens[best_length:]
            self._last_match_type = "prefix"
            return best_match.cache, remaining

        # --- LCP (Longest Common Prefix) for divergent sequences ---
        best_lcp_entry = None
        best_lcp_length = 0
        if sorted_keys:
            idx = bisect.bisect_left(sorted_keys, tokens_key)
            for i in (idx - 1, idx):
                if i < 0 or i >= len(sorted_keys):
                    continue
                cached_key = sorted_keys[i]
                if cached_key == tokens_key:
                    continue
                min_len = min(len(cached_key), len(tokens_key))
                if min_len <= best_lcp_length:
                    continue
                lcp = 0
                for j in range(min_len):
                    if cached_key[j] != tokens_key[j]:
                        break
                    lcp = j + 1
                if lcp > best_lcp_length:
                    best_lcp_entry = self._entries[cached_key]
                    best_lcp_length = lcp

        if best_lcp_entry is not None and best_lcp_length > 0:
            excess = len(best_lcp_entry.tokens) - best_lcp_length
            trimmed_cache = _trim_cache_offset(best_lcp_entry.cache, excess)
            self._entries.move_to_end(best_lcp_entry.tokens)
            remaining = tokens[best_lcp_length:]
            self._last_match_type = "lcp"
            return trimmed_cache, remaining

        self._last_match_type = "miss"
        return None, tokens

    def store(self, tokens: List[int], cache: List[Any]) -> bool:
        tokens_key = tuple(tokens)
        if tokens_key in self._entries:
            self._entries.move_to_end(tokens_key)
            return False
        self._entries[tokens_key] = _CacheEntry(tokens_key, cache)
        bisect.insort(self._sorted_keys, tokens_key)
        return True


# ---- vllm_mlx/mllm_batch_generator.py (one request per batch)
class MLLMBatchRequest:
    def __init__(self, uid, request_id, input_ids, max_tokens):
        self.uid = uid
        self.request_id = request_id
        self.input_ids = input_ids  # [1, L]
        self.max_tokens = max_tokens
        self.output_tokens: List[int] = []
        self.num_tokens = 0


class MLLMBatch:
    def __init__(self, requests, y, cache):
        self.requests = requests
        self.uids = [r.uid for r in requests]
        self.request_ids = [r.request_id for r in requests]
        self.max_tokens = [r.max_tokens for r in requests]
        self.num_tokens = [0 for _ in requests]
        self.y = y
        self.cache = cache

    def extract_cache(self, idx: int):
        return self.cache


class MLLMBatchGenerator:
    def __init__(self, language_model, stop_tokens, prefill_step_size=2048):
        self.language_model = language_model
        self.stop_tokens = set(stop_tokens)
        self.prefill_step_size = prefill_step_size
        self.prefix_cache = MemoryAwarePrefixCache()
        self._think_suffix_len = 0  # GLM-4.6V: no <think> suffix in the generation prompt
        self.unprocessed_requests: List[MLLMBatchRequest] = []
        self.active_batch: Optional[MLLMBatch] = None
        self.sampler = lambda logprobs: torch.argmax(logprobs, dim=-1)
        self.last_match_types = []

    def insert(self, request):
        self.unprocessed_requests.append(request)

    @staticmethod
    def _copy_prefix_cache(cache_list):
        copies = []
        for c in cache_list:
            new_c = KVCache()
            new_c.step = c.step
            new_c.keys = c.keys
            new_c.values = c.values
            new_c.offset = c.offset
            copies.append(new_c)
        return copies

    def _process_prompts(self, requests):
        first_tokens = []
        per_request_caches = []
        for req in requests:
            cached_kv = None
            remaining_ids = None
            input_ids_list = req.input_ids.reshape(-1).tolist()
            S = self._think_suffix_len
            lookup_ids = input_ids_list[:-S] if S > 0 else input_ids_list
            cached_kv, remaining_ids = self.prefix_cache.fetch(lookup_ids)
            self.last_match_types.append(self.prefix_cache._last_match_type)
            if cached_kv is not None and S > 0:
                remaining_ids = list(remaining_ids) + input_ids_list[-S:]

            if cached_kv is not None and remaining_ids:
                # Prefix/LCP match — run language model on remaining tokens.
                request_cache = self._copy_prefix_cache(cached_kv)
                remaining = torch.tensor(remaining_ids)[None, :]
                logits = self.language_model(remaining, cache=request_cache)
                last_logits = logits[:, -1, :]
                logprobs = last_logits - torch.logsumexp(last_logits, dim=-1, keepdim=True)
                sampled = self.sampler(logprobs)
                first_tokens.append(sampled.item())
                per_request_caches.append(request_cache)

            elif cached_kv is not None and not remaining_ids:
                # Exact/supersequence match — re-run the last prompt token for its logits.
                if FIXED:
                    request_cache = _trim_cache_offset(cached_kv, 1)
                else:
                    request_cache = self._copy_prefix_cache(cached_kv)
                last_token = req.input_ids[:, -1:]
                logits = self.language_model(last_token, cache=request_cache)
                last_logits = logits[:, -1, :]
                logprobs = last_logits - torch.logsumexp(last_logits, dim=-1, keepdim=True)
                sampled = self.sampler(logprobs)
                first_tokens.append(sampled.item())
                per_request_caches.append(request_cache)

            else:
                # Cache miss — full forward pass
                request_cache = make_prompt_cache(self.language_model)
                logits = self.language_model(req.input_ids, cache=request_cache)
                last_logits = logits[:, -1, :]
                logprobs = last_logits - torch.logsumexp(last_logits, dim=-1, keepdim=True)
                sampled = self.sampler(logprobs)
                first_tokens.append(sampled.item())
                per_request_caches.append(request_cache)

        return MLLMBatch(requests, torch.tensor(first_tokens), per_request_caches[0])

    def _step(self, input_tokens, cache):
        if input_tokens.ndim == 1:
            input_tokens = input_tokens[:, None]
        logits = self.language_model(input_tokens, cache=cache)[:, -1, :]
        logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        return self.sampler(logprobs), list(logprobs)

    def next(self):
        batch = self.active_batch
        if batch is None:
            requests = self.unprocessed_requests[:1]
            if not requests:
                return []
            self.active_batch = batch = self._process_prompts(requests)
            self.unprocessed_requests = self.unprocessed_requests[1:]

        y = batch.y
        batch.y, _ = self._step(y[:, None], batch.cache)
        y = y.tolist()

        end_idx = []
        responses = []
        for i, (token, req) in enumerate(zip(y, batch.requests)):
            num_tok = batch.num_tokens[i] + 1
            batch.num_tokens[i] = num_tok
            req.num_tokens = num_tok
            req.output_tokens.append(token)
            finish_reason = None
            if token in self.stop_tokens:
                finish_reason = "stop"
                end_idx.append(i)
            elif num_tok >= batch.max_tokens[i]:
                finish_reason = "length"
                end_idx.append(i)
            responses.append((req.request_id, token, finish_reason))

        self._maybe_store_prefix_cache(batch, end_idx)
        if end_idx:
            self.active_batch = None
        return responses

    def _maybe_store_prefix_cache(self, batch, end_indices):
        if self.prefix_cache is None or not end_indices:
            return
        for i in end_indices:
            req = batch.requests[i]
            extracted = batch.extract_cache(i)
            input_ids_list = req.input_ids.reshape(-1).tolist()
            output_count = batch.num_tokens[i]
            S = self._think_suffix_len
            if FIXED:
                # Store prompt-only KV: stored offset equals key length exactly.
                total_trim = output_count + S
            else:
                # Store prompt-only KV (trim output tokens + 1 so next
                # fetch returns remaining=[last_prompt_token] at minimum).
                total_trim = output_count + 1 + S
            prompt_cache = _trim_cache_offset(extracted, total_trim)
            cache_key = input_ids_list[:-S] if S > 0 else input_ids_list
            self.prefix_cache.store(cache_key, prompt_cache)


# ---- a GLM-style chat served turn after turn
GMASK, SOP, SYSTEM, USER, ASSISTANT, OBS, EOS = 1, 2, 3, 4, 5, 6, 7


def apply_chat_template(messages, tools=None):
    ids = [GMASK, SOP]
    if tools:
        ids += [SYSTEM] + tools
    for m in messages:
        role = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "observation": OBS}[m["role"]]
        ids += [role] + m["content"]
    return ids + [ASSISTANT]


def main():
    args = ModelArgs()
    model = LanguageModel(args).eval()
    gen = MLLMBatchGenerator(model, stop_tokens=[EOS])

    tools = [20, 21, 22, 23]
    system = {"role": "system", "content": [30, 31, 32]}
    turn1 = [{"role": "user", "content": [11, 12, 13, 14]}]
    conversations = [
        ("plain", apply_chat_template(turn1)),
        ("system+tools", apply_chat_template([system] + turn1, tools=tools)),
    ]
    outputs = {}
    for uid, (name, ids) in enumerate(conversations):
        gen.insert(MLLMBatchRequest(uid, name, torch.tensor([ids]), max_tokens=6))
        while True:
            resp = gen.next()
            for rid, tok, fin in resp:
                outputs.setdefault(rid, []).append(tok)
            if gen.active_batch is None and not gen.unprocessed_requests:
                break

    # second turn of the system+tools conversation: the first prompt is now a cached prefix
    prev = conversations[1][1]
    turn2 = prev + outputs["system+tools"] + [USER, 15, 16, 17]
    turn2 = turn2 + [ASSISTANT]
    gen.insert(MLLMBatchRequest(2, "turn2", torch.tensor([turn2]), max_tokens=6))
    while True:
        for rid, tok, fin in gen.next():
            outputs.setdefault(rid, []).append(tok)
        if gen.active_batch is None and not gen.unprocessed_requests:
            break

    print("prefix-cache matches:", gen.last_match_types)
    for rid, toks in outputs.items():
        print(f"{rid:>13}: {toks}")


if __name__ == "__main__":
    main()
