# meta-pytorch/attention-gym#190 (commit 672e59b, "Fix get_mask_mod and get_score_mod to use correct batch
# indices"). attn_gym/paged_attention: PagedAttention.convert_logical_block_mask maps a logical BlockMask onto
# the physical pages of a shared KV cache. The BlockMask may cover only some of the page table's rows
# (`batch_idx`: one slot at prefill, the live slots at decode), and the page table is gathered with
# `batch_idx` -- but the converted mask_mod / score_mod looked up `self.physical_to_logical[b, page]` with the
# BlockMask's own batch index b, i.e. the page map of slot b of the table rather than of slot batch_idx[b].
# A request prefilled in slot 1 is scored over slot 0's pages; a decode batch [1, 2] reads rows 0 and 1.
# Fix: get_mask_mod / get_score_mod take batch_idx and index `self.physical_to_logical[batch_idx]`.
# Ported from attn_gym/paged_attention/{paged_attention,model,utils,throughput}.py at 672e59b^ (CPU, tiny
# sizes, float32, no torch.compile, a fixed request list instead of the OpenOrca sample).
import sys
from collections import deque
from typing import Optional, Tuple, Union

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import (
    _identity,
    _mask_mod_signature,
    _score_mod_signature,
    BlockMask,
    create_block_mask,
    flex_attention,
    noop_mask,
)

FIXED = "--fixed" in sys.argv
DEVICE = "cpu"


def _cdiv(x: Union[int, float, torch.Tensor], multiple: Union[int, float, torch.Tensor]):
    return (x + multiple - 1) // multiple


class PagedAttention:
    def __init__(self, n_pages: int, page_size: int, max_batch_size: int, device: str = DEVICE):
        self.n_pages = n_pages
        self.page_size = page_size
        # page table: [batch, logical_block_idx] -> physical_page_idx
        self.page_table = -torch.ones((max_batch_size, self.n_pages), dtype=torch.int64, device=device)
        self.capacity = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.empty_pages = list(range(n_pages - 1, -1, -1))
        # mapping from physical page index to logical page index
        self.physical_to_logical = -torch.ones((max_batch_size, n_pages), dtype=torch.int64, device=device)

    def reserve(self, batch_idx: torch.Tensor, seq_len: torch.Tensor) -> None:
        if seq_len <= self.capacity[batch_idx]:
            return
        num_pages_to_allocate = _cdiv(seq_len - self.capacity[batch_idx], self.page_size)
        assert len(self.empty_pages) >= num_pages_to_allocate
        start_page_idx = self.capacity[batch_idx] // self.page_size
        end_page_idx = start_page_idx + num_pages_to_allocate
        allocated_pages = torch.tensor(
            self.empty_pages[-num_pages_to_allocate:], device=num_pages_to_allocate.device
        )
        self.empty_pages = self.empty_pages[:-num_pages_to_allocate]
        self.page_table[batch_idx, start_page_idx:end_page_idx] = allocated_pages
        self.physical_to_logical[batch_idx, allocated_pages] = torch.arange(
            start_page_idx.item(), end_page_idx.item(), device=num_pages_to_allocate.device
        )
        self.capacity[batch_idx] += num_pages_to_allocate * self.page_size

    def erase(self, batch_idx: torch.Tensor) -> None:
        allocated_page_idx = self.page_table[batch_idx] != -1
        allocated_pages = self.page_table[batch_idx][allocated_page_idx]
        self.capacity[batch_idx] = 0
        self.empty_pages += allocated_pages.tolist()
        self.physical_to_logical[batch_idx][:, allocated_pages] = -1
        self.page_table[batch_idx] = -1

    def assign(self, batch_idx, input_pos, k_val, v_val, k_cache, v_cache) -> None:
        B, H, S, K_D = k_val.shape
        V_D = v_val.shape[3]
        logical_block_idx = input_pos // self.page_size  # [B, S]
        logical_block_offset = input_pos % self.page_size  # [B, S]
        physical_block_idx = torch.gather(
            self.page_table[batch_idx], 1, logical_block_idx.to(torch.int64)
        ).to(torch.int32)  # [B, S]
        addr = (physical_block_idx * self.page_size + logical_block_offset).view(-1)  # [B*S]
        k_val = k_val.permute(1, 0, 2, 3).contiguous().view(1, H, B * S, K_D)
        v_val = v_val.permute(1, 0, 2, 3).contiguous().view(1, H, B * S, V_D)
        k_cache[:, :, addr, :] = k_val
        v_cache[:, :, addr, :] = v_val

    def convert_logical_block_mask(self, block_mask: BlockMask, batch_idx: Optional[torch.Tensor] = None) -> BlockMask:
        B, H, ROWS, MAX_BLOCKS_IN_COL = block_mask.kv_indices.shape
        if block_mask.BLOCK_SIZE[1] != self.page_size:
            raise RuntimeError("Expect block_mask has the same column block size as page_size")
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
            new_mask_mod = self.get_mask_mod(block_mask.mask_mod, batch_idx=batch_idx)
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

    def get_mask_mod(self, mask_mod: Optional[_mask_mod_signature], batch_idx: Optional[torch.Tensor] = None) -> _mask_mod_signature:
        if mask_mod is None:
            mask_mod = noop_mask
        if batch_idx is not None:
            physical_to_logical = self.physical_to_logical[batch_idx]
        else:
            physical_to_logical = self.physical_to_logical

        def new_mask_mod(b, h, q_idx, physical_kv_idx):
            physical_kv_block = physical_kv_idx // self.page_size
            physical_kv_offset = physical_kv_idx % self.page_size
            logical_block_idx = physical_to_logical[b, physical_kv_block]
            logical_kv_idx = logical_block_idx * self.page_size + physical_kv_offset
            return torch.where(logical_block_idx >= 0, mask_mod(b, h, q_idx, logical_kv_idx), False)

        return new_mask_mod

    def get_score_mod(self, score_mod: Optional[_score_mod_signature], batch_idx: Optional[torch.Tensor] = None) -> _score_mod_signature:
        if score_mod is None:
            score_mod = _identity
        if batch_idx is not None:
            physical_to_logical = self.physical_to_logical[batch_idx]
        else:
            physical_to_logical = self.physical_to_logical

        def new_score_mod(score, b, h, q_idx, physical_kv_idx):
            physical_kv_block = physical_kv_idx // self.page_size
            physical_kv_offset = physical_kv_idx % self.page_size
            logical_block_idx = physical_to_logical[b, physical_kv_block]
            logical_kv_idx = logical_block_idx * self.page_size + physical_kv_offset
            return torch.where(
                logical_block_idx >= 0,
                score_mod(score, b, h, q_idx, logical_kv_idx),
                float("-inf"),
            )

        return new_score_mod


