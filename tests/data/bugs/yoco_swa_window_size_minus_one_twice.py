"""YOCO self-decoder (microsoft/unilm YOCO): the sliding-window attention subtracts one from the
window twice, so in training every query sees one key fewer than ``sliding_window``.

Citation: microsoft/unilm#1612 ("Maybe some bugs of YOCO", point 1), fixed by commit f4f7b27
("fix swa", merged as 53ed1159), YOCO/yoco/models/decoder/sliding_window_attention.py.

The bug: ``SlidingWindowAttention.__init__`` stores
``self.window_size = args.sliding_window - 1  # compatible with flash attention`` and ``forward``
then calls ``flash_attn_func(q, k, v, causal=True, window_size=(self.window_size - 1, 0))``: flash's
left window is ``sliding_window - 2``, so each query attends itself and ``sliding_window - 2``
earlier keys, ``sliding_window - 1`` keys in all instead of ``sliding_window``.

The fix: ``self.window_size = args.sliding_window`` (the forward keeps ``window_size - 1``).
The same commit also makes the incremental (cached) path hand the kernel the concatenated
``key, value``; that path is kept here as written but this program runs the training forward
(``incremental_state=None``), where only the window matters.

Ported at toy sizes with random weights: YOCOArgs (a dataclass, as in yoco.py) with
sliding_window=4, a SelfDecoder of two SlidingWindowAttention layers (RMSNorm, SwiGLU FFN,
interleaved rotary from build_rel_pos), ColumnParallelLinear/RowParallelLinear as nn.Linear, and
flash_attn_func replaced by a CPU stand-in with flash's window_size convention (query i sees keys
i - window_size[0] .. i + window_size[1], inclusive, bottom-right aligned) over SDPA. The next-token
loss of a batch of 2 sequences of 12 tokens is printed.
"""

import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None):
    # CPU stand-in for flash_attn.flash_attn_func: (batch, seqlen, nheads, headdim) layout.
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    row = torch.arange(seqlen_q).view(-1, 1) + (seqlen_k - seqlen_q)
    col = torch.arange(seqlen_k).view(1, -1)
    left, right = window_size
    if causal:
        right = 0
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if left >= 0:
        allowed &= col >= row - left
    if right >= 0:
        allowed &= col <= row + right
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed, scale=softmax_scale
    )
    return out.transpose(1, 2)


def apply_rotary_emb(x, cos, sin, interleaved=False):
    # x: (batch, seqlen, nheads, headdim); cos, sin: (seqlen, headdim / 2)
    assert interleaved
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2)


@dataclass
class YOCOArgs:
    dim: int
    n_layers: int
    hidden_dim: int
    n_self_heads: int
    n_attn_heads: int
    n_attn_kv_heads: int
    vocab_size: int

    max_batch_size: int = 0
    max_seq_len: int = -1
    model_parallel_size: int = 1
    load_checkpoint: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    sliding_window: Optional[int] = None


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class FeedForwardNetwork(nn.Module):
    def __init__(self, embed_dim, ffn_dim, load_checkpoint=False):
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, ffn_dim, bias=False)
        self.gate = nn.Linear(embed_dim, ffn_dim, bias=False)
        self.fc2 = nn.Linear(ffn_dim, embed_dim, bias=False)

    def forward(self, x):
        return self.fc2(F.silu(self.gate(x)) * self.fc1(x))


class SlidingWindowAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.embed_dim = args.dim
        self.num_heads = args.n_self_heads // args.model_parallel_size
        if FIXED:
            self.window_size = args.sliding_window
        else:
            self.window_size = args.sliding_window - 1  # compatible with flash attention

        self.head_dim = args.dim // args.n_self_heads

        self.q_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.out_proj = nn.Linear(args.dim, args.dim, bias=False)

    def forward(
        self,
        x,
        rel_pos,
        start_pos=0,
        incremental_state=None,
    ):
        bsz, tgt_len, embed_dim = x.size()
        src_len = tgt_len

        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)

        q = q.view(bsz, tgt_len, self.num_heads, self.head_dim)
        k = k.view(bsz, src_len, self.num_heads, self.head_dim)
        v = v.view(bsz, src_len, self.num_heads, self.head_dim)

        q = apply_rotary_emb(q, *rel_pos, interleaved=True)
        k = apply_rotary_emb(k, *rel_pos, interleaved=True)
        if incremental_state is not None:
            if "prev_key" not in incremental_state:
                incremental_state["prev_key"] = torch.empty(self.args.max_batch_size, self.window_size, self.num_heads, self.head_dim, device=x.device, dtype=x.dtype)
                incremental_state["prev_value"] = torch.empty(self.args.max_batch_size, self.window_size, self.num_heads, self.head_dim, device=x.device, dtype=x.dtype)

            key = torch.cat([incremental_state["prev_key"][:bsz, :start_pos], k], dim=1)
            value = torch.cat([incremental_state["prev_value"][:bsz, :start_pos], v], dim=1)
            if key.shape[1] > self.window_size:
                incremental_state["prev_key"][:bsz] = key[:, -self.window_size:]
                incremental_state["prev_value"][:bsz] = value[:, -self.window_size:]
            else:
                incremental_state["prev_key"][:bsz, start_pos : start_pos + tgt_len] = k
                incremental_state["prev_value"][:bsz, start_pos : start_pos + tgt_len] = v
        else:
            key, value = k, v

        if FIXED:
            attn = flash_attn_func(q, key, value, causal=True, window_size=(self.window_size - 1, 0))
        else:
            attn = flash_attn_func(q, k, v, causal=True, window_size=(self.window_size - 1, 0))
        attn = attn.reshape(bsz, tgt_len, self.head_dim * self.num_heads)

        attn = self.out_proj(attn)
        return attn


