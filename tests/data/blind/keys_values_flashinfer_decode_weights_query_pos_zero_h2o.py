# awslabs/keys_values commit fe5e87c ("Fix FlashInfer attention weights for q_len=1 (#96)"),
# keys_values/attention/flashinfer_ops.py sdpa_decode, called from
# FlashInferSDPA._flashinfer_sdpa_chunk_processing (flashinfer_wrapper.py) while an H2O KV cache
# (keys_values/kvcache/h2o.py, attn_weights.py) decodes one token at a time.
#
# Bug: H2O needs the attention weights of every decode step, so sdpa_decode is called with
# return_weights=True, which the extension routes to the tiled kernel (sdpa_decode.cu). That kernel
# takes the query position from `input_pos`, defaulting to 0 when it is not given; sdpa_decode
# passed token_positions=None, input_pos=None and causal=True, so only KV entry 0 was kept: the
# output of every decode step was slot 0's value and the H2O scores were one-hot on slot 0.
# Fix: pass causal=not return_weights (the single query is the last position and sees the whole
# cache; the native FlashInfer decode kernel, used without weights, already treats it that way).
#
# The CUDA extension is ported to torch below so the program runs on CPU.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------------------
# keys_values/csrc/kernels/sdpa_decode.cu, ported to torch (CPU)
# ---------------------------------------------------------------------------
def _tiled_sdpa_decode(q, k, v, scale, token_positions, input_pos, sliding_window_size,
                       causal, return_weights):
    # q: [B, num_qo_heads, D]; k, v: [B, kv_len, num_kv_heads, D]
    batch_size, num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_qo_heads // num_kv_heads
    query_pos = (input_pos.to(torch.int64) if input_pos is not None
                 else torch.zeros(batch_size, dtype=torch.int64))
    kv_idx = torch.arange(kv_len)
    valid = torch.ones(batch_size, num_qo_heads, kv_len, dtype=torch.bool)
    if causal:
        if token_positions is not None:
            key_pos = token_positions.to(torch.int64)  # [B, num_kv_heads, kv_len]
            key_pos = key_pos.repeat_interleave(group, dim=1)
        else:
            key_pos = kv_idx.view(1, 1, kv_len)
        valid = valid & (key_pos <= query_pos.view(-1, 1, 1))
        if sliding_window_size > 0:
            valid = valid & (query_pos.view(-1, 1, 1) - key_pos < sliding_window_size)
    k_h = k.repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # [B, Hq, N, D]
    v_h = v.repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    scores = torch.einsum("bhd,bhnd->bhn", q.float(), k_h.float()) * scale
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhn,bhnd->bhd", probs, v_h.float()).to(q.dtype)
    weights = None
    if return_weights:
        weights = probs.view(batch_size, num_kv_heads, group, kv_len).sum(dim=2)
    return out, weights


def _native_flashinfer_decode(q, k, v, scale, sliding_window_size):
    # SingleDecodeWithKVCache: the query is the last position, it sees the whole cache
    out, _ = _tiled_sdpa_decode(q, k, v, scale, None, None, sliding_window_size, False, False)
    return out


class _ops:  # stands for keys_values._flashinfer_ops (bindings.cpp)
    @staticmethod
    def sdpa_decode(q, k, v, scale, token_positions, input_pos, sliding_window_size, causal,
                    return_weights):
        if causal and token_positions is None and input_pos is None and not return_weights:
            return _native_flashinfer_decode(q, k, v, scale, sliding_window_size), None
        return _tiled_sdpa_decode(q, k, v, scale, token_positions, input_pos,
                                  sliding_window_size, causal, return_weights)


# ---------------------------------------------------------------------------
# keys_values/attention/flashinfer_ops.py
# ---------------------------------------------------------------------------
def sdpa_decode(query, key, value, scale, return_weights=False):
    attn_outputs, attn_weights = _ops.sdpa_decode(
        query,
        key,
        value,
        scale,
        None,  # token_positions
        None,  # input_pos
        -1,  # sliding_window_size
        (not return_weights) if FIXED else True,  # causal
        return_weights,
    )
    if return_weights:
        attn_weights = attn_weights.to(dtype=torch.float32)
        q_per_kv = query.shape[-2] // key.shape[-2]
        if q_per_kv > 1:
            attn_weights /= q_per_kv
    return attn_outputs, attn_weights


