# Correct program (quiet batch quiet-r68a).
#
# Ported from AI-Hypercomputer/jetstream-pytorch @c8bb6119a388d66bc8936d7c03cb49e4be01f407
# ("Add deepseek distils as options (#208)"):
#   jetstream_pt/engine.py (DecodeState, Prefix, init_decode_state, _call_model_prefill, prefill,
#     _insert_no_wrap, _insert_wrap, insert, generate_impl with ring_buffer=True)
#   jetstream_pt/cache_manager.py (KVCachePrefill, KVCacheGenerate.update on the ring buffer)
#   jetstream_pt/layers.py (Attention, AttentionKernel non-lazy dense path, apply_rotary_emb, RMSNorm)
#   jetstream_pt/attention_kernel.py (dense_attention, _dense_attention, reshape_heads, reshape_outputs)
#   jetstream_pt/third_party/llama/model_exportable.py (Transformer, TransformerBlock, FeedForward,
#     precompute_freqs_cis), jetstream_pt/environment.py (JetEngineEnvironmentData defaults)
# JAX arrays and jax.lax calls are written as the torch ops they stand for; sharding is dropped.
#
# A generation server with a fixed number of decode slots sharing one ring-buffer KV cache. Each request
# is prefilled alone, right-padded to a bucket length, under a triu(-inf) causal mask; `insert` copies
# its padded K/V into its slot so that the real tokens end just before the shared write pointer
# `current_position`, and sets that slot's row of the (batch, cache_len) additive mask to 0 on
# [current_position - true_length, current_position) and -inf elsewhere (the pad keys that were copied
# past the pointer stay hidden until a decode step overwrites them). Every generate step unmasks the
# pointer's column for all slots, writes the new K/V there, and advances the pointer (wrapping). Requests
# arrive while others decode, finish at different lengths, and new ones reuse freed slots; inserts that
# straddle the end of the ring take the _insert_wrap path. Each slot's RoPE position is its own input_pos.
#
# Self-check: every request is rerun alone (prompt + generated tokens, no padding) through the same
# weights with plain causal SDPA (is_causal=True) and no mask tensor; the logits every token was sampled
# from and the greedy tokens must match.
import math
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F

torch.manual_seed(0)


# ---------------------------------------------------------------------------------------------
# environment.py / model_args.py
@dataclass
class JetEngineEnvironmentData:
    batch_size: int = 4
    cache_sequence_length: int = 32
    max_input_sequence_length: int = 16
    ring_buffer: bool = True
    starting_position: int = 0
    lazy_cache_update: bool = False
    flash_attention: bool = False
    ragged_mha: bool = False
    n_reps: int = 0


class JetEngineEnvironment:
    def __init__(self, data: JetEngineEnvironmentData):
        self._data = data
        self.batch_size = data.batch_size
        self.cache_len = data.cache_sequence_length
        self.cache_sequence_length = data.cache_sequence_length
        self.starting_position = data.starting_position
        self.ring_buffer = data.ring_buffer
        # ring_buffer=True: lazy_cache_update, ragged_mha, flash_attention all False
        self.lazy_cache_update = False
        self.ragged_mha = False
        self.flash_attention = False
        self.page_attention = False
        self.n_reps = data.n_reps


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = 2
    vocab_size: int = 97
    multiple_of: int = 16
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    max_seq_len: int = 32
    rope_theta: float = 10000.0


# ---------------------------------------------------------------------------------------------
# cache_manager.py
class KVCachePrefill:
    def __init__(self, kv_quantize=False, stacked=False):
        self.kv_quantize = kv_quantize
        self.cache_k = None
        self.cache_v = None
        self.stacked = stacked

    def update(self, key, value, layer_id):
        self.cache_k = key
        self.cache_v = value
        return key, value

    def state(self):
        return self.cache_k, self.cache_v

    def finalize(self):
        return


