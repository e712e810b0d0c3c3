"""attention-gym PagedAttention: mask_mod reads physical_to_logical by batch position, not batch slot.

Citation: meta-pytorch/attention-gym#189 (issue, open): "`get_mask_mod` and `get_score_mod` produces
incorrect logical to physical translation." I read the issue and the PagedAttention class as shipped
(attention-gym's paged_attention.py, the copy in torch.nn.attention.experimental._paged_attention
is the same code); the class below is a trimmed copy of it (reserve / erase / assign /
convert_logical_block_mask / get_mask_mod). No upstream fix is merged; the --fixed path is the
fix the issue proposes (index physical_to_logical with the same batch_idx used to slice the
page table).

Bug: with continuous batching the active requests sit in non-sequential batch slots (e.g. [2, 0]
after other requests finished). convert_logical_block_mask(block_mask, batch_idx) slices
`page_table[batch_idx]` so the converted BlockMask's batch dim follows batch_idx, but the mask_mod
from get_mask_mod looks up `self.physical_to_logical[b, physical_kv_block]` with the batch
POSITION b. Each decode row therefore translates its physical pages with another slot's mapping
(or an erased slot's all -1 row): live keys are masked out or the wrong logical positions are
judged by the causal mask_mod.

Fix (proposed in the issue): use physical_to_logical[batch_idx] inside the converted mask_mod.

Reproduction: page_size 16, 4 batch slots; requests of 40 and 20 tokens in slots 2 and 0 (slots
1 and 3 erased), a decode step with batch_idx = [2, 0] through flex_attention with the converted
BlockMask over the paged K/V cache.
"""
import sys
import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention, noop_mask

FIXED = "--fixed" in sys.argv
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def _cdiv(x, multiple):
    return (x + multiple - 1) // multiple


class PagedAttention:
    def __init__(self, n_pages, page_size, max_batch_size, device="cpu"):
        self.n_pages = n_pages
        self.page_size = page_size
        # page table: [batch, logical_block_idx] -> physical_page_idx
        self.page_table = -torch.ones((max_batch_size, self.n_pages), dtype=torch.int64, device=device)
        self.capacity = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.empty_pages = list(range(n_pages - 1, -1, -1))
        # mapping from physical page index to logical page index
        self.physical_to_logical = -torch.ones((max_batch_size, n_pages), dtype=torch.int64, device=device)

    def reserve(self, batch_idx, seq_len):
        if seq_len <= self.capacity[batch_idx]:
            return
        num_pages_to_allocate = _cdiv(seq_len - self.capacity[batch_idx], self.page_size)
        start_page_idx = self.capacity[batch_idx] // self.page_size
        end_page_idx = start_page_idx + num_pages_to_allocate
        allocated_pages = torch.tensor(self.empty_pages[-num_pages_to_allocate:])
        self.empty_pages = self.empty_pages[:-num_pages_to_allocate]
        self.page_table[batch_idx, start_page_idx:end_page_idx] = allocated_pages
        self.physical_to_logical[batch_idx, allocated_pages] = torch.arange(start_page_idx.item(), end_page_idx.item())
        self.capacity[batch_idx] += num_pages_to_allocate * self.page_size

    def erase(self, batch_idx):
        allocated_page_idx = self.page_table[batch_idx] != -1
        allocated_pages = self.page_table[batch_idx][allocated_page_idx]
        self.capacity[batch_idx] = 0
        self.empty_pages += allocated_pages.tolist()
        self.physical_to_logical[batch_idx][:, allocated_pages] = -1
        self.page_table[batch_idx] = -1

    def assign(self, batch_idx, input_pos, k_val, v_val, k_cache, v_cache):
        B, H, S, K_D = k_val.shape
        V_D = v_val.shape[3]
        logical_block_idx = input_pos // self.page_size
        logical_block_offset = input_pos % self.page_size
        physical_block_idx = torch.gather(self.page_table[batch_idx], 1, logical_block_idx.to(torch.int64))
        addr = (physical_block_idx * self.page_size + logical_block_offset).view(-1)
        k_val = k_val.permute(1, 0, 2, 3).contiguous().view(1, H, B * S, K_D)
        v_val = v_val.permute(1, 0, 2, 3).contiguous().view(1, H, B * S, V_D)
        k_cache[:, :, addr, :] = k_val
        v_cache[:, :, addr, :] = v_val

    def convert_logical_block_mask(self, block_mask, batch_idx=None, kv_len=None):
        B, H, ROWS, MAX_BLOCKS_IN_COL = block_mask.kv_indices.shape
        if batch_idx is None:
            batch_idx = torch.arange(B)
        page_table = self.page_table[batch_idx]
        new_kv_num_blocks = block_mask.kv_num_blocks.clone()
        new_kv_indices = torch.zeros((B, H, ROWS, self.n_pages), dtype=torch.int32)
        new_kv_indices[:, :, :, :MAX_BLOCKS_IN_COL] = (
            torch.gather(page_table, 1, block_mask.kv_indices.view(B, -1).to(torch.int64))
            .view(block_mask.kv_indices.shape).to(torch.int32)
        )
        new_full_kv_indices, new_full_kv_num_blocks = None, None
        if block_mask.full_kv_num_blocks is not None:
            new_full_kv_num_blocks = block_mask.full_kv_num_blocks.clone()
            new_full_kv_indices = torch.zeros((B, H, ROWS, self.n_pages), dtype=torch.int32)
            new_full_kv_indices[:, :, :, :MAX_BLOCKS_IN_COL] = (
                torch.gather(page_table, 1, block_mask.full_kv_indices.view(B, -1).to(torch.int64))
                .view(block_mask.full_kv_indices.shape).to(torch.int32)
            )
        if FIXED:
            new_mask_mod = self.get_mask_mod(block_mask.mask_mod, kv_len, batch_idx)
        else:
            new_mask_mod = self.get_mask_mod(block_mask.mask_mod, kv_len)
        seq_lengths = (block_mask.seq_lengths[0], self.n_pages * self.page_size)
        return BlockMask.from_kv_blocks(
            new_kv_num_blocks, new_kv_indices, new_full_kv_num_blocks, new_full_kv_indices,
            block_mask.BLOCK_SIZE, new_mask_mod, seq_lengths=seq_lengths,
        )

    def get_mask_mod(self, mask_mod, kv_len=None, batch_idx=None):
        if mask_mod is None:
            mask_mod = noop_mask
        physical_to_logical = self.physical_to_logical if batch_idx is None else self.physical_to_logical[batch_idx]

        def new_mask_mod(b, h, q_idx, physical_kv_idx):
            physical_kv_block = physical_kv_idx // self.page_size
            physical_kv_offset = physical_kv_idx % self.page_size
            logical_block_idx = physical_to_logical[b, physical_kv_block]
            logical_kv_idx = logical_block_idx * self.page_size + physical_kv_offset
            live_block = logical_block_idx >= 0
            within_upper_bound = logical_kv_idx < kv_len[b] if kv_len is not None else True
            within_lower_bound = logical_kv_idx >= 0
            is_valid = live_block & within_upper_bound & within_lower_bound
            return torch.where(is_valid, mask_mod(b, h, q_idx, logical_kv_idx), False)

        return new_mask_mod


