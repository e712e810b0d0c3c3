# Citation: pytorch/pytorch#159247 ("[Flex Attention] Accuracy issue with kv length not multiple of
#   kv block size"), fixed by pytorch/pytorch#160861 ("[FlexAttn] Fix Paged Attention Accuracy via
#   Upper Mask Mod and Prevent Invalid Memory Access").
# Upstream: torch/nn/attention/experimental/_paged_attention.py, class PagedAttention
#   (reserve / erase / assign / convert_logical_block_mask / get_mask_mod / get_score_mod),
#   used as test/inductor/test_flex_decoding.py run_test_with_paged_attention uses it.
# Bug: convert_logical_block_mask rewrote the logical BlockMask onto physical pages with a mask_mod
#   that only checks that a page is live (physical_to_logical >= 0). When the KV length is not a
#   multiple of the page size, the slots of the last page past the written length lie inside the
#   physical cache tensor, so flex_attention scores them (stale K/V left by an earlier request).
# Fix: convert_logical_block_mask / get_mask_mod / get_score_mod take kv_len (shape (B,)) and also
#   require logical_kv_idx < kv_len[b] (and >= 0); callers pass the real KV lengths.
#
# Tiny CPU setup: page_size 4, 8 pages; a finished request is erased (its pages keep their K/V),
# then two new requests with 6-token prompts are prefilled and decoded greedily for 3 steps with a
# noop logical mask (the decode query attends the whole cache, as in the upstream decoding tests).
import sys
import warnings

import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import (
    BlockMask,
    _identity,
    create_block_mask,
    flex_attention,
    noop_mask,
)

warnings.filterwarnings("ignore")
FIXED = "--fixed" in sys.argv


def _cdiv(x, multiple):
    return (x + multiple - 1) // multiple


