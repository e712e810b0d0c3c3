"""vllm-plugin-FL (txda backend): the SDPA attention impl skips the sliding window for decode tokens.

Citation: flagos-ai/vllm-plugin-FL PR #489 ("feat(tsingmicro): enable vllm 0.20.2 on txda", merged).
The bug was found in review (ceci3 on `vllm_fl/dispatch/backends/vendor/txda/impl/attention.py`: "When
q_len == 1, this skips the mask even if window_left >= 0, so sliding-window decode attends to KV
outside the window") and fixed in the PR's commit 180066b ("The unmasked path is now only taken when
`window_left < 0`"). The reviewed hunk (repeat_interleave of K/V, the `q_len == 1` branch, the visibility
rule `j <= q_start + i` plus the left window bound) was read; the rest of the impl is reconstructed.

Bug: per request, the impl gathers the request's K/V from the paged cache, repeats KV heads with
`repeat_interleave(num_queries_per_kv)`, and calls SDPA. For `q_len == 1` it passes no mask ("the single
new token attends all keys"), so on sliding-window layers every decode token sees the whole context.

Fix: take the unmasked path only when `window_left < 0`; otherwise build `_visible_mask` with the window
bound `j >= q_start + i - window_left`.

Reproduction: a vLLM-style flat batch of 3 requests (query_start_loc / seq_lens metadata, block table of
a paged KV cache, block size 4): two decode requests with 9 and 13 cached tokens, and one chunked-prefill
request; `sliding_window = 6` -> `window_left = 5`, GQA 4 query heads / 2 KV heads.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs] tokens in the cache after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # [num_tokens]


def _visible_mask(q_len, kv_len, q_start, window_left, device):
    """Key j is visible to query row i iff j <= q_start + i, plus the sliding-window left bound."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    mask = j <= q_start + i
    if window_left >= 0:
        mask &= j >= q_start + i - window_left
    return mask


class TxdaAttentionImpl:
    def __init__(self, num_heads, head_size, num_kv_heads, sliding_window=None, block_size=4):
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        # vLLM convention: window (left, right) = (sliding_window - 1, 0)
        self.sliding_window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
        self.block_size = block_size
        self.scale = head_size ** -0.5

    def _sdpa(self, q, k, v, q_start, window_left):
        q_len, kv_len = q.shape[0], k.shape[0]
        qq = q.permute(1, 0, 2).unsqueeze(0)
        kk = k.permute(1, 0, 2).unsqueeze(0)
        vv = v.permute(1, 0, 2).unsqueeze(0)
        if self.num_queries_per_kv > 1:
            kk = kk.repeat_interleave(self.num_queries_per_kv, dim=1)
            vv = vv.repeat_interleave(self.num_queries_per_kv, dim=1)
        attn_mask = None
        if q_len == 1 and (not FIXED or window_left < 0):
            # Decode: the single new token attends all keys; no mask needed.
            pass
        else:
            attn_mask = _visible_mask(q_len, kv_len, q_start, window_left, q.device)
        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=attn_mask, scale=self.scale)
        return out.squeeze(0).permute(1, 0, 2)

    def forward(self, query, key, value, kv_cache, attn_metadata):
        key_cache, value_cache = kv_cache
        # write the new tokens into their slots of the paged cache
        key_cache.view(-1, self.num_kv_heads, self.head_size)[attn_metadata.slot_mapping] = key
        value_cache.view(-1, self.num_kv_heads, self.head_size)[attn_metadata.slot_mapping] = value
        output = torch.empty_like(query)
        window_left = self.sliding_window[0]
        qsl = attn_metadata.query_start_loc.tolist()
        for r, seq_len in enumerate(attn_metadata.seq_lens.tolist()):
            q = query[qsl[r]:qsl[r + 1]]
            q_len = q.shape[0]
            q_start = seq_len - q_len  # absolute position of this step's first query
            n_blocks = (seq_len + self.block_size - 1) // self.block_size
            blocks = attn_metadata.block_table[r, :n_blocks]
            k = key_cache[blocks].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len]
            v = value_cache[blocks].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len]
            output[qsl[r]:qsl[r + 1]] = self._sdpa(q, k, v, q_start, window_left)
        return output


def main():
    torch.manual_seed(0)
    H, KVH, D, BS = 4, 2, 8, 4
    impl = TxdaAttentionImpl(H, D, KVH, sliding_window=6, block_size=BS)
    num_blocks = 16
    key_cache = torch.randn(num_blocks, BS, KVH, D)
    value_cache = torch.randn(num_blocks, BS, KVH, D)
    # request 0: decode at position 9 (10 tokens); request 1: decode at 13; request 2: chunk of 3 after 5 cached
    seq_lens = torch.tensor([10, 14, 8])
    q_lens = [1, 1, 3]
    block_table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    query_start_loc = torch.tensor([0, 1, 2, 5])
    slots = []
    for r, (s, ql) in enumerate(zip(seq_lens.tolist(), q_lens)):
        for pos in range(s - ql, s):
            slots.append(block_table[r, pos // BS].item() * BS + pos % BS)
    meta = AttentionMetadata(query_start_loc, seq_lens, block_table, torch.tensor(slots))
    n = sum(q_lens)
    out = impl.forward(torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D),
                       (key_cache, value_cache), meta)
    print("output per token (sum):", [round(x, 4) for x in out.sum(dim=(1, 2)).tolist()])


if __name__ == "__main__":
    main()
