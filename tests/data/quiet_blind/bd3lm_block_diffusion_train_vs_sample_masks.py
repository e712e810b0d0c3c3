"""BD3-LM block diffusion (kuleshov-group/bd3lms models/dit.py): one mask for training, none for sampling.

Follows the bd3lms DIT: in training the noised sequence x_t and the clean sequence x_0 are concatenated into
2n tokens and attended with `block_diff_mask` (block diagonal within x_t blocks and within x_0 blocks, offset
block-causal from x_t block b to clean blocks < b, block-causal among clean blocks); the loss uses the first n
outputs. In sampling (model.eval()), blocks are generated one at a time: the noisy block attends, with no mask,
to the KV cache of the clean blocks already generated plus itself; once denoised, the clean block is run once
with `store_kv=True` to append its keys to the cache.

Masks meant:
- training: the 2n x 2n `block_diff_mask` as a bool SDPA mask; within a block attention is bidirectional (the
  block is denoised jointly), across blocks it is causal at block granularity;
- sampling: no mask, queries (one block of 4) fewer than keys (cache + block): bidirectional within the block,
  full view of earlier clean blocks, which is the same attention as training rows of that block.
"""
import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F


def block_diff_mask(b, h, q_idx, kv_idx, block_size=None, n=None):
    x0_flag_q = q_idx >= n
    x0_flag_kv = kv_idx >= n
    block_q = torch.where(x0_flag_q, (q_idx - n) // block_size, q_idx // block_size)
    block_kv = torch.where(x0_flag_kv, (kv_idx - n) // block_size, kv_idx // block_size)
    block_diagonal = (block_q == block_kv) & (x0_flag_q == x0_flag_kv)
    offset_block_causal = (block_q > block_kv) & x0_flag_kv & ~x0_flag_q
    block_causal = (block_q >= block_kv) & x0_flag_kv & x0_flag_q
    return block_diagonal | offset_block_causal | block_causal


class DDiTBlock(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(dim)
        self.attn_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate='tanh'), nn.Linear(4 * dim, dim))
        self.kv_cache = None

    def forward(self, x, mask=None, store_kv=False):
        b, s, d = x.shape
        qkv = self.attn_qkv(self.norm1(x)).view(b, s, 3, self.n_heads, -1)
        q, k, v = qkv.unbind(2)
        if self.kv_cache is not None:
            k = torch.cat([self.kv_cache[0], k], dim=1)
            v = torch.cat([self.kv_cache[1], v], dim=1)
        if store_kv:
            self.kv_cache = (k, v)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=1 / math.sqrt(q.size(-1)))
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class DIT(nn.Module):
    def __init__(self, vocab_size=33, dim=32, n_heads=4, n_blocks=2, model_length=16, block_size=4):
        super().__init__()
        self.mask_index = vocab_size - 1
        self.n = model_length
        self.block_size = block_size
        self.vocab_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Embedding(model_length, dim)
        self.blocks = nn.ModuleList([DDiTBlock(dim, n_heads) for _ in range(n_blocks)])
        self.output_layer = nn.Linear(dim, vocab_size)
        idx = torch.arange(2 * model_length)
        self.register_buffer('mask', block_diff_mask(None, None, idx[:, None], idx[None, :],
                                                     block_size=block_size, n=model_length), persistent=False)

    def forward(self, indices, positions, store_kv=False):
        x = self.vocab_embed(indices) + self.pos_embed(positions)
        mask = self.mask if self.training else None
        for block in self.blocks:
            x = block(x, mask=mask, store_kv=store_kv)
        return self.output_layer(x)

    def reset_kv_cache(self):
        for block in self.blocks:
            block.kv_cache = None


def q_xt(x0, move_chance, mask_index):
    move_indices = torch.rand(*x0.shape) < move_chance
    return torch.where(move_indices, mask_index, x0)


def main():
    torch.manual_seed(0)
    model = DIT()
    n, bs = model.n, model.block_size
    x0 = torch.randint(0, model.mask_index, (2, n))
    xt = q_xt(x0, 0.5, model.mask_index)
    positions = torch.arange(n).repeat(2)

    model.train()
    for block in model.blocks:  # dropout-free model, so train and eval outputs are comparable
        assert not any(isinstance(m, nn.Dropout) for m in block.modules())
    logits = model(torch.cat([xt, x0], dim=1), positions)[:, :n]
    loss = F.cross_entropy(logits[xt == model.mask_index], x0[xt == model.mask_index])
    loss.backward()

    model.eval()
    model.reset_kv_cache()
    with torch.no_grad():
        # replay block 2 of the training batch as sampling would see it: clean blocks 0-1 cached
        for start in (0, bs):  # clean blocks enter the cache one block at a time, as in sampling
            model(x0[:, start:start + bs], torch.arange(start, start + bs), store_kv=True)
        sample_logits = model(xt[:, 2 * bs:3 * bs], torch.arange(2 * bs, 3 * bs))
        assert torch.allclose(sample_logits, logits[:, 2 * bs:3 * bs].detach(), atol=1e-5)

        # sampling from scratch, one block at a time, one denoising step per block
        model.reset_kv_cache()
        sample = torch.empty(2, 0, dtype=torch.long)
        for start in range(0, n, bs):
            noisy = torch.full((2, bs), model.mask_index)
            pos = torch.arange(start, start + bs)
            clean = model(noisy, pos)[..., :-1].argmax(-1)
            model(clean, pos, store_kv=True)
            sample = torch.cat([sample, clean], dim=1)
    print(f"loss {loss.item():.4f}; sample {sample.tolist()}")


if __name__ == "__main__":
    main()