class PagedAttention:
    def __init__(self, n_pages, page_size, max_batch_size, device="cpu"):
        self.n_pages = n_pages
        self.page_size = page_size
        self.page_table = -torch.ones((max_batch_size, self.n_pages), dtype=torch.int64, device=device)
        self.capacity = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.empty_pages = list(range(n_pages - 1, -1, -1))
        self.physical_to_logical = -torch.ones((max_batch_size, n_pages), dtype=torch.int64, device=device)

    def reserve(self, batch_idx, seq_len):
        if seq_len <= self.capacity[batch_idx]:
            return
        num_pages_to_allocate = _cdiv(seq_len - self.capacity[batch_idx], self.page_size)
        assert len(self.empty_pages) >= num_pages_to_allocate
        start_page_idx = self.capacity[batch_idx] // self.page_size
        end_page_idx = start_page_idx + num_pages_to_allocate
        allocated_pages = torch.tensor(self.empty_pages[-num_pages_to_allocate:], device=num_pages_to_allocate.device)
        self.empty_pages = self.empty_pages[:-num_pages_to_allocate]
        self.page_table[batch_idx, start_page_idx:end_page_idx] = allocated_pages
        self.physical_to_logical[batch_idx, allocated_pages] = torch.arange(
            start_page_idx.item(), end_page_idx.item(), device=num_pages_to_allocate.device
        )
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
        physical_block_idx = torch.gather(
            self.page_table[batch_idx], 1, logical_block_idx.to(torch.int64)
        ).to(torch.int32)
        addr = (physical_block_idx * self.page_size + logical_block_offset).view(-1)
        k_val = k_val.permute(1, 0, 2, 3).contiguous().view(1, H, B * S, K_D)
        v_val = v_val.permute(1, 0, 2, 3).contiguous().view(1, H, B * S, V_D)
        k_cache[:, :, addr, :] = k_val
        v_cache[:, :, addr, :] = v_val

    def convert_logical_block_mask(self, block_mask, batch_idx=None, kv_len=None):
        B, H, ROWS, MAX_BLOCKS_IN_COL = block_mask.kv_indices.shape
        assert block_mask.BLOCK_SIZE[1] == self.page_size
        device = block_mask.kv_num_blocks.device
        if batch_idx is None:
            batch_idx = torch.arange(B, device=device)
        page_table = self.page_table[batch_idx]

        new_kv_num_blocks = block_mask.kv_num_blocks.clone()
        new_kv_indices = torch.zeros((B, H, ROWS, self.n_pages), dtype=torch.int32, device=device)
        new_kv_indices[:, :, :, :MAX_BLOCKS_IN_COL] = (
            torch.gather(page_table, 1, block_mask.kv_indices.view(B, -1).to(torch.int64))
            .view(block_mask.kv_indices.shape)
            .to(torch.int32)
        )
        new_full_kv_indices, new_full_kv_num_blocks = None, None
        if block_mask.full_kv_num_blocks is not None:
            new_full_kv_num_blocks = block_mask.full_kv_num_blocks.clone()
            new_full_kv_indices = torch.zeros((B, H, ROWS, self.n_pages), dtype=torch.int32, device=device)
            new_full_kv_indices[:, :, :, :MAX_BLOCKS_IN_COL] = (
                torch.gather(page_table, 1, block_mask.full_kv_indices.view(B, -1).to(torch.int64))
                .view(block_mask.full_kv_indices.shape)
                .to(torch.int32)
            )

        if FIXED:
            new_mask_mod = self.get_mask_mod(block_mask.mask_mod, kv_len)
        else:
            new_mask_mod = self.get_mask_mod(block_mask.mask_mod)

        seq_lengths = (block_mask.seq_lengths[0], self.n_pages * self.page_size)
        return BlockMask.from_kv_blocks(
            new_kv_num_blocks,
            new_kv_indices,
            new_full_kv_num_blocks,
            new_full_kv_indices,
            block_mask.BLOCK_SIZE,
            new_mask_mod,
            seq_lengths=seq_lengths,
        )

    def get_mask_mod(self, mask_mod, kv_len=None):
        if mask_mod is None:
            mask_mod = noop_mask

        def new_mask_mod(b, h, q_idx, physical_kv_idx):
            physical_kv_block = physical_kv_idx // self.page_size
            physical_kv_offset = physical_kv_idx % self.page_size
            logical_block_idx = self.physical_to_logical[b, physical_kv_block]
            logical_kv_idx = logical_block_idx * self.page_size + physical_kv_offset
            if not FIXED:
                return torch.where(logical_block_idx >= 0, mask_mod(b, h, q_idx, logical_kv_idx), False)
            live_block = logical_block_idx >= 0
            within_upper_bound = logical_kv_idx < kv_len[b] if kv_len is not None else True
            within_lower_bound = logical_kv_idx >= 0
            is_valid = live_block & within_upper_bound & within_lower_bound
            return torch.where(is_valid, mask_mod(b, h, q_idx, logical_kv_idx), False)

        return new_mask_mod

    def get_score_mod(self, score_mod, kv_len=None):
        if score_mod is None:
            score_mod = _identity

        def new_score_mod(score, b, h, q_idx, physical_kv_idx):
            physical_kv_block = physical_kv_idx // self.page_size
            physical_kv_offset = physical_kv_idx % self.page_size
            logical_block_idx = self.physical_to_logical[b, physical_kv_block]
            logical_kv_idx = logical_block_idx * self.page_size + physical_kv_offset
            if not FIXED:
                return torch.where(
                    logical_block_idx >= 0, score_mod(score, b, h, q_idx, logical_kv_idx), float("-inf")
                )
            live_block = logical_block_idx >= 0
            within_upper_bound = logical_kv_idx < kv_len[b] if kv_len is not None else True
            within_lower_bound = logical_kv_idx >= 0
            is_valid = live_block & within_upper_bound & within_lower_bound
            return torch.where(is_valid, score_mod(score, b, h, q_idx, logical_kv_idx), float("-inf"))

        return new_score_mod


