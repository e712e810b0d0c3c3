"""Correct program: mistral-finetune's packed training step (xformers block-diagonal causal mask).

Ported (shrunk) from mistralai/mistral-finetune @1de7511461847171bcbb3cbfeba50ad1380b942d:
  * finetune/data/dataset.py sequence_iterator: samples are cut into pieces and concatenated until
    a row holds exactly seq_len tokens; `sizes` records every piece; a piece whose loss mask is all
    False is dropped; a sample that does not fit continues (as a new piece) in the next row; in
    eval mode (is_finite) the last row is padded with one extra piece of zeros, mask False.
  * finetune/data/data_loader.py BatchList.create_batch: the rows are flattened into ONE sequence
    and their sizes concatenated (sum(self.sizes, [])); y_mask is None when it is all True.
  * model/transformer.py Transformer.forward: positions_from_sizes(seqlens) restarts RoPE positions
    at each piece, att_mask = BlockDiagonalCausalMask.from_seqlens(seqlens); Attention.forward runs
    memory_efficient_attention on (1, sum(seqlens), H, D) with GQA repeat_interleave.
  * model/rope.py (complex RoPE, pairs adjacent), finetune/loss.py compute_loss_with_mask.

Stand-in: xformers is replaced by plain torch with the same semantics -- BlockDiagonalCausalMask
materialises a (total, total) bias, 0 inside each piece's lower triangle and -inf elsewhere;
memory_efficient_attention is softmax(q k^T / sqrt(D) + bias) v.  Float64 instead of float32/bf16.

Reference: every piece run alone through the same weights with torch SDPA is_causal=True (no
bias object, positions 0..n-1), losses summed over masked targets and divided by their count.
"""
import dataclasses
import operator
from functools import reduce
from typing import List

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
DT = torch.float64


# ---- xformers stand-in (plain torch, same semantics) -------------------------------------------
class BlockDiagonalCausalMask:
    def __init__(self, seqstarts):
        self.seqstarts = seqstarts

    @classmethod
    def from_seqlens(cls, seqlens):
        starts = [0]
        for s in seqlens:
            starts.append(starts[-1] + s)
        return cls(starts)

    def materialize(self, shape, dtype):
        total = shape[-1]
        bias = torch.full((total, total), float("-inf"), dtype=dtype)
        for a, b in zip(self.seqstarts[:-1], self.seqstarts[1:]):
            n = b - a
            blk = torch.zeros(n, n, dtype=dtype).masked_fill(
                ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            bias[a:b, a:b] = blk
        return bias


def memory_efficient_attention(q, k, v, attn_bias):  # (B, M, H, K)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s + attn_bias.materialize(s.shape, s.dtype)
    return (s.softmax(-1) @ v).transpose(1, 2)


# ---- model/rope.py ------------------------------------------------------------------------------
def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].to(DT) / dim))
    t = torch.arange(end)
    freqs = torch.outer(t, freqs).to(DT)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2).contiguous())
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2).contiguous())
    freqs_cis = freqs_cis[:, None, :]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(2)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


# ---- model/transformer.py (tiny) ----------------------------------------------------------------
@dataclasses.dataclass
class ModelArgs:
    dim: int = 16
    n_layers: int = 2
    head_dim: int = 4
    hidden_dim: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    norm_eps: float = 1e-5
    vocab_size: int = 23
    rope_theta: float = 10000.0