class KVCacheGenerate:
    def __init__(self, cache_k, cache_v, position, sharding=None, env=None):
        self.cache_k = cache_k
        self.cache_v = cache_v
        self.input_pos = position
        self.env = env
        self.stacked = False

    def update(self, key, value, layer_id: int):
        # ring buffer, non lazy: every slot writes its new key at the shared pointer
        self.cache_k[..., self.input_pos, :] = key
        self.cache_v[..., self.input_pos, :] = value
        return self.cache_k, self.cache_v

    def state(self):
        return self.cache_k, self.cache_v

    def finalize(self):
        return


# ---------------------------------------------------------------------------------------------
# attention_kernel.py
def reshape_heads(xq, keys):
    bq, hq, tq, dq = xq.shape
    hkv = keys.shape[-3]
    rep = hq // hkv
    if rep > 1:
        xq = xq.reshape(bq, hkv, rep, tq, dq).reshape(bq, hkv, rep * tq, dq)
    return xq, rep


def reshape_outputs(rep, o, m=None, d=None):
    bq, hqo, tqo, dq = o.shape
    tq = tqo // rep
    hq = hqo * rep
    o = o.reshape(bq, hqo, rep, tq, dq).reshape(bq, hq, tq, dq)
    return o, (m, d)


def _dense_attention(xq, keys, values, k_scaler=None, v_scaler=None, mask=None):
    bsz, _, _, head_dim = xq.shape
    scores = torch.einsum("ikjl,ikml->ikjm", xq, keys) / math.sqrt(head_dim)
    if mask is not None:
        scores = scores + mask  # (bs, n_local_heads, seqlen, max_seqlen)
    scores = F.softmax(scores.float(), dim=-1).type_as(xq)
    output = torch.einsum("ikjm,ikml->ikjl", scores, values)
    return output


def dense_attention(xq, keys, values, k_scaler=None, v_scaler=None, mask=None):
    xq, rep = reshape_heads(xq, keys)
    output = _dense_attention(xq, keys, values, k_scaler, v_scaler, mask)
    output, _ = reshape_outputs(rep, output)
    return output


# ---------------------------------------------------------------------------------------------
# layers.py
class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    assert freqs_cis.shape == (x.shape[0], x.shape[-3], x.shape[-1]), (freqs_cis.shape, x.shape)
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    shape[0] = x.shape[0]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class AttentionKernel:
    def __init__(self, env, layer_id):
        self.env = env
        self.dense_attention = dense_attention
        self.layer_id = layer_id

    def __call__(self, xq, xk, xv, mask, cache, start=None, end=None, ragged_batch_index=None,
                 ragged_block_index=None):
        bsz, num_heads, seqlen, head_dim = xq.shape
        num_kv_heads = xk.shape[-3]
        n_rep = num_heads // num_kv_heads

        def attend(xq, keys, values, local_mask=None):
            true_len = seqlen
            if not (self.env.ragged_mha and n_rep > 1) and seqlen == 1 and not self.env.page_attention:
                true_len = 2
                xq = torch.nn.functional.pad(xq, (0, 0, 0, true_len - seqlen), "constant", 0)
            local_output = self.dense_attention(xq=xq, keys=keys, values=values, k_scaler=None, v_scaler=None,
                                                mask=local_mask)
            local_output = local_output.reshape(bsz, num_heads, true_len, head_dim)
            if true_len != seqlen:
                local_output = local_output[:, :, 0:seqlen, :]
            return local_output, (None, None)

        orig_keys, orig_values = cache.update(xk, xv, self.layer_id)
        existing_output, _ = attend(xq=xq, keys=orig_keys, values=orig_values, local_mask=mask)
        # not lazy: the existing output already contains everything
        return existing_output


