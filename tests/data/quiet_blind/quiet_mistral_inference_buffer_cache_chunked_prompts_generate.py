# Citation: mistralai/mistral-inference src/mistral_inference/generate.py @2f8b5b25874cc2d1d70613dd32a2a6db23958e4b
#   (generate: prompts of different lengths encoded by chunks, seqlens per chunk, then one token per sequence) and
#   src/mistral_inference/cache.py @0e5b4586ae9db53158b4448a53191990e94ad4af (BufferCache.get_input_metadata,
#   CacheView.update / interleave_kv / key / value), src/mistral_inference/transformer_layers.py
#   @510f7ae8e81c164a02cf2d18513588be67138b31 (Attention.forward: prefill -> interleave_kv, decode -> whole padded
#   cache), Transformer.forward (freqs_cis[input_metadata.positions], cache.update_seqlens).
# Correct program (quiet batch quiet-r87a). No padding tokens: the prompts are concatenated into one flat stream with
# their seqlens, and the xformers attention biases say which keys each query sees. The first chunk uses
# BlockDiagonalCausalMask(...).make_local_attention(max_seq_len); later prompt chunks a BlockDiagonalMask over
# (chunk, cached + chunk) keys with make_local_attention_from_bottomright; decode steps a
# BlockDiagonalCausalWithOffsetPaddedKeysMask over each sequence's max_seq_len cache row with kv_seqlen = cached + 1.
# xformers is not installed here: the three bias classes are ported to dense additive masks and
# memory_efficient_attention to SDPA. Greedy (temperature 0) generations and log-probs of every prompt are checked
# against each prompt run alone through the same weights with plain causal attention and no cache.
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


# ---------------------------------------------------------------- xformers.ops.fmha.attn_bias (dense port)
class _Bias:
    """keep[i, j] over the flat query stream and the flat key stream; materialize() gives the additive bias."""

    def materialize(self, shape, dtype=torch.float32):
        keep = self._keep()
        assert keep.shape == tuple(shape[-2:]), (keep.shape, shape)
        bias = torch.zeros(keep.shape, dtype=dtype)
        return bias.masked_fill(~keep, float("-inf"))


def _starts(lens):
    out, acc = [], 0
    for n in lens:
        out.append(acc)
        acc += n
    return out


class BlockDiagonalMask(_Bias):
    def __init__(self, q_seqlen, kv_seqlen, causal=False, window=None, kv_padding=None):
        self.q_seqlen, self.kv_seqlen = list(q_seqlen), list(kv_seqlen)
        self.causal, self.window, self.kv_padding = causal, window, kv_padding

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None):
        return cls(q_seqlen, q_seqlen if kv_seqlen is None else kv_seqlen)

    def make_local_attention_from_bottomright(self, window_size):
        return BlockDiagonalMask(self.q_seqlen, self.kv_seqlen, causal=True, window=window_size)

    def _keep(self):
        n_k = sum(self.kv_seqlen) if self.kv_padding is None else self.kv_padding * len(self.kv_seqlen)
        keep = torch.zeros(sum(self.q_seqlen), n_k, dtype=torch.bool)
        k_starts = (_starts(self.kv_seqlen) if self.kv_padding is None
                    else [b * self.kv_padding for b in range(len(self.kv_seqlen))])
        for q0, nq, k0, nk in zip(_starts(self.q_seqlen), self.q_seqlen, k_starts, self.kv_seqlen):
            i = torch.arange(nq)[:, None] + (nk - nq)  # bottom-right aligned query index in key coordinates
            j = torch.arange(nk)[None, :]
            block = torch.ones(nq, nk, dtype=torch.bool)
            if self.causal:
                block &= j <= i
            if self.window is not None:
                block &= (i - j) < self.window
            keep[q0:q0 + nq, k0:k0 + nk] = block
        return keep


class BlockDiagonalCausalMask(BlockDiagonalMask):
    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None):
        return cls(q_seqlen, q_seqlen if kv_seqlen is None else kv_seqlen, causal=True)

    def make_local_attention(self, window_size):
        return BlockDiagonalCausalMask(self.q_seqlen, self.kv_seqlen, causal=True, window=window_size)


class BlockDiagonalCausalWithOffsetPaddedKeysMask(BlockDiagonalMask):
    @classmethod
    def from_seqlens(cls, q_seqlen, kv_padding, kv_seqlen):
        return cls(q_seqlen, kv_seqlen, causal=True, kv_padding=kv_padding)


def memory_efficient_attention(q, k, v, attn_bias):
    # (1, S, H, D) layout, as xformers takes it
    bias = attn_bias.materialize((q.shape[1], k.shape[1])).to(q.dtype)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias)
    return out.transpose(1, 2)


