"""Correct program: fish-speech's dual-AR text-to-semantic LLaMA (slow transformer over
time, fast transformer over the codebooks of one frame), shrunk to tiny sizes.

Ported from fishaudio/fish-speech @00b6602eab44881cd7cb3fc7c8d4e99fab5ad520,
fish_speech/models/text2semantic/llama.py (Transformer.forward, forward_generate_slow,
forward_generate_fast, KVCache, Attention.forward / eq_scaled_dot_product_attention).

Masking, as in the project:
  * one bool tril buffer `causal_mask` (True = attend, SDPA convention);
  * training: `mask = causal_mask[None, None, :S, :S] & key_padding_mask[:, None, None, :].logical_not()`
    where key_padding_mask is True at (right) padding;
  * the fast transformer runs over (b s) rows of num_codebooks+1 ... sliced to num_codebooks
    positions with `causal_mask[None, None, :n, :n]` and a hand-written attention that
    fills masked slots with -inf;
  * generation: slow mask `causal_mask[None, None, input_pos, :max_seq_len]` over the whole
    zero-initialised cache; fast cache of num_codebooks slots reused for every frame, the
    stale slots of the previous frame hidden by the causal row of input_pos.

Checked against an independent reference that runs each sequence alone and, for every
query, attends only the explicit slice keys[:i+1] (no mask at all).
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F

torch.manual_seed(0)


def find_multiple(n: int, k: int) -> int:
    if n % k == 0:
        return n
    return n + k - (n % k)


@dataclass
class ModelArgs:
    vocab_size: int = 40
    n_slow_layer: int = 2
    n_fast_layer: int = 2
    n_head: int = 4
    dim: int = 32
    intermediate_size: int = None
    n_local_heads: int = 2
    head_dim: int = 8
    rope_base: float = 10000
    norm_eps: float = 1e-5
    max_seq_len: int = 64
    dropout: float = 0.0
    codebook_size: int = 12
    num_codebooks: int = 3
    codebook_padding_idx: int = 0

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.intermediate_size is None:
            hidden_dim = 4 * self.dim
            n_hidden = int(2 * hidden_dim / 3)
            self.intermediate_size = find_multiple(n_hidden, 16)
        self.head_dim = self.dim // self.n_head


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_len, n_heads, head_dim, dtype=torch.float32):
        super().__init__()
        cache_shape = (max_batch_size, n_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        assert input_pos.shape[0] == k_val.shape[2]
        k_out = self.k_cache
        v_out = self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x: Tensor) -> Tensor:
        return self._norm(x.float()).type_as(x) * self.weight


def precompute_freqs_cis(seq_len: int, n_elem: int, base: int = 10000) -> Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].float() / n_elem))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    cache = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)
    return cache.to(dtype=torch.bfloat16)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    return x_out2.flatten(3).type_as(x)


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    def __init__(self, config, use_sdpa=True):
        super().__init__()
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache = None
        self.dropout = config.dropout
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.n_local_heads = config.n_local_heads
        self.dim = config.dim
        self.use_sdpa = use_sdpa

    def forward(self, x, freqs_cis, mask, input_pos=None):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        q, k, v = map(lambda t: t.transpose(1, 2), (q, k, v))
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        else:
            y = self.eq_scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)
        return self.wo(y)

    def eq_scaled_dot_product_attention(self, query, key, value, attn_mask=None, dropout_p=0.0):
        L, S = query.size(-2), key.size(-2)
        scale_factor = 1 / math.sqrt(query.size(-1))
        attn_bias = torch.zeros(1, 1, L, S, dtype=query.dtype, device=query.device)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_bias.masked_fill_(attn_mask.logical_not(), float("-inf"))
            else:
                attn_bias += attn_mask
        attn_weight = query @ key.transpose(-2, -1) * scale_factor
        attn_weight += attn_bias
        attn_weight = torch.softmax(attn_weight, dim=-1)
        attn_weight = torch.dropout(attn_weight, dropout_p, train=True)
        return attn_weight @ value


class TransformerBlock(nn.Module):
    def __init__(self, config, use_sdpa=True):
        super().__init__()
        self.attention = Attention(config, use_sdpa=use_sdpa)
        self.feed_forward = FeedForward(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, freqs_cis, mask, input_pos=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size + config.codebook_size * config.num_codebooks, config.dim)
        self.slow_layers = nn.ModuleList(TransformerBlock(config, use_sdpa=True) for _ in range(config.n_slow_layer))
        self.slow_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.slow_output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.fast_embeddings = nn.Embedding(config.codebook_size, config.dim, padding_idx=config.codebook_padding_idx)
        self.fast_layers = nn.ModuleList(TransformerBlock(config, use_sdpa=False) for _ in range(config.n_fast_layer))
        self.fast_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.fast_output = nn.Linear(config.dim, config.codebook_size, bias=False)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(config.max_seq_len, config.dim // config.n_head, config.rope_base),
            persistent=False,
        )
        self.register_buffer(
            "causal_mask",
            torch.tril(torch.ones(config.max_seq_len, config.max_seq_len, dtype=torch.bool)),
            persistent=False,
        )
        self.max_batch_size = -1
        self.max_seq_len = -1

    def setup_caches(self, max_batch_size, max_seq_len, dtype=torch.float32):
        if self.max_seq_len >= max_seq_len and self.max_batch_size >= max_batch_size:
            return
        head_dim = self.config.dim // self.config.n_head
        max_seq_len = find_multiple(max_seq_len, 8)
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        for b in self.slow_layers:
            b.attention.kv_cache = KVCache(max_batch_size, max_seq_len, self.config.n_local_heads, head_dim, dtype=dtype)
        for b in self.fast_layers:
            b.attention.kv_cache = KVCache(
                max_batch_size, self.config.num_codebooks, self.config.n_local_heads, head_dim, dtype=dtype
            )

    def clear_caches(self):
        for b in list(self.slow_layers) + list(self.fast_layers):
            b.attention.kv_cache = None
        self.max_batch_size = -1
        self.max_seq_len = -1

    def embed(self, x):
        vocab_embeds = [self.embeddings(x[:, 0])]
        for i in range(self.config.num_codebooks):
            emb = self.embeddings(x[:, i + 1] + i * self.config.codebook_size + self.config.vocab_size)
            emb[x[:, i + 1] == self.config.codebook_padding_idx] = 0
            vocab_embeds.append(emb)
        x = torch.stack(vocab_embeds, dim=3)
        return x.sum(dim=3)

    def forward(self, x, key_padding_mask=None):
        seq_len = x.size(2)
        codebooks = x[:, 1:]
        x = self.embed(x)
        mask = self.causal_mask[None, None, :seq_len, :seq_len]  # (B, N, Q, K)
        freqs_cis = self.freqs_cis[:seq_len]
        # FALSE means masked out (SDPA); key_padding_mask uses TRUE to mask out
        if key_padding_mask is not None:
            mask = mask & key_padding_mask[:, None, None, :].logical_not()
        for layer in self.slow_layers:
            x = layer(x, freqs_cis, mask)
        slow_out = self.slow_norm(x)
        token_logits = self.slow_output(slow_out)

        fast_seq_len = self.config.num_codebooks
        fast_mask = self.causal_mask[None, None, :fast_seq_len, :fast_seq_len]
        fast_freqs_cis = self.freqs_cis[:fast_seq_len]
        codebook_embeddings = self.fast_embeddings(codebooks[:, :-1])
        x = torch.cat([x[:, None], codebook_embeddings], dim=1)  # (B, N, S, D)
        b, s = x.size(0), x.size(2)
        x = x.permute(0, 2, 1, 3).reshape(b * s, x.size(1), x.size(3))  # "b n s d -> (b s) n d"
        for layer in self.fast_layers:
            x = layer(x, fast_freqs_cis, fast_mask)
        codebook_logits = self.fast_output(self.fast_norm(x))
        assert codebook_logits.shape[1] == self.config.num_codebooks
        codebook_logits = codebook_logits.view(b, s, self.config.num_codebooks, -1)
        return token_logits, codebook_logits

    def forward_generate_slow(self, x, input_pos):
        x = self.embed(x)
        mask = self.causal_mask[None, None, input_pos, : self.max_seq_len]
        freqs_cis = self.freqs_cis[input_pos]
        for layer in self.slow_layers:
            x = layer(x, freqs_cis, mask, input_pos=input_pos)
        if x.size(1) > 1:
            x = x[:, -1:]
        token_logits = self.slow_output(self.slow_norm(x))
        return x, token_logits

    def forward_generate_fast(self, x, input_pos):
        x = x.view(1, 1, -1)
        fast_mask = self.causal_mask[None, None, input_pos, : self.config.num_codebooks]
        fast_freqs_cis = self.freqs_cis[input_pos]
        for layer in self.fast_layers:
            x = layer(x, fast_freqs_cis, fast_mask, input_pos=input_pos)
        return self.fast_output(self.fast_norm(x))


# ---------------------------------------------------------------- independent reference
def ref_block(layer, x, freqs):
    """x: (L, D) one sequence alone; query i attends the explicit slice keys[:i+1]."""
    att = layer.attention
    h_in = layer.attention_norm(x)
    L = x.shape[0]
    kv = att.n_local_heads * att.head_dim
    q, k, v = att.wqkv(h_in).split([att.dim, kv, kv], dim=-1)
    q = apply_rotary_emb(q.view(1, L, att.n_head, att.head_dim), freqs)[0]
    k = apply_rotary_emb(k.view(1, L, att.n_local_heads, att.head_dim), freqs)[0]
    v = v.view(L, att.n_local_heads, att.head_dim)
    rep = att.n_head // att.n_local_heads
    out = torch.zeros(L, att.n_head, att.head_dim)
    for i in range(L):
        for h in range(att.n_head):
            kh = k[: i + 1, h // rep]
            vh = v[: i + 1, h // rep]
            w = torch.softmax(kh @ q[i, h] / math.sqrt(att.head_dim), dim=0)
            out[i, h] = w @ vh
    h = x + att.wo(out.reshape(L, att.dim))
    return h + layer.feed_forward(layer.ffn_norm(h))


def ref_slow(model, col):
    """col: (N+1, L) token + codebook rows of one sequence. Returns hidden (L, D)."""
    x = model.embed(col[None])[0]
    freqs = model.freqs_cis[: x.shape[0]]
    for layer in model.slow_layers:
        x = ref_block(layer, x, freqs)
    return x


def ref_fast(model, h, cbs):
    """h: (D,) slow hidden, cbs: (num_codebooks,) codebooks; logits for each codebook."""
    n = model.config.num_codebooks
    x = torch.cat([h[None], model.fast_embeddings(cbs[:-1])], dim=0)
    freqs = model.freqs_cis[:n]
    for layer in model.fast_layers:
        x = ref_block(layer, x, freqs)
    return model.fast_output(model.fast_norm(x))


def main():
    cfg = ModelArgs()
    model = Transformer(cfg).eval()
    N, V, C = cfg.num_codebooks, cfg.vocab_size, cfg.codebook_size
    ok = True

    # ---------------- training forward on a right-padded batch
    lengths = [9, 6, 4]
    S = max(lengths)
    x = torch.zeros(len(lengths), N + 1, S, dtype=torch.long)
    key_padding_mask = torch.ones(len(lengths), S, dtype=torch.bool)  # True = pad
    seqs = []
    for b, L in enumerate(lengths):
        col = torch.cat([torch.randint(1, V, (1, L)), torch.randint(1, C, (N, L))], dim=0)
        col[1:, 0] = cfg.codebook_padding_idx  # text-only first frame: codebooks padded out
        seqs.append(col)
        x[b, :, :L] = col
        key_padding_mask[b, :L] = False
    with torch.no_grad():
        tok_logits, cb_logits = model(x, key_padding_mask=key_padding_mask)
        max_err = 0.0
        for b, L in enumerate(lengths):
            h = ref_slow(model, seqs[b])
            ref_tok = model.slow_output(model.slow_norm(h))
            max_err = max(max_err, (tok_logits[b, :L] - ref_tok).abs().max().item())
            for p in range(L):
                ref_cb = ref_fast(model, h[p], seqs[b][1:, p])
                max_err = max(max_err, (cb_logits[b, p] - ref_cb).abs().max().item())
    train_ok = max_err < 1e-4
    ok &= train_ok
    print(f"padded training forward vs each sequence alone: max abs err {max_err:.2e} -> {'match' if train_ok else 'MISMATCH'}")

    # ---------------- cached generation: slow prefill + per-frame fast decoding
    prompt = torch.cat([torch.randint(1, V, (1, 5)), torch.zeros(N, 5, dtype=torch.long)], dim=0)
    steps = 6
    with torch.no_grad():
        model.setup_caches(max_batch_size=1, max_seq_len=prompt.shape[1] + steps)
        cur = prompt[None]  # (1, N+1, T)
        input_pos = torch.arange(cur.shape[2])
        fed = [prompt]
        gen_logits = []  # (token_logits, [codebook logits]) per step
        for _ in range(steps):
            h, logits = model.forward_generate_slow(cur, input_pos)
            token = logits[0, -1].argmax()
            fast_x = h
            cbs, cb_lg = [], []
            for ci in range(N):
                lg = model.forward_generate_fast(fast_x, torch.tensor([ci]))
                cb_lg.append(lg[0, 0])
                a = lg[0, 0].argmax()
                a = torch.where(a == cfg.codebook_padding_idx, torch.tensor(1), a)
                cbs.append(a)
                fast_x = model.fast_embeddings(a.view(1))
            gen_logits.append((logits[0, -1], cb_lg, torch.stack(cbs)))
            new_col = torch.cat([token.view(1), torch.stack(cbs)]).view(N + 1, 1)
            fed.append(new_col)
            input_pos = input_pos[-1:] + 1
            cur = new_col[None]
        model.clear_caches()

        full = torch.cat(fed, dim=1)
        h = ref_slow(model, full)
        max_err = 0.0
        T0 = prompt.shape[1]
        for t, (tok_lg, cb_lg, cbs) in enumerate(gen_logits):
            p = T0 - 1 + t
            ref_tok = model.slow_output(model.slow_norm(h[p]))
            max_err = max(max_err, (tok_lg - ref_tok).abs().max().item())
            ref_cb = ref_fast(model, h[p], cbs)
            for ci in range(N):
                max_err = max(max_err, (cb_lg[ci] - ref_cb[ci]).abs().max().item())
    gen_ok = max_err < 1e-4
    ok &= gen_ok
    print(f"cached slow+fast generation vs reference loop: max abs err {max_err:.2e} -> {'match' if gen_ok else 'MISMATCH'}")
    print("ALL MATCH" if ok else "MISMATCH")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
