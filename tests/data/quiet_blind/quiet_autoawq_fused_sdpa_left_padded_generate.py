"""AutoAWQ fused attention (QuantAttentionFused, use_sdpa) under Hugging Face-style batched
generation with left-padded prompts (tiny, CPU, torch only; AWQ GEMM kernels replaced by nn.Linear).

Ported from casper-hansen/AutoAWQ @eab1a4a (2024-09-12):
  awq/modules/fused/attn.py  (QuantAttentionFused.forward: start_pos-based RoPE, WindowedCache
      update_kv / get_kv on decode, repeat_interleave for GQA, and on the use_sdpa path
      causal_mask = attention_mask[:, :, :, :keys.shape[-2]]; is_causal only when no mask)
  awq/modules/fused/cache.py (WindowedCache: V [B, kv_heads, max_seq, D],
      K packed [B, kv_heads, D // 8, max_seq, 8])
  awq/utils/fused_utils.py   (get_attention_shapes for GQA)
The 4-D mask the fused module receives is the one transformers' LlamaModel._update_causal_mask
builds (v4.44-era): min-dtype finite fill, triu(1), "arange(target) > cache_position", then the
2-D padding mask merged in. Left padding keeps every row's cache slot equal to its column in the
padding mask, so AutoAWQ's shared start_pos works; RoPE positions are shifted by each row's pad
count, which leaves relative positions (and hence attention) unchanged.
Reference: each prompt generated alone, unpadded, same greedy loop.
"""
import math
import torch
import torch.nn as nn
from torch.nn import functional as F

torch.manual_seed(0)

VOCAB, HIDDEN, N_HEADS, N_KV, HEAD_DIM, N_LAYERS, MAX_SEQ = 40, 32, 4, 2, 8, 2, 32
PAD_ID = 0


class RoPE(nn.Module):
    def __init__(self, head_dim, max_seq_len, rope_theta=10000.0):
        super().__init__()
        self.freqs_cis = nn.Parameter(self.precompute_freqs_cis(head_dim, max_seq_len, rope_theta),
                                      requires_grad=False)

    @staticmethod
    def precompute_freqs_cis(dim, end, theta=10000.0):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        t = torch.arange(end)
        freqs = torch.outer(t, freqs).float()
        return torch.polar(torch.ones_like(freqs), freqs)

    @staticmethod
    def reshape_for_broadcast(freqs_cis, x):
        shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
        return freqs_cis.view(*shape)

    def forward(self, xq, xk, start_pos, seqlen):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], 2, -1).transpose(-2, -1).contiguous())
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], 2, -1).transpose(-2, -1).contiguous())
        freqs_cis = self.freqs_cis[start_pos: start_pos + seqlen]
        freqs_cis = self.reshape_for_broadcast(freqs_cis, xq_)
        xq_out = torch.view_as_real(xq_ * freqs_cis).transpose(-2, -1).flatten(3)
        xk_out = torch.view_as_real(xk_ * freqs_cis).transpose(-2, -1).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)


class WindowedCache:
    def __init__(self, cache_v_shape, cache_k_shape, max_seq_len):
        self.v = torch.zeros(cache_v_shape).half()
        self.k = torch.zeros(cache_k_shape).half()
        self.max_seq_len = max_seq_len

    def get_kv(self, batch_size, start_pos, seqlen, head_dim):
        xv = self.v[:batch_size, :, : start_pos + seqlen, :].transpose(1, 2).contiguous()
        xk = self.k[:batch_size, :, :, : start_pos + seqlen, :].transpose(2, 3).contiguous()
        xk = xk.reshape(xk.shape[:-2] + (head_dim,)).transpose(1, 2).contiguous()
        return xv, xk

    def update_kv(self, values_store, keys_store, batch_size, start_pos, seqlen):
        self.v[:batch_size, :, start_pos: start_pos + seqlen, :] = values_store
        self.k[:batch_size, :, :, start_pos: start_pos + seqlen, :] = keys_store

    def to(self, t):
        self.k = self.k.to(t)
        self.v = self.v.to(t)

    def resize(self, bsz):
        self.v = torch.zeros(bsz, *self.v.shape[1:], dtype=self.v.dtype)
        self.k = torch.zeros(bsz, *self.k.shape[1:], dtype=self.k.dtype)