def main():
    torch.manual_seed(0)
    page_size, n_pages, max_batch_size, H, D = 16, 16, 4, 2, 16
    paged = PagedAttention(n_pages, page_size, max_batch_size)
    k_cache = torch.zeros(1, H, n_pages * page_size, D)
    v_cache = torch.zeros(1, H, n_pages * page_size, D)

    # continuous batching: four requests prefilled, then slots 1 and 3 finish
    lengths = {0: 20, 1: 33, 2: 40, 3: 12}
    for slot, n in lengths.items():
        b = torch.tensor([slot])
        paged.reserve(b, torch.tensor(n + 1))
        pos = torch.arange(n)[None]
        paged.assign(b, pos, torch.randn(1, H, n, D), torch.randn(1, H, n, D), k_cache, v_cache)
    paged.erase(torch.tensor([1]))
    paged.erase(torch.tensor([3]))

    # one decode step for the live slots, in the scheduler's order
    batch_idx = torch.tensor([2, 0])
    input_pos = torch.tensor([lengths[2], lengths[0]])
    q = torch.randn(2, H, 1, D)
    paged.assign(batch_idx, input_pos[:, None], torch.randn(2, H, 1, D), torch.randn(2, H, 1, D), k_cache, v_cache)

    def causal_decode(b, h, q_idx, kv_idx):
        return kv_idx <= input_pos[b]

    max_len = int(paged.capacity.max())
    logical_mask = create_block_mask(causal_decode, B=2, H=None, Q_LEN=1, KV_LEN=max_len, BLOCK_SIZE=page_size, device="cpu")
    kv_len = input_pos + 1
    block_mask = paged.convert_logical_block_mask(logical_mask, batch_idx, kv_len)
    out = flex_attention(q, k_cache.expand(2, -1, -1, -1), v_cache.expand(2, -1, -1, -1), block_mask=block_mask)
    print("decode output norms:", [round(x, 3) for x in out.flatten(1).norm(dim=1).tolist()])


if __name__ == "__main__":
    main()