def repeat_kv(keys, values, repeats, dim):
    keys = torch.repeat_interleave(keys, repeats=repeats, dim=dim)
    values = torch.repeat_interleave(values, repeats=repeats, dim=dim)
    return keys, values


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.repeats = self.n_heads // self.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x, freqs_cis, mask):
        seqlen_sum, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(seqlen_sum, self.n_heads, self.head_dim)
        xk = xk.view(seqlen_sum, self.n_kv_heads, self.head_dim)
        xv = xv.view(seqlen_sum, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        key, val = repeat_kv(xk, xv, self.repeats, dim=1)
        xq, key, val = xq[None, ...], key[None, ...], val[None, ...]
        if mask is None:  # reference path only: one piece alone, plain causal SDPA
            output = F.scaled_dot_product_attention(
                xq.transpose(1, 2), key.transpose(1, 2), val.transpose(1, 2), is_causal=True
            ).transpose(1, 2)
        else:
            output = memory_efficient_attention(xq, key, val, mask)
        return self.wo(output.reshape(seqlen_sum, -1))


class FeedForward(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis, att_mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, att_mask)
        return h + self.feed_forward(self.ffn_norm(h))


def positions_from_sizes(sizes):
    return torch.tensor(reduce(operator.iadd, [list(range(s)) for s in sizes], []), dtype=torch.long)


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(args.head_dim, 128, theta=args.rope_theta)

    def forward(self, input_ids, seqlens: List[int], use_block_mask=True):
        assert sum(seqlens) == input_ids.shape[0], (sum(seqlens), input_ids.shape[0])
        h = self.tok_embeddings(input_ids)
        positions = positions_from_sizes(seqlens)
        att_mask = BlockDiagonalCausalMask.from_seqlens(seqlens) if use_block_mask else None
        freqs_cis = self.freqs_cis[positions]
        for layer in self.layers:
            h = layer(h, freqs_cis, att_mask)
        return self.output(self.norm(h))


def compute_loss_with_mask(logits, target, target_mask):
    if target_mask is None:
        return F.cross_entropy(logits, target, reduction="mean")
    mb_loss = F.cross_entropy(logits, target, reduction="none")
    return torch.sum(mb_loss * target_mask) / torch.sum(target_mask)


# ---- finetune/data/dataset.py sequence_iterator + data_loader BatchList (ported) ---------------
@dataclasses.dataclass
class TokenSample:
    tokens: List[int]
    masks: List[bool]


@dataclasses.dataclass
class SequenceMaskAndSizes:
    x: List[int]
    y: List[int]
    mask: List[bool]
    sizes: List[int]


def sequence_iterator(ds_it, seq_len, is_finite):
    x_buffer, y_buffer, mask_buffer, sizes = [], [], [], []
    n_missing = seq_len
    for sample in ds_it:
        tokens, mask = sample.tokens, sample.masks[1:]
        x, y = tokens[:-1], tokens[1:]
        cur_pos = 0
        while cur_pos < len(x):
            size = len(x[cur_pos: cur_pos + n_missing])
            curr_mask = mask[cur_pos: cur_pos + n_missing]
            if not any(curr_mask):
                cur_pos += size
                continue
            x_buffer.extend(x[cur_pos: cur_pos + n_missing])
            y_buffer.extend(y[cur_pos: cur_pos + n_missing])
            mask_buffer.extend(curr_mask)
            n_missing -= size
            sizes.append(size)
            cur_pos += size
            if n_missing == 0:
                if any(mask_buffer):
                    yield SequenceMaskAndSizes(x=x_buffer, y=y_buffer, mask=mask_buffer, sizes=sizes)
                x_buffer, y_buffer, mask_buffer, sizes = [], [], [], []
                n_missing = seq_len
    if is_finite:
        if any(mask_buffer):
            mask_buffer.extend(n_missing * [False])
            x_buffer.extend(n_missing * [0])
            y_buffer.extend(n_missing * [0])
            sizes.append(n_missing)
            yield SequenceMaskAndSizes(x=x_buffer, y=y_buffer, mask=mask_buffer, sizes=sizes)


def create_batch(rows):
    flat = lambda ll, dt: np.array([el for sub in ll for el in sub], dtype=dt)  # noqa: E731
    x = flat([r.x for r in rows], np.int64)
    y = flat([r.y for r in rows], np.int64)
    sizes = sum([r.sizes for r in rows], [])
    y_mask = flat([r.mask for r in rows], bool)
    return x, y, sizes, (None if y_mask.all() else y_mask)


# ---- data: instruct samples (prompt tokens False, answer tokens True) --------------------------
g = torch.Generator().manual_seed(1)


def sample(n_prompt, n_answer):
    toks = torch.randint(1, 23, (n_prompt + n_answer,), generator=g).tolist()
    return TokenSample(toks, [False] * n_prompt + [True] * n_answer)


samples = [sample(4, 5), sample(6, 8), sample(6, 0), sample(3, 8), sample(2, 3), sample(5, 9)]
SEQ_LEN = 16
rows = list(sequence_iterator(iter(samples), SEQ_LEN, is_finite=True))
x, y, sizes, y_mask = create_batch(rows)
print("rows:", len(rows), "sizes:", sizes)

model = Transformer(ModelArgs()).to(DT).eval()
with torch.no_grad():
    x_t, y_t = torch.from_numpy(x), torch.from_numpy(y)
    logits = model(x_t, seqlens=sizes)
    mask_t = torch.from_numpy(y_mask).to(DT)
    loss = compute_loss_with_mask(logits, y_t, mask_t)

    # reference: each piece alone, no block mask object, positions from 0
    worst, tot, cnt, start = 0.0, 0.0, 0.0, 0
    for n in sizes:
        ref = model(x_t[start:start + n], seqlens=[n], use_block_mask=False)
        worst = max(worst, (logits[start:start + n] - ref).abs().max().item())
        ce = F.cross_entropy(ref, y_t[start:start + n], reduction="none")
        tot += (ce * mask_t[start:start + n]).sum().item()
        cnt += mask_t[start:start + n].sum().item()
        start += n
    ref_loss = tot / cnt
print(f"packed logits vs each piece alone: max diff {worst:.2e}")
print(f"masked loss packed {loss.item():.12f} vs reference {ref_loss:.12f}")
worst = max(worst, abs(loss.item() - ref_loss))
ok = worst < 1e-10
print("MATCH" if ok else "MISMATCH", f"max diff {worst:.2e}")
assert ok
