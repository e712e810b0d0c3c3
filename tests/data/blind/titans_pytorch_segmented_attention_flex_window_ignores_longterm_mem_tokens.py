# lucidrains/titans-pytorch commit 706f304 ("oops, flex attn did not account for long term mem tokens").
# SegmentedAttention (the MAC transformer's attention) runs block-diagonal causal attention over segments of
# segment_len + num_longterm_mem_tokens positions, with persistent-memory keys prepended. When no flex_attn_fn is
# handed in, forward_flex built its own FlexAttention block mask with window_size = self.segment_len, so with
# long-term memory tokens the flex windows are one token shorter than the segments the model lays out (and the
# non-flex path uses): windows drift off the segment boundaries. Fix: keep self.total_segment_len and build the block
# mask with it. Trimmed port of titans_pytorch/mac_transformer.py at 706f304^, run the way the repo's assert_flex.py
# runs SegmentedAttention (use_flex_attn=True, then disable_flex_attn=True). On CPU: forward_flex is called directly
# (forward dispatches to it only for CUDA tensors), create_block_mask with _compile=False, flex_attention eager;
# einops, rotary_embedding_torch's RotaryEmbedding and x-transformers' Attend(causal=True) written out with torch.
import sys
import warnings
from functools import partial
from math import ceil
from typing import Callable

import torch
import torch.nn.functional as F
from torch import cat, nn
from torch.nn import Linear, Module

warnings.filterwarnings("ignore")

FIXED = "--fixed" in sys.argv

flex_attention = None

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if torch.cuda.is_available():
        flex_attention = torch.compile(flex_attention)
except ImportError:
    pass


