"""Correct program: Chameleon's batched inference with xformers BlockDiagonalCausalWithOffsetPaddedKeysMask.

Ported (shrunk) from facebookresearch/chameleon @e3b711ef63b0bb3a129cf0cf0918e36a32f26e2c:
  * chameleon/inference/alignment.py AlignPromptRight.prepare_inputs: prompts left-padded with pad_id.
  * chameleon/inference/model_adapter.py ChameleonModelAdapter.initialize / __call__: a cache of
    batch_size * max_seq_len slots; on the first pass only the real prompt tokens (mask[i, -k:]) are
    flattened into one sequence, the bias is AttnBias.from_seqlens(q_seqlen=prompt lens,
    kv_seqlen=prompt lens, kv_padding=max_seq_len); pad positions of the output are -inf.  Then the
    SAME bias object is mutated in place: q_seqinfo.seqstart <- arange(B+1) (one query per sequence),
    max_seqlen = 1, and k_seqinfo.seqlen.add_(1) after every call.
  * chameleon/inference/transformer.py Attention.forward: fused wqkv, rope_padded(...) writes the
    rotated keys/values into each sequence's cache block at positions derived from the bias, then
    fmha.memory_efficient_attention_forward(xq, cache_k, cache_v, attn_bias) with 5-D GQA shapes.

Stand-ins (plain torch, same semantics as xformers): the bias class (query j of sequence i sees
cache slots i*kv_padding + t for t < kv_seqlen[i] and t <= kv_seqlen[i] - q_len[i] + j, i.e. causal
aligned bottom-right within its own padded key block); rope_padded (position of query j of sequence
i = kv_seqlen[i] - q_len[i] + j, adjacent-pair rotation, K/V copied into the cache at those slots);
memory_efficient_attention_forward; cudagraph_wrap is the identity.  Float64, CPU.

Reference: each prompt (no padding) plus the tokens generated so far re-run alone from scratch,
full causal attention, no cache; logits and greedy tokens must agree.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
DT = torch.float64


# ---- xformers stand-ins -------------------------------------------------------------------------
class _SeqInfo:
    pass


class AttnBias:  # BlockDiagonalCausalWithOffsetPaddedKeysMask
    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen, kv_padding):
        self = cls()
        self.q_seqinfo = _SeqInfo()
        starts = [0]
        for n in q_seqlen:
            starts.append(starts[-1] + n)
        self.q_seqinfo.seqstart = torch.tensor(starts, dtype=torch.int)
        self.q_seqinfo.seqstart_py = list(starts)
        self.q_seqinfo.max_seqlen = max(q_seqlen)
        self.k_seqinfo = _SeqInfo()
        self.k_seqinfo.seqlen = torch.tensor(kv_seqlen, dtype=torch.int)
        self.k_seqinfo.padding = kv_padding
        return self

    def materialize(self, shape, dtype):
        n_q, n_k = shape[-2], shape[-1]
        bias = torch.full((n_q, n_k), float("-inf"), dtype=dtype)
        st = self.q_seqinfo.seqstart_py
        for i in range(len(st) - 1):
            q_len = st[i + 1] - st[i]
            kv_len = int(self.k_seqinfo.seqlen[i])
            base = i * self.k_seqinfo.padding
            for j in range(q_len):
                last = kv_len - q_len + j  # causal, aligned to the bottom-right of the block
                bias[st[i] + j, base: base + min(kv_len, last + 1)] = 0.0
        return bias


def _rotate_adjacent(x, pos, theta):  # x (..., H, D) rows at positions pos; pairs (0,1),(2,3),...
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=DT) / d)
    ang = pos[:, None].to(DT) * inv  # (M, D/2)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def rope_padded(xq, xk, xv, cache_k, cache_v, attn_bias, theta):
    st = attn_bias.q_seqinfo.seqstart_py
    pos = torch.empty(xq.shape[1], dtype=torch.long)
    slot = torch.empty(xq.shape[1], dtype=torch.long)
    for i in range(len(st) - 1):
        q_len = st[i + 1] - st[i]
        first = int(attn_bias.k_seqinfo.seqlen[i]) - q_len
        pos[st[i]:st[i + 1]] = torch.arange(first, first + q_len)
        slot[st[i]:st[i + 1]] = i * attn_bias.k_seqinfo.padding + pos[st[i]:st[i + 1]]
    cache_k[0, slot] = _rotate_adjacent(xk[0], pos, theta)
    cache_v[0, slot] = xv[0]
    return _rotate_adjacent(xq[0], pos, theta)[None]


def memory_efficient_attention_forward(q, k, v, attn_bias):  # (1, M, G, Hg, K) / (1, N, G, Hg, K)
    M, N = q.shape[1], k.shape[1]
    q = q.flatten(2, 3).transpose(1, 2)
    k = k.flatten(2, 3).transpose(1, 2)
    v = v.flatten(2, 3).transpose(1, 2)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + attn_bias.materialize((M, N), q.dtype)
    out = (s.softmax(-1) @ v).transpose(1, 2)  # (1, M, H, K)
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


# ---- chameleon/inference/transformer.py (tiny) -------------------------------------------------
DIM, N_HEADS, N_KV, VOCAB, N_LAYERS, THETA = 16, 4, 2, 29, 2, 10000.0
HEAD_DIM = DIM // N_HEADS


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_local_heads, self.n_local_kv_heads, self.head_dim = N_HEADS, N_KV, HEAD_DIM
        self.wqkv = nn.Linear(DIM, (N_HEADS + 2 * N_KV) * HEAD_DIM, bias=False)
        self.wo = nn.Linear(N_HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x, cache, attn_bias):
        xqkv = self.wqkv(x)
        xq = xqkv[:, : (self.n_local_heads * self.head_dim)]
        xkv = xqkv[:, (self.n_local_heads * self.head_dim):]
        xk, xv = xkv.chunk(2, 1)
        output_shape = xq.shape
        xq = xq.view(1, xq.shape[0], self.n_local_heads, self.head_dim)
        xk = xk.view(1, xk.shape[0], self.n_local_kv_heads, self.head_dim)
        xv = xv.view(1, xv.shape[0], self.n_local_kv_heads, self.head_dim)
        cache_k, cache_v = cache
        xq = rope_padded(xq=xq, xk=xk, xv=xv, cache_k=cache_k, cache_v=cache_v,
                         attn_bias=attn_bias, theta=THETA)
        heads_per_group = self.n_local_heads // self.n_local_kv_heads
        cache_k = cache_k.unsqueeze(3).expand(-1, -1, -1, heads_per_group, -1)
        cache_v = cache_v.unsqueeze(3).expand(-1, -1, -1, heads_per_group, -1)
        xq = xq.reshape([*xq.shape[:2], self.n_local_kv_heads, heads_per_group, xq.shape[-1]])
        output = memory_efficient_attention_forward(xq, cache_k, cache_v, attn_bias)
        return self.wo(output.reshape(output_shape))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.w13 = nn.Linear(DIM, 2 * 32, bias=False)
        self.w2 = nn.Linear(32, DIM, bias=False)
        self.attention_norm, self.ffn_norm = RMSNorm(DIM, 1e-5), RMSNorm(DIM, 1e-5)

    def ff(self, x):
        x1, x3 = self.w13(x).chunk(2, -1)
        return self.w2(F.silu(x1) * x3)

    def forward(self, x, cache, attn_bias):
        h = x + self.attention.forward(self.attention_norm(x), cache, attn_bias)
        return h + self.ff(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([TransformerBlock() for _ in range(N_LAYERS)])
        self.norm = RMSNorm(DIM, 1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    @torch.no_grad()
    def forward_with_attn_bias(self, token_values, attn_bias, cache):
        h = self.tok_embeddings(token_values)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i], attn_bias)
        return self.output(self.norm(h))  # upstream: .float(); kept float64 here


def make_cache(length):
    shape = (1, length, N_KV, HEAD_DIM)
    return [(torch.zeros(shape, dtype=DT), torch.zeros(shape, dtype=DT)) for _ in range(N_LAYERS)]


# ---- chameleon/inference/model_adapter.py ChameleonModelAdapter (ported) -----------------------
class ChameleonModelAdapter:
    def __init__(self, model, max_seq_len):
        self._model, self._max_seq_len = model, max_seq_len

    def initialize(self, prompt_tokens):
        self._prompt_lengths = [len(toks) for toks in prompt_tokens]
        batch_size = len(prompt_tokens)
        self._cache = make_cache(batch_size * self._max_seq_len)
        self._local_inputs = torch.zeros([batch_size], dtype=int)
        self._forward = self._model.forward_with_attn_bias  # cudagraph_wrap stand-in
        self._first_pass = True

    def __call__(self, inputs):
        batch_size, seq_len = inputs.shape
        if self._first_pass:
            attn_seqlen = [min(pl, seq_len) for pl in self._prompt_lengths]
            self._bias = AttnBias.from_seqlens(q_seqlen=attn_seqlen, kv_seqlen=attn_seqlen,
                                               kv_padding=self._max_seq_len)
            mask = torch.zeros_like(inputs, dtype=torch.bool)
            for i, k in enumerate(self._prompt_lengths):
                mask[i, -k:] = True
            flat_outputs = self._forward(token_values=inputs[mask], attn_bias=self._bias, cache=self._cache)
            self._local_outputs = torch.full((inputs.shape[0], inputs.shape[1], flat_outputs.shape[-1]),
                                             -math.inf, dtype=DT)
            self._local_outputs[mask] = flat_outputs
            self._vocab_size = self._local_outputs.shape[-1]
            self._bias.q_seqinfo.seqstart.copy_(torch.arange(batch_size + 1, dtype=torch.int))
            self._bias.q_seqinfo.max_seqlen = 1
            self._bias.q_seqinfo.seqstart_py = self._bias.q_seqinfo.seqstart.tolist()
            self._first_pass = False
        else:
            self._local_inputs.copy_(inputs[:, -1])
            self._local_outputs = self._forward(token_values=self._local_inputs, attn_bias=self._bias,
                                                cache=self._cache)
        self._bias.k_seqinfo.seqlen.add_(1)
        return self._local_outputs.view(batch_size, -1, self._vocab_size)


# ---- run: three prompts of different lengths, AlignPromptRight (left padding), greedy decode ---
PAD = 0
prompts = [[5, 9, 3], [7, 2, 11, 4, 8, 6, 1], [13, 3, 17, 22, 5]]
max_length = max(len(p) for p in prompts)
inputs = torch.tensor([[PAD] * (max_length - len(p)) + p for p in prompts])
model = Transformer().to(DT).eval()
for p in model.parameters():
    nn.init.normal_(p, std=0.8)
STEPS, MAX_SEQ_LEN = 5, 16

adapter = ChameleonModelAdapter(model, MAX_SEQ_LEN)
adapter.initialize(prompts)


def reference_logits(tokens):  # one sequence alone, no padding, no cache
    n = len(tokens)
    bias = AttnBias.from_seqlens([n], [n], kv_padding=n)
    return model.forward_with_attn_bias(torch.tensor(tokens), bias, make_cache(n))


def reference_logits_plain(tokens):  # independent path: explicit causal attention, no bias object
    n = len(tokens)
    pos = torch.arange(n)
    h = model.tok_embeddings(torch.tensor(tokens))
    for layer in model.layers:
        a = layer.attention
        x = layer.attention_norm(h)
        xqkv = a.wqkv(x)
        q = xqkv[:, : N_HEADS * HEAD_DIM].view(n, N_HEADS, HEAD_DIM)
        k, v = xqkv[:, N_HEADS * HEAD_DIM:].chunk(2, 1)
        k, v = k.reshape(n, N_KV, HEAD_DIM), v.reshape(n, N_KV, HEAD_DIM)
        q, k = _rotate_adjacent(q, pos, THETA), _rotate_adjacent(k, pos, THETA)
        k = k.repeat_interleave(N_HEADS // N_KV, 1)
        v = v.repeat_interleave(N_HEADS // N_KV, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM ** 0.5
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, -1)
        h = h + a.wo(o)
        h = h + layer.ff(layer.ffn_norm(h))
    return model.output(model.norm(h))


worst = 0.0
seqs = [list(p) for p in prompts]
with torch.no_grad():
    for step in range(STEPS):
        logits = adapter(inputs)
        if step == 0:  # full prompt logits; pad positions are -inf by design
            for i, p in enumerate(prompts):
                ref = reference_logits_plain(p)
                worst = max(worst, (logits[i, -len(p):] - ref).abs().max().item())
                assert torch.isinf(logits[i, : max_length - len(p)]).all()
        else:
            for i in range(len(prompts)):
                ref = reference_logits_plain(seqs[i])[-1]
                ref2 = reference_logits(seqs[i])[-1]
                worst = max(worst, (logits[i, -1] - ref).abs().max().item(),
                            (ref2 - ref).abs().max().item())
        nxt = logits[:, -1].argmax(-1)
        for i in range(len(prompts)):
            seqs[i].append(int(nxt[i]))
        inputs = torch.cat([inputs, nxt[:, None]], dim=1)
        print(f"step {step}: kv_seqlen after call {adapter._bias.k_seqinfo.seqlen.tolist()}, "
              f"tokens {nxt.tolist()}, running max diff {worst:.2e}")

# greedy continuation of each prompt alone must be the same tokens
for i, p in enumerate(prompts):
    alone = list(p)
    for _ in range(STEPS):
        alone.append(int(reference_logits_plain(alone)[-1].argmax()))
    assert alone == seqs[i], (alone, seqs[i])

ok = worst < 1e-10
print("MATCH" if ok else "MISMATCH", f"max diff {worst:.2e}; generations identical to each prompt alone")
assert ok