# ---------------------------------------------------------------- mistral_inference/cache.py
@dataclass
class CacheInputMetadata:
    positions: torch.Tensor
    cache_positions: torch.Tensor
    prefill: bool
    mask: _Bias
    seqlens: List[int]


def interleave_list(l1, l2):
    assert len(l1) == len(l2)
    return [v for pair in zip(l1, l2) for v in pair]


class CacheView:
    def __init__(self, cache_k, cache_v, metadata, kv_seqlens):
        self.cache_k = cache_k
        self.cache_v = cache_v
        self.kv_seqlens = kv_seqlens
        self.metadata = metadata

    def update(self, xk, xv):
        n_kv_heads, head_dim = self.cache_k.shape[-2:]
        flat_cache_k = self.cache_k.view(-1, n_kv_heads, head_dim)
        flat_cache_v = self.cache_v.view(-1, n_kv_heads, head_dim)
        flat_cache_k.index_copy_(0, self.metadata.cache_positions, xk)
        flat_cache_v.index_copy_(0, self.metadata.cache_positions, xv)

    def interleave_kv(self, xk, xv):
        assert xk.ndim == xv.ndim == 3
        if all([s == 0 for s in self.metadata.seqlens]):
            return xk, xv
        xk = torch.split(xk, self.metadata.seqlens)
        xv = torch.split(xv, self.metadata.seqlens)
        assert len(xk) == len(self.kv_seqlens)
        cache_k = [cache_k[:seq_len] for cache_k, seq_len in zip(self.cache_k, self.kv_seqlens)]
        cache_v = [cache_v[:seq_len] for cache_v, seq_len in zip(self.cache_v, self.kv_seqlens)]
        interleaved_k = interleave_list(cache_k, list(xk))
        interleaved_v = interleave_list(cache_v, list(xv))
        return torch.cat(interleaved_k, dim=0), torch.cat(interleaved_v, dim=0)

    @property
    def max_seq_len(self):
        return self.cache_k.shape[1]

    @property
    def key(self):
        return self.cache_k[: len(self.kv_seqlens)]

    @property
    def value(self):
        return self.cache_v[: len(self.kv_seqlens)]

    @property
    def prefill(self):
        return self.metadata.prefill

    @property
    def mask(self):
        return self.metadata.mask


class BufferCache:
    def __init__(self, n_layers, max_batch_size, max_seq_len, n_kv_heads, head_dim):
        self.max_seq_len = max_seq_len
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        # (zeros, not mistral-inference's torch.empty: xformers' kernel never reads a masked slot, but the SDPA stand-in
        # multiplies its weight 0 by the slot's value, and an uninitialized NaN or inf there makes the row NaN)
        self.cache_k = torch.zeros((n_layers, max_batch_size, max_seq_len, n_kv_heads, head_dim))
        self.cache_v = torch.zeros((n_layers, max_batch_size, max_seq_len, n_kv_heads, head_dim))
        self.kv_seqlens: Optional[torch.Tensor] = None

    def get_view(self, layer_id, metadata):
        assert self.kv_seqlens is not None
        return CacheView(self.cache_k[layer_id], self.cache_v[layer_id], metadata, self.kv_seqlens)

    def reset(self):
        self.kv_seqlens = None

    def init_kvseqlens(self, batch_size):
        self.kv_seqlens = torch.zeros((batch_size,), dtype=torch.long)

    def to(self, device, dtype):
        self.cache_k = self.cache_k.to(device=device, dtype=dtype)
        self.cache_v = self.cache_v.to(device=device, dtype=dtype)
        return self

    def update_seqlens(self, seqlens):
        assert self.kv_seqlens is not None
        self.kv_seqlens += torch.tensor(seqlens, dtype=torch.long)

    def get_input_metadata(self, seqlens):
        if self.kv_seqlens is None:
            self.init_kvseqlens(len(seqlens))
        assert len(seqlens) == len(self.kv_seqlens)
        seqpos = self.kv_seqlens.tolist()
        assert len(seqlens) > 0, seqlens
        cached_elements = torch.tensor(seqlens, dtype=torch.long)
        positions = torch.cat([torch.arange(pos, pos + seqlen) for pos, seqlen in zip(seqpos, seqlens)]).long()
        batch_idx = torch.tensor(sum([[i] * seqlen for i, seqlen in enumerate(seqlens)], []), dtype=torch.long)
        cache_positions = positions + batch_idx * self.max_seq_len

        first_prefill = seqpos[0] == 0
        subsequent_prefill = any(seqlen > 1 for seqlen in seqlens)
        if first_prefill:
            assert all([pos == 0 for pos in seqpos]), seqpos
            mask = BlockDiagonalCausalMask.from_seqlens(seqlens).make_local_attention(self.max_seq_len)
        elif subsequent_prefill:
            mask = BlockDiagonalMask.from_seqlens(
                q_seqlen=seqlens,
                kv_seqlen=[s + cached_s.clamp(max=self.max_seq_len).item()
                           for (s, cached_s) in zip(seqlens, self.kv_seqlens)],
            ).make_local_attention_from_bottomright(self.max_seq_len)
        else:
            mask = BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
                q_seqlen=seqlens,
                kv_padding=self.max_seq_len,
                kv_seqlen=(self.kv_seqlens + cached_elements).clamp(max=self.max_seq_len).tolist(),
            )
        return CacheInputMetadata(positions=positions, cache_positions=cache_positions,
                                  prefill=first_prefill or subsequent_prefill, mask=mask, seqlens=seqlens)