def create_mac_block_mask(seq_len, window_size, persist_mem_len):
    def create_mac_mask(b, h, q_idx, kv_idx):
        is_persist_mem = kv_idx < persist_mem_len
        causal_mask = q_idx >= (kv_idx - persist_mem_len)
        block_diagonal = (q_idx // window_size) == ((kv_idx - persist_mem_len) // window_size)
        return is_persist_mem | (~is_persist_mem & (causal_mask & block_diagonal))

    block_mask = create_block_mask(
        create_mac_mask, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len + persist_mem_len,
        device="cpu", _compile=False,
    )
    return block_mask


LinearNoBias = partial(Linear, bias=False)


def exists(v):
    return v is not None


def identity(t):
    return t


def round_up_multiple(seq, mult):
    return ceil(seq / mult) * mult


def pad_and_segment_with_inverse(seq, segment_len):
    batch, seq_len = seq.shape[:2]

    need_segment = seq_len >= segment_len

    if not need_segment:
        return seq, identity

    next_seq_len_mult = round_up_multiple(seq_len, segment_len)

    padding = next_seq_len_mult - seq_len
    needs_pad = padding > 0

    if needs_pad:
        seq = F.pad(seq, (0, 0, 0, padding))

    # 'b (w n) d -> (b w) n d'
    seq = seq.reshape(-1, segment_len, seq.shape[-1])

    def inverse(out):
        # '(b w) n d -> b (w n) d'
        out = out.reshape(batch, -1, out.shape[-1])

        if needs_pad:
            out = out[:, :-padding]

        return out

    return seq, inverse


class RotaryEmbedding(Module):
    # rotary_embedding_torch.RotaryEmbedding(dim_head): lang freqs, theta 10000, interleaved pairs
    def __init__(self, dim, theta=10000):
        super().__init__()
        self.register_buffer("freqs", 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    @staticmethod
    def rotate_half(x):
        x = x.unflatten(-1, (-1, 2))
        x1, x2 = x.unbind(dim=-1)
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    def rotate(self, t, offset=0):
        seq_len = t.shape[-2]
        pos = torch.arange(seq_len, device=t.device, dtype=self.freqs.dtype) + offset
        freqs = torch.einsum("i,j->ij", pos, self.freqs).repeat_interleave(2, dim=-1)
        return t * freqs.cos() + self.rotate_half(t) * freqs.sin()

    def rotate_queries_with_cached_keys(self, q, k):
        q_len, k_len = q.shape[-2], k.shape[-2]
        return self.rotate(q, offset=k_len - q_len), self.rotate(k)


class Attend(Module):
    # x_transformers.attend.Attend(causal=True), non-flash path
    def __init__(self, causal=False):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        scale = q.shape[-1] ** -0.5
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * scale
        i, j = sim.shape[-2:]
        if self.causal:
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=q.device).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return out, attn


class SegmentedAttention(Module):
    def __init__(
        self,
        dim,
        segment_len,
        num_persist_mem_tokens=0,
        num_longterm_mem_tokens=0,
        dim_head=64,
        heads=8,
        accept_value_residual=False,
        attend_kwargs: dict = dict(),
        use_flex_attn=False,
    ):
        super().__init__()
        self.norm = nn.RMSNorm(dim)

        dim_inner = dim_head * heads

        self.rotary_emb = RotaryEmbedding(dim_head)

        self.attend = Attend(causal=True, **attend_kwargs)

        self.to_qkv = LinearNoBias(dim, dim_inner * 3)
        self.to_out = LinearNoBias(dim_inner, dim)

        self.to_learned_v_mix = nn.Sequential(
            nn.Linear(dim, heads),
            nn.Sigmoid(),
        ) if accept_value_residual else None

        self.segment_len = segment_len
        self.num_longterm_mem_tokens = num_longterm_mem_tokens

        total_segment_len = segment_len + num_longterm_mem_tokens
        if FIXED:
            self.total_segment_len = total_segment_len

        self.heads = heads
        # 'b n (h d) -> b h n d'
        self.split_heads = lambda t: t.unflatten(-1, (heads, -1)).transpose(1, 2)
        # 'b h n d -> b n (h d)'
        self.merge_heads = lambda t: t.transpose(1, 2).flatten(-2)

        self.persistent_memory = nn.Parameter(torch.zeros(2, heads, num_persist_mem_tokens, dim_head))

        # flex attn related

        assert not (use_flex_attn and not exists(flex_attention)), "you need to be on the latest pytorch"
        self.use_flex_attn = use_flex_attn

        self.segment_len = segment_len
        self.num_persist_mem_tokens = num_persist_mem_tokens

    def forward_flex(
        self,
        seq,
        value_residual=None,
        flex_attn_fn: Callable | None = None,
    ):
        assert not (exists(value_residual) ^ exists(self.to_learned_v_mix))

        batch, seq_len = seq.shape[:2]

        # attention

        seq = self.norm(seq)

        q, k, v = self.to_qkv(seq).chunk(3, dim=-1)
        q, k, v = map(self.split_heads, (q, k, v))

        # value residual

        orig_v = v

        if exists(self.to_learned_v_mix):
            mix = self.to_learned_v_mix(seq).transpose(1, 2).unsqueeze(-1)  # 'b n h -> b h n 1'
            v = v.lerp(value_residual, mix)

        # take care of persistent memory key / values

        pmk, pmv = self.persistent_memory.unsqueeze(1).expand(-1, batch, -1, -1, -1)  # 'kv h n d -> kv b h n d'

        # relative positions

        q, k = self.rotary_emb.rotate_queries_with_cached_keys(q, k)

        # persistent memory

        k = cat((pmk, k), dim=-2)
        v = cat((pmv, v), dim=-2)

        # prep flex attention

        if not exists(flex_attn_fn):
            if FIXED:
                block_mask = create_mac_block_mask(seq_len, self.total_segment_len, self.num_persist_mem_tokens)
            else:
                block_mask = create_mac_block_mask(seq_len, self.segment_len, self.num_persist_mem_tokens)

            flex_attn_fn = partial(flex_attention, block_mask=block_mask)

        # attention

        out = flex_attn_fn(q, k, v)

        out = self.merge_heads(out)

        out = self.to_out(out)

        return out, orig_v

    def forward(
        self,
        seq,
        value_residual=None,
        flex_attn_fn: Callable | None = None,
        disable_flex_attn=False,
    ):
        if seq.is_cuda and self.use_flex_attn and not disable_flex_attn:
            return self.forward_flex(seq, value_residual, flex_attn_fn)

        assert not (exists(value_residual) ^ exists(self.to_learned_v_mix))

        segment_len, num_longterm_mem_tokens = self.segment_len, self.num_longterm_mem_tokens
        total_segment_len = segment_len + num_longterm_mem_tokens

        batch, seq_len = seq.shape[:2]

        # auto pad to multiple

        seq, inverse_segment = pad_and_segment_with_inverse(seq, total_segment_len)

        # attention

        seq = self.norm(seq)

        q, k, v = self.to_qkv(seq).chunk(3, dim=-1)
        q, k, v = map(self.split_heads, (q, k, v))

        # value residual

        orig_v = v

        if exists(self.to_learned_v_mix):
            mix = self.to_learned_v_mix(seq).transpose(1, 2).unsqueeze(-1)
            v = v.lerp(value_residual, mix)

        # take care of persistent memory key / values

        pmk, pmv = self.persistent_memory.unsqueeze(1).expand(-1, seq.shape[0], -1, -1, -1)

        # relative positions

        q, k = self.rotary_emb.rotate_queries_with_cached_keys(q, k)

        # persistent memory

        k = cat((pmk, k), dim=-2)
        v = cat((pmv, v), dim=-2)

        # attention

        out, _ = self.attend(q, k, v)

        out = self.merge_heads(out)

        out = self.to_out(out)

        out = inverse_segment(out)

        return out, orig_v


def main():
    torch.manual_seed(0)

    # as in assert_flex.py (smaller): one persistent and one long-term memory token per segment
    attn = SegmentedAttention(
        dim=64,
        segment_len=8,
        num_persist_mem_tokens=1,
        num_longterm_mem_tokens=1,
        dim_head=32,
        heads=2,
        use_flex_attn=True,
    )

    seq = torch.randn(1, 61, 64)

    with torch.no_grad():
        out_flex, _ = attn.forward_flex(seq)
        out_non_flex, _ = attn(seq, disable_flex_attn=True)

    print("flex out[0, 9:12, :3]:", [[round(x, 4) for x in row] for row in out_flex[0, 9:12, :3].tolist()])
    print("non-flex out[0, 9:12, :3]:", [[round(x, 4) for x in row] for row in out_non_flex[0, 9:12, :3].tolist()])


if __name__ == "__main__":
    main()