def get_attention_shapes(max_seq_len, bsz, n_heads, n_kv_heads, head_dim):
    return {
        "cache_v": (bsz, n_kv_heads, max_seq_len, head_dim),
        "cache_k": (bsz, n_kv_heads, head_dim // 8, max_seq_len, 8),
        "xqkv_view": (n_heads + n_kv_heads * 2, head_dim),
        "xq_slice": lambda xqkv: xqkv[:, :, 0:n_heads],
        "xk_slice": lambda xqkv: xqkv[:, :, n_heads: (n_heads + n_kv_heads)],
        "xv_slice": lambda xqkv: xqkv[:, :, -n_kv_heads:],
        "xq_view": (n_heads, head_dim),
        "xk_view": (n_kv_heads, head_dim),
        "xv_view": (n_kv_heads, head_dim),
        "xk_reshape": (n_kv_heads, head_dim // 8, 8),
    }


class QuantAttentionFused(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = N_HEADS, N_KV, HEAD_DIM
        self.n_kv_groups = N_HEADS // N_KV
        self.qkv_proj = nn.Linear(HIDDEN, (N_HEADS + 2 * N_KV) * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(N_HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.start_pos = 0
        self.cache_batch_size = 1
        self.attention_shapes = get_attention_shapes(MAX_SEQ, 1, N_HEADS, N_KV, HEAD_DIM)
        self.cache = WindowedCache(self.attention_shapes["cache_v"], self.attention_shapes["cache_k"], MAX_SEQ)
        self.rope = RoPE(HEAD_DIM, MAX_SEQ)
        self.is_hf_transformers = True
        self.use_sdpa = True

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, use_cache=True):
        bsz, seqlen, _ = hidden_states.shape
        if bsz != self.cache_batch_size:
            self.cache.resize(bsz)
            self.cache_batch_size = bsz
            self.start_pos = 0
        if past_key_value is None:  # first step of generate()
            self.start_pos = 0

        xqkv = self.qkv_proj(hidden_states).view((bsz, seqlen) + self.attention_shapes["xqkv_view"])
        xq = self.attention_shapes["xq_slice"](xqkv)
        xk = self.attention_shapes["xk_slice"](xqkv)
        xv = self.attention_shapes["xv_slice"](xqkv)
        xq = xq.reshape((bsz, seqlen) + self.attention_shapes["xq_view"])
        xk = xk.reshape((bsz, seqlen) + self.attention_shapes["xk_view"])
        xv = xv.reshape((bsz, seqlen) + self.attention_shapes["xv_view"])
        xq, xk = self.rope.forward(xq, xk, self.start_pos, seqlen)

        values_store = xv.transpose(2, 1)
        keys_store = (xk.reshape((bsz, seqlen) + self.attention_shapes["xk_reshape"])
                      .permute(0, 2, 3, 1, 4).contiguous())
        self.cache.to(xq)
        self.cache.update_kv(values_store, keys_store, bsz, self.start_pos, seqlen)
        if seqlen == 1:
            xv, xk = self.cache.get_kv(bsz, self.start_pos, seqlen, self.head_dim)

        keys = torch.repeat_interleave(xk, dim=2, repeats=self.n_kv_groups)
        values = torch.repeat_interleave(xv, dim=2, repeats=self.n_kv_groups)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)

        causal_mask = attention_mask
        if attention_mask is not None:
            causal_mask = causal_mask[:, :, :, : keys.shape[-2]]
        is_causal = True if causal_mask is None and seqlen > 1 else False
        output = F.scaled_dot_product_attention(xq, keys, values, attn_mask=causal_mask,
                                                dropout_p=0.0, is_causal=is_causal)
        attention_weight = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        attn_output = self.o_proj(attention_weight)
        self.start_pos += seqlen
        if self.is_hf_transformers and not use_cache:
            self.start_pos = 0
        return attn_output


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LlamaLikeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_1, self.norm_2 = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.attn = QuantAttentionFused()
        self.gate, self.up = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False), nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, h, attention_mask, past_key_value):
        h = h + self.attn(self.norm_1(h), attention_mask=attention_mask, past_key_value=past_key_value)
        x = self.norm_2(h)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))


def update_causal_mask(attention_mask, input_tensor, cache_position, past_seen_tokens):
    """transformers LlamaModel._update_causal_mask (dynamic cache, sdpa/eager, 4.44-era)."""
    dtype = input_tensor.dtype
    min_dtype = torch.finfo(dtype).min
    sequence_length = input_tensor.shape[1]
    target_length = attention_mask.shape[-1]
    causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
    if sequence_length != 1:
        causal_mask = torch.triu(causal_mask, diagonal=1)
    causal_mask *= torch.arange(target_length) > cache_position.reshape(-1, 1)
    causal_mask = causal_mask[None, None, :, :].expand(input_tensor.shape[0], 1, -1, -1).clone()
    mask_length = attention_mask.shape[-1]
    padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :]
    padding_mask = padding_mask == 0
    causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(padding_mask, min_dtype)
    return causal_mask


class LlamaLikeModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([LlamaLikeBlock() for _ in range(N_LAYERS)])
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, attention_mask, past_seen_tokens):
        h = self.embedding(input_ids)
        cache_position = torch.arange(past_seen_tokens, past_seen_tokens + input_ids.shape[1])
        mask = update_causal_mask(attention_mask, h, cache_position, past_seen_tokens)
        pkv = None if past_seen_tokens == 0 else "dummy"
        for block in self.blocks:
            h = block(h, mask, pkv)
        return self.lm_head(self.norm(h))


@torch.no_grad()
def generate(model, input_ids, attention_mask, new_tokens):
    logits_all, out = [], []
    past = 0
    cur = input_ids
    for _ in range(new_tokens):
        logits = model(cur, attention_mask, past)[:, -1]
        past += cur.shape[1]
        nxt = logits.argmax(-1)
        logits_all.append(logits)
        out.append(nxt)
        cur = nxt[:, None]
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=-1)
    return torch.stack(out, 1), torch.stack(logits_all, 1)


model = LlamaLikeModel().eval()
prompts = [torch.randint(1, VOCAB, (n,)) for n in (5, 2, 7)]
T = max(len(p) for p in prompts)
ids = torch.full((len(prompts), T), PAD_ID)
am = torch.zeros(len(prompts), T, dtype=torch.long)
for i, p in enumerate(prompts):     # left padding, as the tokenizer does for generation
    ids[i, T - len(p):] = p
    am[i, T - len(p):] = 1

NEW = 6
toks, logits = generate(model, ids, am, NEW)

ok = True
for i, p in enumerate(prompts):
    ref_t, ref_l = generate(model, p[None], torch.ones(1, len(p), dtype=torch.long), NEW)
    err = (ref_l[0] - logits[i]).abs().max().item()
    same = torch.equal(ref_t[0], toks[i]) and err < 1e-4
    print(f"prompt {i} (len {len(p)}, pads {T - len(p)}): batched={toks[i].tolist()} "
          f"alone={ref_t[0].tolist()} max|dlogit|={err:.2e}")
    ok &= same
print("matches reference:", ok)
assert ok