class Attention(torch.nn.Module):
    def __init__(self, n_heads, n_kv_heads, head_dim, hidden_size, env, layer_id):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.n_rep = self.n_heads // self.n_kv_heads
        self.env = env
        self.layer_id = layer_id
        self.wo = torch.nn.Linear(n_heads * head_dim, hidden_size, bias=False)
        self.attention_kernel = AttentionKernel(env, layer_id)
        self.wq = torch.nn.Linear(hidden_size, n_heads * head_dim, bias=False)
        self.wk = torch.nn.Linear(hidden_size, n_kv_heads * head_dim, bias=False)
        self.wv = torch.nn.Linear(hidden_size, n_kv_heads * head_dim, bias=False)

    def forward(self, x, freqs_cis, mask, cache, start=None, end=None, ragged_batch_index=None,
                ragged_block_index=None):
        bsz, seqlen = x.shape[0], x.shape[-2]
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        xk = xk.transpose(1, 2)
        xv = xv.transpose(1, 2)
        xq = xq.transpose(1, 2)
        if mask.ndim == 2:
            if seqlen == 1:
                mask = mask[:, None, None, :]
            else:
                mask = mask[None, None, :, :]
        output = self.attention_kernel(xq=xq, xk=xk, xv=xv, mask=mask, cache=cache, start=start, end=end,
                                       ragged_batch_index=ragged_batch_index,
                                       ragged_block_index=ragged_block_index).type_as(xq)
        output = output.transpose(-3, -2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


# ---------------------------------------------------------------------------------------------
# third_party/llama/model_exportable.py
class FeedForward(torch.nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of, ffn_dim_multiplier, env=None):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = torch.nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = torch.nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(torch.nn.Module):
    def __init__(self, layer_id, args, env):
        super().__init__()
        self.attention = Attention(args.n_heads, args.n_kv_heads or args.n_heads, args.dim // args.n_heads,
                                   args.dim, env=env, layer_id=layer_id)
        self.feed_forward = FeedForward(dim=args.dim, hidden_dim=4 * args.dim, multiple_of=args.multiple_of,
                                        ffn_dim_multiplier=args.ffn_dim_multiplier, env=env)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis, mask, cache, start=None, end=None, ragged_batch_index=None,
                ragged_block_index=None):
        attn = self.attention.forward(self.attention_norm(x), freqs_cis, mask, cache, start, end,
                                      ragged_batch_index, ragged_block_index)
        h = x + attn
        ffns = self.ffn_norm(h)
        return h + self.feed_forward.forward(ffns)


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