# ---- model.py ----
def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(xshaped.size(0), xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    return x_out2.flatten(3).type_as(x)


def precompute_freqs_cis(seq_len: int, n_elem: int, base: int = 10000, dtype=torch.float32) -> Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].float() / n_elem))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    cache = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)
    return cache.to(dtype=dtype, device=DEVICE)


class PagedAttentionLayer(torch.nn.Module):
    def __init__(self, n_heads, head_dim, dtype, paged_attention, block_size: int = 1024):
        super().__init__()
        self.n_head = n_heads
        self.head_dim = head_dim
        total_head_dim = n_heads * head_dim
        self.wqkv = torch.nn.Linear(total_head_dim, 3 * total_head_dim, bias=False, device=DEVICE, dtype=dtype)
        self.wo = torch.nn.Linear(total_head_dim, total_head_dim, bias=False, device=DEVICE, dtype=dtype)
        # allocate kv cache with batch size=1 for paged attention
        max_cached_seq_len = paged_attention.n_pages * paged_attention.page_size
        self.k_cache_paged = torch.randn(1, n_heads, max_cached_seq_len, head_dim, device=DEVICE, dtype=dtype)
        self.v_cache_paged = torch.randn(1, n_heads, max_cached_seq_len, head_dim, device=DEVICE, dtype=dtype)
        self.paged_attention = paged_attention
        self.freqs_cis = precompute_freqs_cis(block_size, self.head_dim, dtype=dtype)

    def forward(self, batch_idx, input_pos, x, converted_block_mask, converted_score_mod):
        B, S, _ = x.shape
        kv_size = self.n_head * self.head_dim
        q, k, v = self.wqkv(x).split([kv_size, kv_size, kv_size], dim=-1)
        q = q.view(B, S, self.n_head, self.head_dim)
        k = k.view(B, S, self.n_head, self.head_dim)
        v = v.view(B, S, self.n_head, self.head_dim)
        freqs_cis = self.freqs_cis.unsqueeze(0)[torch.zeros((B, 1), dtype=torch.int), input_pos]
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        q, k, v = map(lambda x: x.transpose(1, 2), (q, k, v))
        self.paged_attention.assign(batch_idx, input_pos, k, v, self.k_cache_paged, self.v_cache_paged)
        y = flex_attention(
            q,
            self.k_cache_paged,
            self.v_cache_paged,
            block_mask=converted_block_mask,
            score_mod=converted_score_mod,
        )
        y = y.transpose(1, 2).contiguous().view(B, S, -1)
        return self.wo(y)


