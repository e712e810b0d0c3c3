"""lmdeploy PyTorch engine: Gemma 3 served with the sliding-window block manager, which frees blocks global layers need.

Citation: InternLM/lmdeploy#3772, "fix gemma3" (merged). I read the PR description and its review
threads, not lmdeploy's block-manager source; the engine pieces below (a paged K/V cache shared by
all layers through one block table, a window block manager that releases blocks once they fall out
of `window_size`, a paged attention call taking block_offsets, kv_seqlens and an optional window)
are written from that description with lmdeploy's names (cache_config.window_size,
DefaultBlockManager, sliding_window_pattern).

Bug: the executor set `cache_config.window_size = model_config.sliding_window`, which selects the
sliding-window block allocation strategy: blocks whose tokens are all older than the window are
released. That is only right when EVERY layer slides. Gemma 3 interleaves sliding layers with
global ones (sliding_window_pattern = 6), and all layers share the block table, so the global
layers lose the start of the context.

Fix: allocate blocks with DefaultBlockManager (keep every block; the sliding layers apply their
window in the attention kernel), and disable prefix caching when window size > 0.

Reproduction: a 2-layer Gemma-3-style stack (layer 0 sliding with window 8, layer 1 global,
sliding_window_pattern 2), block size 4, a 14-token prompt, then one decode step. Attention is
F.scaled_dot_product_attention over the K/V gathered through the block table, with the
valid-length (and, on sliding layers, window) mask.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Gemma3TextConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    sliding_window: int = 8
    sliding_window_pattern: int = 2


@dataclass
class CacheConfig:
    block_size: int = 4
    num_gpu_blocks: int = 12
    window_size: int = -1


class DefaultBlockManager:
    def __init__(self, num_blocks, block_size):
        self.free = list(range(num_blocks))
        self.block_size = block_size
        self.block_tables = {}

    def allocate(self, seq_id, num_tokens, num_new=None):
        table = self.block_tables.setdefault(seq_id, [])
        need = (num_tokens + self.block_size - 1) // self.block_size
        while len(table) < need:
            table.append(self.free.pop(0))

    def get_block_table(self, seq_id):
        return torch.tensor(self.block_tables[seq_id])


class WindowBlockManager(DefaultBlockManager):
    """Releases blocks whose tokens have all slid out of the window."""

    def __init__(self, num_blocks, block_size, window_size):
        super().__init__(num_blocks, block_size)
        self.window_size = window_size

    def allocate(self, seq_id, num_tokens, num_new=None):
        super().allocate(seq_id, num_tokens)
        table = self.block_tables[seq_id]
        # the history (tokens before this step) decides which blocks have slid out
        history = num_tokens - (num_new if num_new is not None else num_tokens)
        first_kept = max(0, history - self.window_size) // self.block_size
        for i in range(first_kept):
            if table[i] >= 0:
                self.free.append(table[i])
                table[i] = -1


def build_block_manager(cache_config):
    if cache_config.window_size is not None and cache_config.window_size > 0:
        return WindowBlockManager(cache_config.num_gpu_blocks, cache_config.block_size, cache_config.window_size)
    return DefaultBlockManager(cache_config.num_gpu_blocks, cache_config.block_size)


def paged_attention_fwd(q, k_cache, v_cache, block_offsets, q_start_loc, kv_seqlens, window_size=-1):
    """q: [q_len, H, D] for one sequence; caches: [num_blocks, block_size, H, D]."""
    block_size = k_cache.shape[1]
    keys, values, pos = [], [], []
    for logical, block in enumerate(block_offsets.tolist()):
        if block < 0:
            continue  # released block: nothing to read
        keys.append(k_cache[block])
        values.append(v_cache[block])
        pos.append(torch.arange(logical * block_size, (logical + 1) * block_size))
    k, v, pos = torch.cat(keys), torch.cat(values), torch.cat(pos)
    q_pos = torch.arange(q_start_loc, q_start_loc + q.shape[0])[:, None]
    mask = (pos[None, :] <= q_pos) & (pos[None, :] < kv_seqlens)
    if window_size > 0:
        mask &= q_pos - pos[None, :] < window_size
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask[None])
    return out.transpose(0, 1)


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.is_sliding = bool((layer_idx + 1) % config.sliding_window_pattern)
        self.sliding_window = config.sliding_window if self.is_sliding else -1
        self.n_heads = config.num_attention_heads
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, h, k_cache, v_cache, block_offsets, past_len):
        q_len = h.shape[0]
        q, k, v = self.qkv_proj(h).view(q_len, 3, self.n_heads, -1).unbind(1)
        block_size = k_cache.shape[1]
        for i in range(q_len):  # fill_kv_cache
            p = past_len + i
            block = int(block_offsets[p // block_size])
            k_cache[block, p % block_size] = k[i]
            v_cache[block, p % block_size] = v[i]
        out = paged_attention_fwd(q, k_cache, v_cache, block_offsets, past_len, past_len + q_len, self.sliding_window)
        return self.o_proj(out.reshape(q_len, -1))


class Gemma3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3Attention(config, i) for i in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, ids, caches, block_offsets, past_len):
        h = self.embed_tokens(ids)
        for layer, (kc, vc) in zip(self.layers, caches):
            h = h + layer(h, kc, vc, block_offsets, past_len)
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    model_config = Gemma3TextConfig()
    cache_config = CacheConfig()
    if not FIXED:
        cache_config.window_size = model_config.sliding_window
    model = Gemma3Model(model_config).eval()
    head_dim = model_config.hidden_size // model_config.num_attention_heads
    caches = [
        (torch.zeros(cache_config.num_gpu_blocks, cache_config.block_size, model_config.num_attention_heads, head_dim),
         torch.zeros(cache_config.num_gpu_blocks, cache_config.block_size, model_config.num_attention_heads, head_dim))
        for _ in range(model_config.num_hidden_layers)
    ]
    manager = build_block_manager(cache_config)
    prompt = torch.randint(0, model_config.vocab_size, (14,))
    with torch.no_grad():
        manager.allocate(0, 14, num_new=14)
        logits = model(prompt, caches, manager.get_block_table(0), 0)
        nxt = logits[-1:].argmax(-1)
        manager.allocate(0, 15, num_new=1)
        logits = model(nxt, caches, manager.get_block_table(0), 14)
    print("block table:", manager.get_block_table(0).tolist(), "next:", logits.argmax(-1).tolist())


if __name__ == "__main__":
    main()
