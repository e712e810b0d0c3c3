"""Autoregressive video diffusion (CausVid / Self-Forcing): frame blocks attend to themselves fully and to past blocks.

Follows guandeh17/Self-Forcing wan/modules/causal_model.py (CausalWanModel._prepare_blockwise_causal_attn_mask:
ends[q] = end of q's block of num_frame_per_block * frame_seqlen tokens, padded to a multiple of 128,
mask_mod = (kv_idx < ends[q_idx]) | (q_idx == kv_idx), flex_attention with create_block_mask; inference with a
kv_cache written block by block and plain attention of the current block over cache[:end]).
Mask meant: block-causal at frame-block granularity: every token of a block sees all tokens of its own
block (later frames of the block included) and of earlier blocks; the padding rows keep only their diagonal.
"""
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def _prepare_blockwise_causal_attn_mask(num_frames, frame_seqlen, num_frame_per_block):
    total_length = num_frames * frame_seqlen
    padded_length = math.ceil(total_length / 128) * 128 - total_length
    ends = torch.zeros(total_length + padded_length, dtype=torch.long)
    frame_indices = torch.arange(0, total_length, frame_seqlen * num_frame_per_block)
    for tmp in frame_indices:             # one iteration per block of frames, not per token
        ends[tmp:tmp + frame_seqlen * num_frame_per_block] = tmp + frame_seqlen * num_frame_per_block

    def attention_mask(b, h, q_idx, kv_idx):
        return (kv_idx < ends[q_idx]) | (q_idx == kv_idx)

    return create_block_mask(attention_mask, B=None, H=None, Q_LEN=total_length + padded_length,
                             KV_LEN=total_length + padded_length, _compile=False, device="cpu")


class CausalWanSelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def qkv(self, x):
        b, s = x.shape[:2]
        return (f(x).view(b, s, self.num_heads, self.head_dim) for f in (self.q, self.k, self.v))

    def forward_train(self, x, block_mask):
        b, s = x.shape[:2]
        q, k, v = self.qkv(x)
        padded_length = block_mask.shape[-2] - s

        def pad(t):
            return torch.cat([t, t.new_zeros(b, padded_length, *t.shape[2:])], dim=1).transpose(1, 2)

        out = flex_attention(pad(q), pad(k), pad(v), block_mask=block_mask)[:, :, :s]
        return self.o(out.transpose(1, 2).flatten(2))

    def forward_cached(self, x, kv_cache, current_start):
        b, s = x.shape[:2]
        q, k, v = self.qkv(x)
        current_end = current_start + s
        kv_cache["k"][:, current_start:current_end] = k
        kv_cache["v"][:, current_start:current_end] = v
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kv_cache["k"][:, :current_end].transpose(1, 2),
                                             kv_cache["v"][:, :current_end].transpose(1, 2))
        return self.o(out.transpose(1, 2).flatten(2))


def main():
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    torch.manual_seed(0)
    num_frames, frame_seqlen, num_frame_per_block, dim, heads = 6, 12, 2, 32, 4
    attn = CausalWanSelfAttention(dim, heads).requires_grad_(False)
    noisy_latents = torch.randn(1, num_frames * frame_seqlen, dim)

    # training (teacher forcing over the whole clip)
    block_mask = _prepare_blockwise_causal_attn_mask(num_frames, frame_seqlen, num_frame_per_block)
    train_out = attn.forward_train(noisy_latents, block_mask)

    # inference: generate block by block, caching keys/values of finished blocks
    block_len = frame_seqlen * num_frame_per_block
    kv_cache = {"k": torch.zeros(1, num_frames * frame_seqlen, heads, dim // heads),
                "v": torch.zeros(1, num_frames * frame_seqlen, heads, dim // heads)}
    outs = [attn.forward_cached(noisy_latents[:, s:s + block_len], kv_cache, s)
            for s in range(0, num_frames * frame_seqlen, block_len)]
    infer_out = torch.cat(outs, dim=1)
    print("train", tuple(train_out.shape), "match", torch.allclose(train_out, infer_out, atol=1e-5))


if __name__ == "__main__":
    main()