# ---- utils.py ----
def gen_offset(off: torch.Tensor):
    def offset(b, h, m, n):
        return m + off[b] >= n

    return offset


def _adjust_num_blocks_and_indices(num_blocks, indices, batch_idx, new_num_rows, new_num_cols):
    indices = indices[[batch_idx], :, :new_num_rows, :new_num_cols]
    num_blocks = num_blocks[[batch_idx], :, :new_num_rows]
    num_blocks = torch.where(num_blocks < new_num_cols, num_blocks, new_num_cols)
    num_blocks = torch.sum(indices < num_blocks[:, :, :, None], dim=-1).to(torch.int32)
    return num_blocks.clone(), indices.clone()


def slice_block_mask(block_mask: BlockMask, batch_idx: int, new_q_len: int, new_kv_len: int) -> BlockMask:
    new_num_rows = (new_q_len + block_mask.BLOCK_SIZE[0] - 1) // block_mask.BLOCK_SIZE[0]
    new_num_cols = (new_kv_len + block_mask.BLOCK_SIZE[1] - 1) // block_mask.BLOCK_SIZE[1]
    new_kv_num_blocks, new_kv_indices = _adjust_num_blocks_and_indices(
        block_mask.kv_num_blocks, block_mask.kv_indices, batch_idx, new_num_rows, new_num_cols
    )
    if block_mask.full_kv_num_blocks is not None:
        new_full_kv_num_blocks, new_full_kv_indices = _adjust_num_blocks_and_indices(
            block_mask.full_kv_num_blocks, block_mask.full_kv_indices, batch_idx, new_num_rows, new_num_cols
        )
    else:
        new_full_kv_num_blocks = None
        new_full_kv_indices = None
    new_block_mask = block_mask.from_kv_blocks(
        new_kv_num_blocks,
        new_kv_indices,
        new_full_kv_num_blocks,
        new_full_kv_indices,
        block_mask.BLOCK_SIZE,
        block_mask.mask_mod,
    )
    new_block_mask.seq_lengths = (new_q_len, new_kv_len)
    return new_block_mask


