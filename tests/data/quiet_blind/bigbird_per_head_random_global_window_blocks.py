"""BigBird block-sparse attention: per head its own random blocks, plus global and sliding-window blocks.

Follows huggingface/transformers src/transformers/models/big_bird/modeling_big_bird.py
(BigBirdBlockSparseAttention: `rand_attn = [self._bigbird_block_rand_mask(...) for _ in range(n_heads)]`,
_create_rand_mask_from_inputs, block_size / num_random_blocks from BigBirdConfig, input padded to a multiple of
block_size by BigBirdModel._pad_to_block_size) and google-research/bigbird bigbird/core/attention.py
(bigbird_block_rand_mask), recalled; the block-sparse product is written as a dense [B, H, L, L] mask for SDPA.
Mask, per head h, in units of blocks of `block_size` tokens (nb blocks):
- the first and last blocks are global: their queries see every key, and every query sees their keys;
- each middle block q sees blocks q-1, q, q+1 (window of 3 blocks) and `num_random_blocks` random middle blocks
  drawn for THAT head (heads differ on purpose: that is how BigBird covers more pairs per layer);
- keys that are padding (attention_mask 0, including the pad added to reach a block multiple) are hidden.
Padded queries compute rows that are never read.
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class BigBirdConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    attention_type: str = "block_sparse"
    block_size: int = 2
    num_random_blocks: int = 1
    seed: int = 0


def _bigbird_block_rand_mask(num_blocks, num_rand_blocks, rng):
    """For middle block rows 1..nb-2, pick random middle key blocks outside the row's window."""
    rand_attn = np.zeros((num_blocks - 2, num_rand_blocks), dtype=np.int64)
    middle_seq = np.arange(1, num_blocks - 1)
    for i in range(1, num_blocks - 1):
        candidates = middle_seq[(middle_seq < i - 1) | (middle_seq > i + 1)]
        rand_attn[i - 1] = rng.permutation(candidates)[:num_rand_blocks]
    return rand_attn


def _create_block_mask(config, num_blocks, rand_attn_per_head):
    """[H, nb, nb] boolean block mask from globals, the 3-block window and each head's random blocks."""
    n_heads = config.num_attention_heads
    qb = torch.arange(num_blocks)[:, None]
    kb = torch.arange(num_blocks)[None, :]
    window = (qb - kb).abs() <= 1
    global_ = (qb == 0) | (qb == num_blocks - 1) | (kb == 0) | (kb == num_blocks - 1)
    block_mask = (window | global_).expand(n_heads, num_blocks, num_blocks).clone()
    for h, rand_attn in enumerate(rand_attn_per_head):
        rows = torch.arange(1, num_blocks - 1)[:, None].expand_as(torch.as_tensor(rand_attn))
        block_mask[h, rows, torch.as_tensor(rand_attn)] = True
    return block_mask


def block_sparse_attention(config, query_layer, key_layer, value_layer, attention_mask):
    b, n_heads, seq_len, _ = query_layer.shape
    bs = config.block_size
    num_blocks = seq_len // bs
    rng = np.random.RandomState(config.seed)
    rand_attn = [_bigbird_block_rand_mask(num_blocks, config.num_random_blocks, rng) for _ in range(n_heads)]
    block_mask = _create_block_mask(config, num_blocks, rand_attn)
    token_mask = block_mask.repeat_interleave(bs, dim=1).repeat_interleave(bs, dim=2)  # [H, L, L]
    attn_mask = token_mask[None] & attention_mask.bool()[:, None, None, :]
    out = F.scaled_dot_product_attention(query_layer, key_layer, value_layer, attn_mask=attn_mask)
    return out, rand_attn


def _pad_to_block_size(input_ids, attention_mask, block_size, pad_token_id=0):
    padding_len = (block_size - input_ids.shape[1] % block_size) % block_size
    if padding_len > 0:
        input_ids = F.pad(input_ids, (0, padding_len), value=pad_token_id)
        attention_mask = F.pad(attention_mask, (0, padding_len), value=0)
    return padding_len, input_ids, attention_mask


def main():
    torch.manual_seed(0)
    config = BigBirdConfig()
    input_ids = torch.randint(1, 50, (2, 15))
    attention_mask = torch.ones(2, 15, dtype=torch.long)
    attention_mask[1, 11:] = 0
    padding_len, input_ids, attention_mask = _pad_to_block_size(input_ids, attention_mask, config.block_size)
    seq_len = input_ids.shape[1]  # 16 -> 8 blocks
    head_dim = config.hidden_size // config.num_attention_heads
    emb = torch.nn.Embedding(50, config.hidden_size)
    proj = torch.nn.Linear(config.hidden_size, 3 * config.hidden_size)
    with torch.no_grad():
        q, k, v = proj(emb(input_ids)).split(config.hidden_size, dim=-1)
        def heads(t):
            return t.view(2, seq_len, config.num_attention_heads, head_dim).transpose(1, 2)
        q, k, v = heads(q), heads(k), heads(v)
        out, rand_attn = block_sparse_attention(config, q, k, v, attention_mask)

    # Independent check: per head, per absolute query position, the allowed key set from BigBird's rules.
    bs, nb = config.block_size, seq_len // config.block_size
    for b in range(2):
        for h in range(config.num_attention_heads):
            for i in range(seq_len):
                qb = i // bs
                keys = []
                for j in range(seq_len):
                    kb = j // bs
                    ok = qb in (0, nb - 1) or kb in (0, nb - 1) or abs(qb - kb) <= 1
                    ok = ok or (0 < qb < nb - 1 and kb in rand_attn[h][qb - 1])
                    if ok and attention_mask[b, j]:
                        keys.append(j)
                s = (q[b, h, i] @ k[b, h, keys].T) / head_dim ** 0.5
                ref = torch.softmax(s, dim=-1) @ v[b, h, keys]
                assert torch.allclose(out[b, h, i], ref, atol=1e-5)
    assert len({tuple(r.ravel()) for r in rand_attn}) > 1  # heads draw different random blocks
    print("bigbird block-sparse ok: padding_len", padding_len, "blocks", nb)


if __name__ == "__main__":
    main()