class DecoderLayer(nn.Module):
    def __init__(self, args: YOCOArgs, is_cross_layer=False):
        super().__init__()
        self.args = args
        self.is_cross_layer = is_cross_layer
        self.mixer = SlidingWindowAttention(args)
        self.mixer_layer_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn = FeedForwardNetwork(args.dim, args.hidden_dim, args.load_checkpoint)
        self.final_layer_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, start_pos=0, key=None, value=None, rel_pos=None, incremental_state=None, is_prefilling=False):
        residual = x
        x = self.mixer_layer_norm(x)
        x = self.mixer(
            x,
            rel_pos=rel_pos,
            start_pos=start_pos,
            incremental_state=incremental_state,
        )
        x = x + residual
        residual = x
        x = self.final_layer_norm(x)
        x = self.ffn(x)
        x = x + residual
        return x


class SelfDecoder(nn.Module):
    def __init__(self, args: YOCOArgs):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList([DecoderLayer(args, is_cross_layer=False) for idx in range(args.n_layers // 2)])
        self.head_dim = args.dim // args.n_self_heads
        self.block_size = 256
        self._precomputed_freqs_cis = None

    def build_rel_pos(self, x, start_pos):
        if self._precomputed_freqs_cis is None:
            angle = 1.0 / (self.args.rope_theta ** torch.linspace(0, 1, self.head_dim // 2, dtype=torch.float, device=x.device))
            index = torch.arange(self.args.max_seq_len).to(angle)
            self._precomputed_freqs_cis = index[:, None] * angle

        cos = torch.cos(self._precomputed_freqs_cis[start_pos:start_pos + x.size(1)])
        sin = torch.sin(self._precomputed_freqs_cis[start_pos:start_pos + x.size(1)])
        rel_pos = (cos.to(x.dtype), sin.to(x.dtype))
        return rel_pos

    def forward(self, x, incremental_state=None, is_prefilling=False, start_pos=0):
        rel_pos = self.build_rel_pos(x, start_pos)
        for idx, layer in enumerate(self.layers):
            if incremental_state is not None and idx not in incremental_state:
                incremental_state[idx] = {}
            x = layer(
                x,
                start_pos=start_pos,
                rel_pos=rel_pos,
                incremental_state=incremental_state[idx] if incremental_state is not None else None,
                is_prefilling=is_prefilling,
            )
        return x


class TinySelfDecoderLM(nn.Module):
    def __init__(self, args: YOCOArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.self_decoder = SelfDecoder(args)
        self.layer_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output_projection = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, x):
        h = self.self_decoder(self.embed_tokens(x))
        return self.output_projection(self.layer_norm(h))


def main():
    torch.manual_seed(0)
    args = YOCOArgs(
        dim=32, n_layers=4, hidden_dim=64, n_self_heads=4, n_attn_heads=4, n_attn_kv_heads=2,
        vocab_size=50, max_batch_size=2, max_seq_len=32, sliding_window=4,
    )
    model = TinySelfDecoderLM(args).eval()
    src_tokens = torch.randint(0, args.vocab_size, (2, 12))
    with torch.no_grad():
        logits = model(src_tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab_size), src_tokens[:, 1:].reshape(-1))
    print("fixed" if FIXED else "buggy")
    print("loss:", round(loss.item(), 6))
    print("logits[0, -1, :5]:", [round(v, 4) for v in logits[0, -1, :5].tolist()])


if __name__ == "__main__":
    main()
