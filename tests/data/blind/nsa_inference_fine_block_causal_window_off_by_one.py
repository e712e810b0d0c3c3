"""native-sparse-attention-pytorch: cached decoding takes the wrong number of keys for the block-causal fine branch.

Citation: lucidrains/native-sparse-attention-pytorch commit d1f5d41 ("fix an off by one error in
inference for block causal sliding window in fine attention, ...").

Bug: in `SparseAttention.forward_inference` the new token is at position `seq_len - 1`
(`seq_len = cache_len + 1`).  The fine-attention branch always attends to the keys of the
token's own selection block (block-causal diagonal), taken from the end of the cached keys:

    fine_sliding_window = (seq_len % self.selection_block_size) + 1
    fk = k[..., -fine_sliding_window:, :]

For a token that is the j-th of its block (j = (seq_len - 1) % block + 1 keys belong to the
block) this takes one key more, reaching back into the previous block, and for the last token
of a block (seq_len % block == 0) it takes only the token itself instead of the whole block.
Training (`forward`) uses the block-causal diagonal, so decoding disagreed with it at every
block boundary.
Fix: `fine_sliding_window = ((seq_len - 1) % self.selection_block_size) + 1`.

This program keeps forward_inference's cache layout (rotated keys/values concatenated to the
cache, seq_len = cache_len + 1) and its fine (block-causal) and sliding-window branches with the
learned sigmoid strategy combine, with `num_selected_blocks=0` so that no compressed blocks
are selected (the compressed branch, which does not touch these keys, is left out).  It decodes
12 tokens one at a time with selection_block_size=4.
"""
import sys

import torch
from torch import nn, tensor

FIXED = "--fixed" in sys.argv


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, theta=10000):
        super().__init__()
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))

    def rotate_queries_or_keys(self, t, offset=0):
        seq_len = t.shape[-2]
        pos = torch.arange(offset, offset + seq_len).float()
        freqs = torch.einsum('i,j->ij', pos, self.inv_freq).repeat_interleave(2, dim=-1)
        x1, x2 = t[..., 0::2], t[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
        return t * freqs.cos() + rotated * freqs.sin()


class SparseAttention(nn.Module):
    def __init__(self, dim, dim_head, heads, sliding_window_size, compress_block_size,
                 selection_block_size, num_selected_blocks, causal=True):
        super().__init__()
        self.heads = heads
        self.dim_head = dim_head
        self.scale = dim_head ** -0.5
        self.causal = causal
        self.sliding_window_size = sliding_window_size
        self.compress_block_size = compress_block_size
        self.selection_block_size = selection_block_size
        self.num_selected_blocks = num_selected_blocks
        dim_inner = dim_head * heads

        self.norm = nn.RMSNorm(dim)
        self.rotary_emb = RotaryEmbedding(dim_head)
        self.to_qkv = nn.Linear(dim, dim_inner * 3, bias=False)
        self.qkv_split = (dim_inner, dim_inner, dim_inner)

        # they combine the three sparse branches through a learned combine with sigmoid activation
        strategy_combine_mlp = nn.Linear(dim, 3 * heads)
        nn.init.zeros_(strategy_combine_mlp.weight)
        strategy_combine_mlp.bias.data.copy_(tensor([-2., -2., 2.] * heads))
        self.to_strategy_combine = nn.Sequential(strategy_combine_mlp, nn.Sigmoid())
        self.combine_heads = nn.Linear(dim_inner, dim, bias=False)

    def split_heads(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.heads, self.dim_head).transpose(1, 2)

    def forward_inference(self, inp, cache, return_cache=True):
        assert self.causal, 'inference only relevant for autoregressive'

        cache_k, cache_v = cache

        batch, scale = inp.shape[0], self.scale
        cache_len = cache_k.shape[-2]
        seq_len = cache_len + 1

        sliding_window = self.sliding_window_size

        inp = self.norm(inp)
        q, k, v = self.to_qkv(inp).split(self.qkv_split, dim=-1)
        q, k, v = map(self.split_heads, (q, k, v))

        rotated_q = self.rotary_emb.rotate_queries_or_keys(q, offset=cache_len)
        k = self.rotary_emb.rotate_queries_or_keys(k, offset=cache_len)

        # handle cache, which stores the rotated
        k = torch.cat((cache_k, k), dim=-2)
        v = torch.cat((cache_v, v), dim=-2)

        cache_kv = (k, v) if return_cache else None

        # 1. compressed attention: left out (it attends to compressed blocks, not to these keys)
        compressed_attn_out = torch.zeros_like(q)

        # 2. fine attention inference
        num_selected = self.num_selected_blocks
        has_selected_kv_for_fine_attn = num_selected > 0
        assert not has_selected_kv_for_fine_attn

        # block causal diagonal
        if FIXED:
            fine_sliding_window = ((seq_len - 1) % self.selection_block_size) + 1
        else:
            fine_sliding_window = (seq_len % self.selection_block_size) + 1
        fk = k[..., -fine_sliding_window:, :]
        fv = v[..., -fine_sliding_window:, :]

        fsim = torch.einsum('b h i d, b h j d -> b h i j', rotated_q, fk) * scale
        fattn = fsim.softmax(dim=-1)
        fine_attn_out = torch.einsum('b h i j, b h j d -> b h i d', fattn, fv)

        # 3. sliding window
        sliding_slice = (Ellipsis, slice(-(sliding_window + 1), None), slice(None))
        sk, sv = k[sliding_slice], v[sliding_slice]
        sim = torch.einsum('b h i d, b h j d -> b h i j', rotated_q, sk) * scale
        attn = sim.softmax(dim=-1)
        sliding_window_attn_out = torch.einsum('b h i j, b h j d -> b h i d', attn, sv)

        # combine strategies
        strategy_weighted_combine = self.to_strategy_combine(inp).view(batch, 1, self.heads, 3).permute(0, 2, 1, 3)
        out = torch.einsum('b h n s, s b h n d -> b h n d', strategy_weighted_combine,
                           torch.stack([compressed_attn_out, fine_attn_out, sliding_window_attn_out]))

        out = out.transpose(1, 2).reshape(batch, 1, -1)
        return self.combine_heads(out), cache_kv


def main():
    torch.manual_seed(0)
    dim, heads, dim_head = 32, 2, 16
    attn = SparseAttention(dim=dim, dim_head=dim_head, heads=heads, sliding_window_size=2,
                           compress_block_size=4, selection_block_size=4, num_selected_blocks=0).eval()
    tokens = torch.randn(1, 12, dim)

    cache = (torch.empty(1, heads, 0, dim_head), torch.empty(1, heads, 0, dim_head))
    outs = []
    with torch.no_grad():
        for i in range(tokens.shape[1]):
            out, cache = attn.forward_inference(tokens[:, i:i + 1], cache)
            outs.append(out)
    outs = torch.cat(outs, dim=1)
    print("fixed" if FIXED else "buggy", tuple(outs.shape), f"{outs.abs().sum().item():.4f}")


if __name__ == "__main__":
    main()