class Transformer(torch.nn.Module):
    def __init__(self, params, env):
        super().__init__()
        self.env = env
        self.params = params
        self.tok_embeddings = torch.nn.Embedding(params.vocab_size, params.dim)
        self.layers = torch.nn.ModuleList([TransformerBlock(i, params, env) for i in range(params.n_layers)])
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = torch.nn.Linear(params.dim, params.vocab_size, bias=False)
        freqs_cis = precompute_freqs_cis(params.dim // params.n_heads, params.max_seq_len * 2, theta=params.rope_theta)
        self.register_buffer("freqs_cis", freqs_cis)

    @torch.no_grad()
    def forward(self, tokens, input_pos, caches, mask, start=None, ragged_batch_index=None, ragged_block_index=None):
        h = self.tok_embeddings(tokens)
        bsz, seqlen = tokens.shape
        freqs_cis = self.freqs_cis[input_pos]
        freqs_cis = freqs_cis.reshape(bsz, seqlen, -1)
        end = None if start is None else (start + input_pos) % self.env.cache_len
        for layer_id, layer in enumerate(self.layers):
            h = layer(h, freqs_cis, mask, caches[layer_id], start, end, ragged_batch_index, ragged_block_index)
        h = self.norm(h)
        return self.output(h).float()


# ---------------------------------------------------------------------------------------------
# engine.py
@dataclass
class Prefix:
    token: torch.Tensor  # [1, 1]
    caches: List
    seq_len: int  # true seqlen front pad


@dataclass
class DecodeState:
    tokens: torch.Tensor  # [batch_size, 1]
    caches: List
    cache_scales: List
    current_position: int
    lens: torch.Tensor  # [batch_size, 1]
    start: torch.Tensor  # [batch_size]
    input_pos: torch.Tensor  # [batch_size]
    mask: torch.Tensor  # [batch_size, seqlen] -inf for invalid; 0 for valid


class PyTorchEngine:
    def __init__(self, pt_model, env):
        self.pt_model = pt_model
        self.env = env
        self.default_dtype = torch.float32

    def init_decode_state(self):
        shape = (self.env.batch_size, self.pt_model.params.n_kv_heads, self.env.cache_sequence_length,
                 self.pt_model.params.dim // self.pt_model.params.n_heads)
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in self.pt_model.layers]
        return DecodeState(
            torch.zeros((self.env.batch_size, 1), dtype=torch.long),
            caches,
            [],
            self.env.starting_position,
            torch.zeros((self.env.batch_size, 1), dtype=torch.long),
            torch.zeros((self.env.batch_size,), dtype=torch.long),
            torch.zeros((self.env.batch_size,), dtype=torch.long),
            torch.full((self.env.batch_size, self.env.cache_sequence_length), float("-inf"),
                       dtype=self.default_dtype),
        )

    def _call_model_generate(self, tokens, input_indexes, caches, mask, start, input_pos):
        caches_obj = [KVCacheGenerate(k, v, input_indexes, env=self.env) for k, v in caches]
        mask = mask[:, None, None, :]
        res = self.pt_model(tokens, input_pos, caches_obj, mask, start)
        updated_caches = []
        for c in caches_obj:
            c.finalize()
            updated_caches.append(c.state())
        return res, updated_caches

    def _call_model_prefill(self, tokens, input_indexes):
        caches = [KVCachePrefill() for _ in self.pt_model.layers]
        mask = torch.full((1, self.env.n_reps, tokens.shape[1], tokens.shape[1]), float("-inf"),
                          dtype=self.default_dtype)
        mask = torch.triu(mask, diagonal=1)
        mask = mask.reshape(1, 1, -1, tokens.shape[1])
        start = torch.zeros((tokens.shape[0],), dtype=torch.long)
        res = self.pt_model(tokens, input_indexes, caches, mask, start)[0]
        caches_res = [c.state() for c in caches]
        return res, caches_res

    def prefill(self, padded_tokens, true_length):
        batched_token = padded_tokens.reshape(1, -1)
        seq_len = padded_tokens.shape[0]
        input_indexes = torch.arange(0, seq_len)
        logits, updated_caches = self._call_model_prefill(batched_token, input_indexes)
        token = torch.argmax(logits[true_length - 1], dim=-1)  # greedy sampling
        token_out = token.reshape(1, 1)
        return Prefix(token_out, updated_caches, true_length), logits[true_length - 1]

    def _insert_no_wrap(self, prefix, decode_state, slot):
        if self.env.ring_buffer:
            current_pos = decode_state.current_position
        else:
            current_pos = prefix.seq_len
        pos = current_pos - prefix.seq_len
        tokens = decode_state.tokens.clone()
        tokens[slot] = prefix.token
        x = torch.arange(0, self.env.cache_sequence_length)
        cond = torch.logical_and(x < current_pos, x >= pos)
        mask_insert = torch.where(cond, 0.0, float("-inf"))
        mask = decode_state.mask.clone()
        mask[slot] = mask_insert
        start = decode_state.start.clone()
        start[slot] = pos % self.env.cache_sequence_length
        input_pos = decode_state.input_pos.clone()
        input_pos[slot] = prefix.seq_len
        caches = []
        for (k, v), (newk, newv) in zip(decode_state.caches, prefix.caches):
            # jax.lax.dynamic_update_slice(cache, new_entry, [slot, 0, pos, 0])
            k = k.clone()
            v = v.clone()
            k[slot:slot + 1, :, pos:pos + newk.shape[2], :] = newk
            v[slot:slot + 1, :, pos:pos + newv.shape[2], :] = newv
            caches.append((k, v))
        lens = decode_state.lens.clone()
        lens[slot] = 1
        return DecodeState(tokens, caches, [], decode_state.current_position, lens, start, input_pos, mask)

    def _insert_wrap(self, prefix, decode_state, slot):
        start_insert = decode_state.current_position - prefix.seq_len
        tokens = decode_state.tokens.clone()
        tokens[slot] = prefix.token
        start_insert = start_insert % self.env.cache_sequence_length
        update_indexes = (torch.arange(0, prefix.caches[0][0].shape[2]) + start_insert) % \
            self.env.cache_sequence_length
        x = torch.arange(0, self.env.cache_sequence_length)
        # jax.lax.cond(current_position > start_insert, ...)
        if decode_state.current_position > start_insert:
            cond = torch.logical_and(x >= start_insert, x < decode_state.current_position)
        else:
            cond = torch.logical_or(x >= start_insert, x < decode_state.current_position)
        mask_insert = torch.where(cond, 0.0, float("-inf"))
        mask = decode_state.mask.clone()
        mask[slot] = mask_insert
        start = decode_state.start.clone()
        start[slot] = start_insert
        input_pos = decode_state.input_pos.clone()
        input_pos[slot] = prefix.seq_len
        caches = []
        for (k, v), (newk, newv) in zip(decode_state.caches, prefix.caches):
            k = k.clone()
            v = v.clone()
            # cache.at[slot, :, update_indexes, :].set(transpose(new_entry.squeeze(0), (1, 0, 2)))
            k[slot][:, update_indexes, :] = newk.squeeze(0)
            v[slot][:, update_indexes, :] = newv.squeeze(0)
            caches.append((k, v))
        lens = decode_state.lens.clone()
        lens[slot] = 1
        return DecodeState(tokens, caches, [], decode_state.current_position, lens, start, input_pos, mask)

    def insert(self, prefix, decode_state, slot):
        if self.env.ring_buffer:
            start_insert = decode_state.current_position - prefix.seq_len
            end_insert = start_insert + prefix.caches[0][0].shape[2]  # padded seqlen
            if start_insert >= 0 and end_insert < self.env.cache_sequence_length:
                return self._insert_no_wrap(prefix, decode_state, slot), "no_wrap"
            return self._insert_wrap(prefix, decode_state, slot), "wrap"
        return self._insert_no_wrap(prefix, decode_state, slot), "no_wrap"

    def generate_impl(self, decode_state):
        pos = decode_state.current_position
        if self.env.ring_buffer:
            input_indexes = torch.full((1,), pos)
        else:
            input_indexes = decode_state.input_pos

        def update_mask():
            if self.env.ring_buffer:
                m = decode_state.mask.clone()
                m[:, decode_state.current_position] = 0
                return m
            batch = torch.arange(self.env.batch_size)
            m = decode_state.mask.clone()
            m[batch, decode_state.input_pos] = 0
            return m

        mask = decode_state.mask
        if not self.env.lazy_cache_update:
            mask = update_mask()
        logits, new_caches = self._call_model_generate(
            decode_state.tokens, input_indexes, decode_state.caches, mask, decode_state.start,
            decode_state.input_pos,
        )
        next_token = torch.argmax(logits[:, -1], dim=-1).reshape(self.env.batch_size, -1)
        if self.env.ring_buffer:
            input_pos = decode_state.input_pos + 1
            lens = decode_state.lens + 1
        new_decode_state = DecodeState(
            next_token, new_caches, [],
            (decode_state.current_position + 1) % self.env.cache_sequence_length,
            lens, decode_state.start, input_pos, mask,
        )
        return new_decode_state, logits[:, -1]


# JetStream token_utils.pad_tokens: pad on the right to the smallest prefill bucket that fits
def pad_tokens(tokens, pad_id, prefill_lengths):
    true_length = len(tokens)
    padded_length = next(b for b in prefill_lengths if b >= true_length)
    padding = padded_length - true_length
    padded = torch.tensor(tokens + [pad_id] * padding, dtype=torch.long)
    return padded, true_length


# ---------------------------------------------------------------------------------------------
def reference_logits(model, ids):
    """The same weights, one request alone, plain causal SDPA, no padding, no mask tensor."""
    tokens = torch.tensor([ids])
    T = tokens.shape[1]
    h = model.tok_embeddings(tokens)
    freqs = model.freqs_cis[torch.arange(T)].reshape(1, T, -1)
    for layer in model.layers:
        att = layer.attention
        x = layer.attention_norm(h)
        xq = att.wq(x).view(1, T, att.n_heads, att.head_dim)
        xk = att.wk(x).view(1, T, att.n_kv_heads, att.head_dim)
        xv = att.wv(x).view(1, T, att.n_kv_heads, att.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs)
        q = xq.transpose(1, 2)
        k = xk.transpose(1, 2).repeat_interleave(att.n_rep, dim=1)
        v = xv.transpose(1, 2).repeat_interleave(att.n_rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + att.wo(o.transpose(1, 2).reshape(1, T, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h)).float()[0]


@dataclass
class Request:
    rid: int
    arrival: int
    prompt: list
    max_tokens: int
    generated: list = field(default_factory=list)
    logits: list = field(default_factory=list)


def main():
    args = ModelArgs()
    env = JetEngineEnvironment(JetEngineEnvironmentData(n_reps=args.n_heads // args.n_kv_heads))
    model = Transformer(args, env).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.25)
    engine = PyTorchEngine(model, env)
    pad_id = 0
    prefill_lengths = [8, 16]

    g = torch.Generator().manual_seed(3)
    plan = [(0, 5, 6), (0, 9, 4), (1, 3, 8), (3, 12, 5), (5, 7, 7), (7, 4, 9), (9, 11, 4), (12, 6, 6),
            (14, 8, 5), (17, 2, 7), (20, 10, 5), (24, 5, 6), (29, 13, 6), (33, 4, 8), (36, 9, 7), (40, 6, 5)]
    pending = []
    for n, (arr, plen, mt) in enumerate(plan):
        pending.append(Request(n, arr, torch.randint(1, args.vocab_size, (plen,), generator=g).tolist(), mt))
    all_requests = list(pending)

    decode_state = engine.init_decode_state()
    slots = [None] * env.batch_size
    insert_kinds = set()
    wrapped_pointer = False
    step = 0
    with torch.no_grad():
        while step < 200:
            # prefill + insert arrived requests into free slots
            for slot in range(env.batch_size):
                if slots[slot] is None and pending and pending[0].arrival <= step:
                    req = pending.pop(0)
                    padded, true_length = pad_tokens(req.prompt, pad_id, prefill_lengths)
                    prefix, first_logits = engine.prefill(padded, true_length)
                    decode_state, kind = engine.insert(prefix, decode_state, slot)
                    insert_kinds.add(kind)
                    req.generated.append(int(prefix.token))
                    req.logits.append(first_logits)
                    slots[slot] = req
                    if len(req.generated) >= req.max_tokens:
                        slots[slot] = None
            if all(s is None for s in slots):
                if not pending:
                    break
                step += 1
                continue
            prev_position = decode_state.current_position
            decode_state, step_logits = engine.generate_impl(decode_state)
            if decode_state.current_position < prev_position:
                wrapped_pointer = True
            for slot, req in enumerate(slots):
                if req is None:
                    continue
                req.generated.append(int(decode_state.tokens[slot, 0]))
                req.logits.append(step_logits[slot])
                if len(req.generated) >= req.max_tokens:
                    slots[slot] = None  # slot freed; its mask row is reset by the next insert
            step += 1

    assert not pending and all(s is None for s in slots)
    assert insert_kinds == {"no_wrap", "wrap"}, insert_kinds
    assert wrapped_pointer

    worst = 0.0
    for req in all_requests:
        full = req.prompt + req.generated
        assert len(full) < env.cache_len
        ref = reference_logits(model, full)
        for k, got in enumerate(req.logits):
            want = ref[len(req.prompt) - 1 + k]
            worst = max(worst, (got - want).abs().max().item())
            assert int(want.argmax()) == req.generated[k], (req.rid, k)
    assert worst < 1e-4, worst
    print(f"{len(all_requests)} requests through {env.batch_size} slots, ring of {env.cache_len}: "
          f"max |logit diff| vs per-request causal run = {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