# ---------------------------------------------------------------- mistral_inference/rope.py, transformer_layers.py
def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, None, :]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(-2)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(keys, values, repeats, dim):
    keys = torch.repeat_interleave(keys, repeats=repeats, dim=dim)
    values = torch.repeat_interleave(values, repeats=repeats, dim=dim)
    return keys, values


@dataclass
class TransformerArgs:
    dim: int = 32
    n_layers: int = 2
    head_dim: int = 8
    hidden_dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    norm_eps: float = 1e-5
    vocab_size: int = 80
    rope_theta: float = 1e6
    max_batch_size: int = 4


class Attention(nn.Module):
    def __init__(self, dim, n_heads, head_dim, n_kv_heads):
        super().__init__()
        self.n_heads, self.head_dim, self.n_kv_heads = n_heads, head_dim, n_kv_heads
        self.repeats = self.n_heads // self.n_kv_heads
        self.scale = self.head_dim ** -0.5
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x, freqs_cis, cache=None, mask=None):
        assert mask is None or cache is None
        seqlen_sum, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(seqlen_sum, self.n_heads, self.head_dim)
        xk = xk.view(seqlen_sum, self.n_kv_heads, self.head_dim)
        xv = xv.view(seqlen_sum, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        if cache is None:
            key, val = xk, xv
        elif cache.prefill:
            key, val = cache.interleave_kv(xk, xv)
            cache.update(xk, xv)
        else:
            cache.update(xk, xv)
            key, val = cache.key, cache.value
            key = key.view(seqlen_sum * cache.max_seq_len, self.n_kv_heads, self.head_dim)
            val = val.view(seqlen_sum * cache.max_seq_len, self.n_kv_heads, self.head_dim)
        key, val = repeat_kv(key, val, self.repeats, dim=1)
        xq, key, val = xq[None, ...], key[None, ...], val[None, ...]
        output = memory_efficient_attention(xq, key, val, mask if cache is None else cache.mask)
        output = output.reshape(seqlen_sum, self.n_heads * self.head_dim)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        out = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return out * self.weight


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args.dim, args.n_heads, args.head_dim, args.n_kv_heads)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x, freqs_cis, cache=None, mask=None):
        r = self.attention.forward(self.attention_norm(x), freqs_cis, cache, mask)
        h = x + r
        return h + self.feed_forward.forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.n_local_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(args.head_dim, 128, args.rope_theta)

    def forward(self, input_ids, seqlens, cache=None):
        assert sum(seqlens) == input_ids.shape[0], (sum(seqlens), input_ids.shape[0])
        h = self.tok_embeddings(input_ids)
        if cache is not None:
            input_metadata = cache.get_input_metadata(seqlens)
            positions = input_metadata.positions
            att_mask = None
        else:
            positions = torch.cat([torch.arange(s) for s in seqlens])
            att_mask = BlockDiagonalCausalMask.from_seqlens(seqlens)
        freqs_cis = self.freqs_cis[positions]
        for local_layer_id, layer in enumerate(self.layers):
            cache_view = cache.get_view(local_layer_id, input_metadata) if cache is not None else None
            h = layer(h, freqs_cis, cache_view, att_mask if cache is None else None)
        if cache is not None:
            cache.update_seqlens(seqlens)
        return self.output(self.norm(h)).float()


# ---------------------------------------------------------------- mistral_inference/generate.py
def sample(logits, temperature, top_p):
    assert temperature == 0
    next_token = torch.argmax(logits, dim=-1).unsqueeze(0)
    return next_token.reshape(-1)