# ---------------------------------------------------------------------------
# keys_values/attention/flashinfer_wrapper.py (decode branch of FlashInferSDPA)
# ---------------------------------------------------------------------------
class FlashInferSDPA:
    def scaled_dot_product_attention(self, query, key, value, scale_factor, input_pos,
                                     token_positions, return_attn_weights=False):
        if input_pos <= 0:
            raise ValueError("input_pos must be positive. Don't use for square prefill")
        q_len = query.shape[2]
        if scale_factor is None:
            scale_factor = 1.0 / math.sqrt(query.shape[-1])
        assert q_len == 1
        # If `q_len == 1`, we don't need `token_positions, input_pos`,
        # since standard causal masking applies
        return self._flashinfer_sdpa_chunk_processing(
            query, key, value, scale_factor, return_attn_weights)

    def _flashinfer_sdpa_chunk_processing(self, query, key, value, scale_factor,
                                          return_attn_weights):
        query = query.squeeze(2).contiguous()
        key_transformed = key.transpose(1, 2).contiguous()
        value_transformed = value.transpose(1, 2).contiguous()
        output_token, attn_weights = sdpa_decode(
            query=query,
            key=key_transformed,
            value=value_transformed,
            scale=scale_factor,
            return_weights=return_attn_weights,
        )
        attn_outputs = output_token.unsqueeze(1)  # (B, 1, n_head, head_size)
        return attn_outputs, attn_weights


# ---------------------------------------------------------------------------
# keys_values/kvcache/h2o.py + attn_weights.py (grace_period=0, max_chunk_size=None)
# ---------------------------------------------------------------------------
class H2OKVCache:
    def __init__(self, batch_size, n_query_groups, head_size, cache_length,
                 keep_initial_fraction=0.0):
        self.batch_size = batch_size
        self.n_query_groups = n_query_groups
        self.cache_length = cache_length
        self._keep_initial_fraction = keep_initial_fraction
        shape = (batch_size, n_query_groups, cache_length, head_size)
        self.k = torch.zeros(shape)
        self.v = torch.zeros(shape)
        self.token_pos = torch.zeros(batch_size, n_query_groups, cache_length, dtype=torch.int64)
        self.scores = torch.zeros(batch_size, n_query_groups, cache_length)
        self.current_length = 0
        self.input_pos = 0
        self._next_positions = None
        self._use_initial_rule = None

    def next_positions(self, num):
        return None if self._next_positions is None else self._next_positions[:, :, :num]

    def prefill(self, key, value):
        num = key.shape[2]
        self.k[:, :, :num] = key
        self.v[:, :, :num] = value
        self.token_pos[:, :, :num] = torch.arange(num)
        self.scores.zero_()
        self.current_length = num
        self.input_pos = num
        self._use_initial_rule = num >= self.cache_length
        self._set_next_positions_to_free_slots()

    def _set_next_positions_to_free_slots(self):
        if self.current_length < self.cache_length:
            self._next_positions = torch.arange(
                self.current_length, self.cache_length
            ).view(1, 1, -1).expand(self.batch_size, self.n_query_groups, -1)

    def forward(self, key, value):
        num = key.shape[2]
        if self._use_initial_rule:
            num_keep = min(int(self._keep_initial_fraction * self.cache_length),
                           self.cache_length - num)
            self._next_positions = torch.arange(num_keep, num_keep + num).view(
                1, 1, -1).expand(self.batch_size, self.n_query_groups, -1)
            self._use_initial_rule = False
        index = self.next_positions(num)
        idx4 = index.unsqueeze(-1).expand(-1, -1, -1, key.shape[-1])
        self.k.scatter_(2, idx4, key)
        self.v.scatter_(2, idx4, value)
        self.token_pos.scatter_(-1, index, torch.arange(
            self.input_pos, self.input_pos + num).view(1, 1, -1).expand_as(index))
        self.scores.scatter_(-1, index, 0.0)
        self.current_length = min(self.current_length + num, self.cache_length)
        self.input_pos += num
        self._next_positions = None
        n = self.current_length
        return self.k[:, :, :n], self.v[:, :, :n]

    def token_positions(self):
        return self.token_pos[:, :, : self.current_length]

    def update(self, attn_weights, query_length):
        attn_weights = attn_weights.detach().to(dtype=torch.float32)
        scores = self._compute_scores(attn_weights, query_length)
        if self.current_length < self.cache_length:
            self._set_next_positions_to_free_slots()
        elif scores is not None:
            self._next_positions = scores.argsort(dim=-1)

    def _compute_scores(self, attn_weights, query_length):
        self.scores[:, :, : self.current_length] += attn_weights
        if self.current_length == self.cache_length:
            return self.scores[:, :, : self.cache_length]
        return None