def tanh_softcap(score, b, h, q_idx, kv_idx):
    return 5.0 * torch.tanh(score / 5.0)


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class TinyPagedLM(nn.Module):
    def __init__(self, vocab=32, dim=16, n_heads=2):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(64, dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def qkv(self, ids, input_pos):
        B, S = ids.shape
        x = self.tok(ids) + self.pos(input_pos)
        q, k, v = self.wqkv(x).view(B, S, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return x, q, k, v

    def out(self, x, y):
        B, H, S, D = y.shape
        return self.head(x + self.wo(y.transpose(1, 2).reshape(B, S, H * D)))


def main():
    torch.manual_seed(0)
    page_size, n_pages, max_batch = 4, 8, 3
    model = TinyPagedLM().eval()
    H, D = model.n_heads, model.head_dim
    paged = PagedAttention(n_pages, page_size, max_batch)
    k_cache = torch.zeros(1, H, n_pages * page_size, D)
    v_cache = torch.zeros(1, H, n_pages * page_size, D)

    with torch.no_grad():
        # an earlier request (slot 2) of 8 tokens ran and finished; its pages are freed, K/V stay
        old = torch.randint(0, 32, (1, 8))
        old_pos = torch.arange(8)[None]
        paged.reserve(torch.tensor([2]), torch.tensor(8))
        _, _, k, v = model.qkv(old, old_pos)
        paged.assign(torch.tensor([2]), old_pos, k, v, k_cache, v_cache)
        paged.erase(torch.tensor([2]))

        # two new requests, 6-token prompts, batch slots 0 and 1
        batch_idx = torch.tensor([0, 1])
        prompts = torch.randint(0, 32, (2, 6))
        S = prompts.shape[1]
        for i in range(2):
            paged.reserve(batch_idx[i : i + 1], torch.tensor(S + 3))
        input_pos = torch.arange(S)[None].expand(2, S)
        x, q, k, v = model.qkv(prompts, input_pos)
        paged.assign(batch_idx, input_pos, k, v, k_cache, v_cache)
        logical = create_block_mask(causal_mask, 2, 1, S, S, device="cpu", BLOCK_SIZE=(page_size, page_size))
        kv_len = torch.full((2,), S)
        bm = paged.convert_logical_block_mask(logical, batch_idx, kv_len=kv_len)
        sm = paged.get_score_mod(tanh_softcap, kv_len=kv_len)
        y = flex_attention(q, k_cache, v_cache, score_mod=sm, block_mask=bm)
        logits = model.out(x, y)[:, -1]
        next_tok = logits.argmax(-1)
        print("prefill last logits[:, :4]:", [[round(t, 4) for t in r] for r in logits[:, :4].tolist()])

        generated = [next_tok.tolist()]
        cur = S
        for step in range(3):
            ids = next_tok[:, None]
            pos = torch.full((2, 1), cur)
            x, q, k, v = model.qkv(ids, pos)
            paged.assign(batch_idx, pos, k, v, k_cache, v_cache)
            kv_len = torch.full((2,), cur + 1)
            logical = create_block_mask(
                noop_mask, 2, 1, 1, cur + 1, device="cpu", BLOCK_SIZE=(page_size, page_size)
            )
            bm = paged.convert_logical_block_mask(logical, batch_idx, kv_len=kv_len)
            sm = paged.get_score_mod(tanh_softcap, kv_len=kv_len)
            y = flex_attention(q, k_cache, v_cache, score_mod=sm, block_mask=bm)
            logits = model.out(x, y)[:, -1]
            print(f"decode step {step} (kv_len {cur + 1}) logits[:, :4]:",
                  [[round(t, 4) for t in r] for r in logits[:, :4].tolist()])
            next_tok = logits.argmax(-1)
            generated.append(next_tok.tolist())
            cur += 1
        print("generated tokens per step:", generated)


if __name__ == "__main__":
    main()