@torch.inference_mode()
def generate(encoded_prompts, model, *, max_tokens, temperature, chunk_size=None, eos_id=None):
    model = model.eval()
    B, V = len(encoded_prompts), model.args.vocab_size
    seqlens = [len(x) for x in encoded_prompts]
    cache_window = max(seqlens) + max_tokens
    cache = BufferCache(model.n_local_layers, model.args.max_batch_size, cache_window,
                        model.args.n_kv_heads, model.args.head_dim)
    cache.to(device="cpu", dtype=torch.float32)
    cache.reset()

    logprobs: List[List[float]] = [[] for _ in range(B)]
    last_token_prelogits = None
    max_prompt_len = max(seqlens)
    if chunk_size is None:
        chunk_size = max_prompt_len

    for s in range(0, max_prompt_len, chunk_size):
        prompt_chunks = [p[s: s + chunk_size] for p in encoded_prompts]
        assert all(len(p) > 0 for p in prompt_chunks)
        prelogits = model.forward(torch.tensor(sum(prompt_chunks, []), dtype=torch.long),
                                  seqlens=[len(p) for p in prompt_chunks], cache=cache)
        logits = torch.log_softmax(prelogits, dim=-1)
        if last_token_prelogits is not None:
            last_token_logits = torch.log_softmax(last_token_prelogits, dim=-1)
            for i_seq in range(B):
                logprobs[i_seq].append(last_token_logits[i_seq, prompt_chunks[i_seq][0]].item())
        offset = 0
        for i_seq, sequence in enumerate(prompt_chunks):
            logprobs[i_seq].extend([logits[offset + i, sequence[i + 1]].item() for i in range(len(sequence) - 1)])
            offset += len(sequence)
        last_token_prelogits = prelogits.index_select(
            0, torch.tensor([len(p) for p in prompt_chunks]).cumsum(dim=0) - 1)
        assert last_token_prelogits.shape == (B, V)

    generated_tensors = []
    is_finished = torch.tensor([False for _ in range(B)])
    for _ in range(max_tokens):
        next_token = sample(last_token_prelogits, temperature=temperature, top_p=0.8)
        if eos_id is not None:
            is_finished = is_finished ^ (next_token == eos_id)
        if is_finished.all():
            break
        last_token_logits = torch.log_softmax(last_token_prelogits, dim=-1)
        for i in range(B):
            logprobs[i].append(last_token_logits[i, next_token[i]].item())
        generated_tensors.append(next_token[:, None])
        last_token_prelogits = model.forward(next_token, seqlens=[1] * B, cache=cache)
        assert last_token_prelogits.shape == (B, V)
    generated_tokens = torch.cat(generated_tensors, 1).tolist() if generated_tensors else []
    return generated_tokens, logprobs


# ---------------------------------------------------------------- reference: one prompt, plain causal, no cache
def reference_logits(model, tokens):
    """Every layer by hand for one sequence: SDPA is_causal=True, positions 0..T-1."""
    x = torch.tensor(tokens)
    T = x.shape[0]
    h = model.tok_embeddings(x)
    freqs = model.freqs_cis[:T]
    for layer in model.layers:
        a = layer.attention
        hn = layer.attention_norm(h)
        q = a.wq(hn).view(T, a.n_heads, a.head_dim)
        k = a.wk(hn).view(T, a.n_kv_heads, a.head_dim)
        v = a.wv(hn).view(T, a.n_kv_heads, a.head_dim)
        q, k = apply_rotary_emb(q, k, freqs)
        k, v = repeat_kv(k, v, a.repeats, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        h = h + a.wo(o.transpose(0, 1).reshape(T, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h)).float()


def main():
    args = TransformerArgs()
    model = Transformer(args).eval()
    prompts = [
        [1, 14, 52, 7, 33],
        [1, 9, 27, 61, 4, 70, 18, 45],
        [1, 40, 3, 22, 57, 11, 6],
    ]
    max_tokens = 5
    for chunk_size in (None, 4):
        gen, logprobs = generate(prompts, model, max_tokens=max_tokens, temperature=0.0, chunk_size=chunk_size)
        with torch.inference_mode():
            for b, p in enumerate(prompts):
                seq = list(p)
                for _ in range(max_tokens):
                    seq.append(int(reference_logits(model, seq)[-1].argmax()))
                assert gen[b] == seq[len(p):], (chunk_size, b, gen[b], seq[len(p):])
                ref_lp = torch.log_softmax(reference_logits(model, seq[:-1]), dim=-1)
                ref = [ref_lp[i, seq[i + 1]].item() for i in range(len(seq) - 1)]
                torch.testing.assert_close(torch.tensor(logprobs[b]), torch.tensor(ref), atol=1e-4, rtol=1e-4)
        print(f"chunk_size={chunk_size}: generations and log-probs match per-prompt causal runs: {gen}")


if __name__ == "__main__":
    main()