# ---------------------------------------------------------------------------
# A small litgpt-style model (keys_values builds on litgpt)
# ---------------------------------------------------------------------------
class Config:
    vocab_size = 64
    n_embd = 64
    n_head = 4
    n_query_groups = 2
    head_size = 16
    n_layer = 2
    rope_base = 10000


def rope_cache(T, head_size, base):
    theta = 1.0 / (base ** (torch.arange(0, head_size, 2).float() / head_size))
    idx_theta = torch.outer(torch.arange(T).float(), theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x, cos, sin):
    head_size = x.size(-1)
    x1, x2 = x[..., : head_size // 2], x[..., head_size // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        c = config
        self.qkv = nn.Linear(c.n_embd, (c.n_head + 2 * c.n_query_groups) * c.head_size)
        self.proj = nn.Linear(c.n_head * c.head_size, c.n_embd)
        self.kv_cache = None
        self.sdpa = FlashInferSDPA()

    def forward(self, x, cos, sin, input_pos):
        c = self.config
        B, T, _ = x.shape
        qkv = self.qkv(x)
        q, k, v = qkv.split(
            [c.n_head * c.head_size, c.n_query_groups * c.head_size,
             c.n_query_groups * c.head_size], dim=-1)
        q = q.view(B, T, c.n_head, c.head_size).transpose(1, 2)
        k = k.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)
        v = v.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if input_pos == 0:
            self.kv_cache.prefill(k, v)
            q_per_kv = c.n_head // c.n_query_groups
            y = F.scaled_dot_product_attention(
                q, k.repeat_interleave(q_per_kv, 1), v.repeat_interleave(q_per_kv, 1),
                is_causal=True)
            y = y.transpose(1, 2).reshape(B, T, -1)
        else:
            keys, values = self.kv_cache.forward(k, v)
            y, attn_weights = self.sdpa.scaled_dot_product_attention(
                q, keys, values, None, input_pos, self.kv_cache.token_positions(),
                return_attn_weights=True)
            y = y.reshape(B, T, -1)
            self.kv_cache.update(attn_weights=attn_weights, query_length=T)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x, cos, sin, input_pos):
        x = x + self.attn(self.norm_1(x), cos, sin, input_pos)
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.cos, self.sin = rope_cache(256, config.head_size, config.rope_base)

    def assign_kv_caches(self, batch_size, cache_length):
        for block in self.h:
            block.attn.kv_cache = H2OKVCache(
                batch_size, self.config.n_query_groups, self.config.head_size, cache_length)

    def forward(self, idx, input_pos):
        T = idx.shape[1]
        cos = self.cos[input_pos: input_pos + T]
        sin = self.sin[input_pos: input_pos + T]
        x = self.wte(idx)
        for block in self.h:
            x = block(x, cos, sin, input_pos)
        return self.lm_head(self.ln_f(x))


def generate(model, prompt, max_new_tokens, cache_length):
    model.assign_kv_caches(prompt.shape[0], cache_length)
    logits = model(prompt, input_pos=0)
    input_pos = prompt.shape[1]
    token = logits[:, -1].argmax(-1, keepdim=True)
    out, last_logits = [token], []
    for _ in range(max_new_tokens - 1):
        logits = model(token, input_pos=input_pos)
        last_logits.append(logits[:, -1])
        input_pos += 1
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
    return torch.cat(out, dim=1), torch.stack(last_logits, dim=1)


def main():
    torch.manual_seed(0)
    model = GPT(Config()).eval()
    prompt = torch.randint(0, Config.vocab_size, (2, 8))
    with torch.no_grad():
        tokens, logits = generate(model, prompt, max_new_tokens=12, cache_length=10)
    print("generated:", tokens.tolist())
    print("logits checksum: %.6f" % logits.sum().item())
    cache = model.h[0].attn.kv_cache
    print("layer 0 cache token positions:", cache.token_positions()[0, 0].tolist())
    print("layer 0 H2O scores:", [round(s, 3) for s in cache.scores[0, 0].tolist()])


if __name__ == "__main__":
    main()