# ---- throughput.py ----
class Server:
    def __init__(self, batch_size: int, n_pages: int, page_size: int, n_heads: int, head_dim: int, max_len: int):
        self.paged_attention = PagedAttention(n_pages, page_size, batch_size)
        self.model = PagedAttentionLayer(n_heads, head_dim, torch.float32, self.paged_attention)
        self.batch_size = batch_size
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.bsz_watermark = 0
        self.available_batch_idx = list(range(batch_size))[::-1]
        self.request_queue = deque([])
        self.batch_idx = []
        self.input_pos = torch.zeros(batch_size, device=DEVICE, dtype=torch.int64)
        self.request_length = torch.tensor([float("inf")] * batch_size, device=DEVICE)
        self.token_embedding = torch.randn((batch_size, 1, n_heads * head_dim), device=DEVICE)
        self.block_mask = create_block_mask(
            lambda b, h, q, kv: q >= kv, batch_size, 1, max_len, max_len, device=DEVICE, BLOCK_SIZE=page_size
        )

    def receive_request(self, prompt_len: int, response_len: int):
        self.request_queue.append((prompt_len, response_len))

    def can_schedule(self, request: Tuple[int, int]) -> bool:
        return len(self.paged_attention.empty_pages) * self.paged_attention.page_size >= sum(request)

    def prefill_one_token(self, batch_idx: int, prompt_len: int, response_len: int):
        self.paged_attention.reserve(
            torch.tensor(batch_idx, device=DEVICE),
            torch.tensor(prompt_len + response_len, device=DEVICE),
        )
        token_embedding = torch.randn(1, prompt_len, self.head_dim * self.n_heads, device=DEVICE)
        new_block_mask = slice_block_mask(self.block_mask, batch_idx, prompt_len, prompt_len)
        converted_block_mask = self.paged_attention.convert_logical_block_mask(
            new_block_mask, torch.tensor([batch_idx], device=DEVICE)
        )
        if FIXED:
            converted_score_mod = self.paged_attention.get_score_mod(
                _identity, torch.tensor([batch_idx], device=DEVICE)
            )
        else:
            converted_score_mod = self.paged_attention.get_score_mod(_identity)
        prefill_input_pos = torch.arange(prompt_len, device=DEVICE).view(1, -1)
        return self.model(
            torch.tensor([batch_idx], device=DEVICE),
            prefill_input_pos,
            token_embedding,
            converted_block_mask,
            converted_score_mod,
        )

    def prefill(self):
        while self.request_queue and self.can_schedule(self.request_queue[0]) and self.available_batch_idx:
            prompt_len, response_len = self.request_queue.popleft()
            new_batch_idx = self.available_batch_idx.pop()
            token_embedding = self.prefill_one_token(new_batch_idx, prompt_len, response_len)
            self.token_embedding[new_batch_idx] = token_embedding[:, -1].view(1, -1)
            self.batch_idx.append(new_batch_idx)
            self.input_pos[new_batch_idx] = prompt_len
            self.request_length[new_batch_idx] = prompt_len + response_len
        self.bsz_watermark = max(self.bsz_watermark, len(self.batch_idx))

    def get_decode_mask(self, batch_idx: torch.Tensor, input_pos: torch.Tensor):
        (B,) = batch_idx.shape
        input_block_idx = input_pos // self.block_mask.BLOCK_SIZE[0]
        kv_num_blocks = self.block_mask.kv_num_blocks[batch_idx, :, input_block_idx].view(B, 1, 1)
        kv_indices = self.block_mask.kv_indices[batch_idx, :, input_block_idx].view(B, 1, 1, -1)
        full_kv_num_blocks, full_kv_indices = None, None
        if self.block_mask.full_kv_num_blocks is not None:
            full_kv_num_blocks = self.block_mask.full_kv_num_blocks[batch_idx, :, input_block_idx].view(B, 1, 1)
            full_kv_indices = self.block_mask.full_kv_indices[batch_idx, :, input_block_idx].view(B, 1, 1, -1)
        seq_length = (1, self.block_mask.seq_lengths[1])
        return BlockMask.from_kv_blocks(
            kv_num_blocks,
            kv_indices,
            full_kv_num_blocks,
            full_kv_indices,
            BLOCK_SIZE=self.block_mask.BLOCK_SIZE,
            mask_mod=gen_offset(input_pos),
            seq_lengths=seq_length,
        )

    def decode(self):
        B = len(self.batch_idx)
        batch_idx = torch.tensor(self.batch_idx, device=DEVICE).view(-1)
        input_pos = self.input_pos[batch_idx]
        mask = self.get_decode_mask(batch_idx, input_pos)
        converted_block_mask = self.paged_attention.convert_logical_block_mask(mask, batch_idx)
        if FIXED:
            converted_score_mod = self.paged_attention.get_score_mod(_identity, batch_idx=batch_idx)
        else:
            converted_score_mod = self.paged_attention.get_score_mod(_identity)
        self.token_embedding[batch_idx] = self.model(
            batch_idx,
            input_pos.view(B, 1),
            self.token_embedding[batch_idx],
            converted_block_mask,
            converted_score_mod,
        )
        self.input_pos[batch_idx] += 1

    def clean(self):
        completed_batch_indices = torch.where(self.input_pos >= self.request_length)[0]
        self.available_batch_idx += completed_batch_indices.tolist()
        self.batch_idx = [idx for idx in self.batch_idx if idx not in completed_batch_indices.tolist()]
        for b in completed_batch_indices:
            self.paged_attention.erase(torch.tensor([b]))
        self.request_length[completed_batch_indices] = float("inf")


if __name__ == "__main__":
    torch.manual_seed(0)
    batch_size, n_pages, page_size, n_heads, head_dim, max_len = 4, 16, 16, 2, 8, 256
    # (prompt_len, response_len) per arriving request
    requests = deque([(20, 3), (35, 7), (12, 9), (28, 6), (9, 5)])
    server = Server(batch_size, n_pages, page_size, n_heads, head_dim, max_len)

    gap = 3
    with torch.no_grad():
        for i in range(4):
            for _ in range(2 if i == 0 else 1):
                if requests:
                    server.receive_request(*requests.popleft())
            server.prefill()
            for _ in range(gap):
                server.decode()
            print(f"round {i}: slots {server.batch_idx}, "
                  f"embedding norms {[round(server.token_embedding[b].norm().item(), 4) for b in server.batch_idx]}")
            server.clean()

    print("max batch size served:", server.bsz_watermark)
    print("final embeddings sum:", round(server.token_embedding.sum().item(), 4))
