# Citation: pytorch-labs/attention-gym attn_gym/paged_attention/paged_attention.py @41ef5bff15033269b8cd8a012214a637345c1ddd
#   (PagedAttention.reserve / assign / convert_logical_block_mask / get_mask_mod / get_score_mod),
#   attn_gym/paged_attention/utils.py @41ef5bff (batch_reserve, gen_offset, generate_score_mod),
#   attn_gym/paged_attention/model.py @9c6a48085455e6113051f14b2124194da64473f5 (PagedAttentionLayer,
#   apply_rotary_emb, precompute_freqs_cis) and latency.py @232f8c69 (how the masks are built and converted).
# A batch of three requests shares one physical K/V pool of pages. Pages are reserved round-robin in growing rounds
# (as random_init_paged_attention does), so each request's logical pages are scattered over the pool. Every step
# builds a *logical* BlockMask with BLOCK_SIZE=page_size over max_seq_len keys (causal for the prefill; for a decode
# step gen_offset(input_pos): key n is kept where 0 + off[b] >= n) and converts it to physical pages with
# convert_logical_block_mask, whose mask_mod maps a physical key back to its logical position through
# physical_to_logical (pages of other requests map to -1 and are dropped). The batch holds every slot in order, so
# batch_idx is the block mask's batch index. Prompts of 7, 4 and 10 tokens are prefilled right-padded to 10; the pad
# keys land beyond each request's length and are overwritten by its decode steps.
# Changed for CPU: device "cuda" -> "cpu", float32, flex_attention / create_block_mask uncompiled.
# Checked against each request run alone, unpadded, through the same weights with a dense causal softmax.
import math
from typing import Optional, Union

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import (
    BlockMask,
    _identity,
    _mask_mod_signature,
    _score_mod_signature,
    create_block_mask,
    flex_attention,
    noop_mask,
)

torch.manual_seed(0)
DEVICE = "cpu"


def _cdiv(x: Union[int, float, torch.Tensor], multiple: Union[int, float, torch.Tensor]):
    return (x + multiple - 1) // multiple


class PagedAttention:
    def __init__(self, n_pages: int, page_size: int, max_batch_size: int, device: str = DEVICE):
        self.n_pages = n_pages
        self.page_size = page_size
        # page table: [batch, logical_block_idx] -> physical_page_idx
        self.page_table = -torch.ones((max_batch_size, self.n_pages), dtype=torch.int64, device=device)
        # capacity: batch_idx -> allocated sequence length
        self.capacity = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        # index of empty pages that is available for allocation
        self.empty_pages = list(range(n_pages - 1, -1, -1))
        # mapping from physical page index to logical page index
        self.physical_to_logical = -torch.ones((max_batch_size, n_pages), dtype=torch.int64, device=device)

    def reserve(self, batch_idx: torch.Tensor, seq_len: torch.Tensor) -> None:
        if seq_len <= self.capacity[batch_idx]:
            return
        num_pages_to_allocate = _cdiv(seq_len - self.capacity[batch_idx], self.page_size)
        assert len(self.empty_pages) >= num_pages_to_allocate, (
            f"requested {num_pages_to_allocate.item()} pages "
            f"but there are only {len(self.empty_pages)} empty pages"
        )
        start_page_idx = self.capacity[batch_idx] // self.page_size
        end_page_idx = start_page_idx + num_pages_to_allocate
        # find empty physical pages
        allocated_pages = torch.tensor(self.empty_pages[-num_pages_to_allocate:], device=num_pages_to_allocate.device)
        self.empty_pages = self.empty_pages[:-num_pages_to_allocate]
        # update page table
        self.page_table[batch_idx, start_page_idx:end_page_idx] = allocated_pages
        # update metadata
        self.physical_to_logical[batch_idx, allocated_pages] = torch.arange(
            start_page_idx.item(), end_page_idx.item(), device=num_pages_to_allocate.device)
        self.capacity[batch_idx] += num_pages_to_allocate * self.page_size

    def assign(self, batch_idx: torch.Tensor, input_pos: torch.Tensor, k_val: torch.Tensor, v_val: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        if k_val.requires_grad:
            raise RuntimeError("val must not require gradient")
        B, H, S, K_D = k_val.shape
        V_D = v_val.shape[3]
        if B != batch_idx.shape[0]:
            raise RuntimeError(f"Expect val and batch_idx have the same batch size "
                               f"but got B={B} and B={batch_idx.shape[0]}.")
        if H != k_cache.shape[1]:
            raise RuntimeError(f"Expect val and cache has the same number of heads "
                               f"but got H={H} and H={k_cache.shape[1]}.")
        if S != input_pos.shape[1]:
            raise RuntimeError(f"Expect val and input_pos has the same length "
                               f"but got S={S} and S={input_pos.shape[0]}.")
        # find address
        logical_block_idx = input_pos // self.page_size  # [B, S]
        logical_block_offset = input_pos % self.page_size  # [B, S]
        physical_block_idx = torch.gather(
            self.page_table[batch_idx], 1, logical_block_idx.to(torch.int64)).to(torch.int32)  # [B, S]
        addr = (physical_block_idx * self.page_size + logical_block_offset).view(-1)  # [B*S]
        k_val = k_val.permute(1, 0, 2, 3).contiguous().view(1, H, B * S, K_D)
        v_val = v_val.permute(1, 0, 2, 3).contiguous().view(1, H, B * S, V_D)
        k_cache[:, :, addr, :] = k_val
        v_cache[:, :, addr, :] = v_val

    def convert_logical_block_mask(self, block_mask: BlockMask, batch_idx: Optional[torch.Tensor] = None) -> BlockMask:
        B, H, ROWS, MAX_BLOCKS_IN_COL = block_mask.kv_indices.shape
        if block_mask.BLOCK_SIZE[1] != self.page_size:
            raise RuntimeError(f"Expect block_mask has the same column block size as page_size"
                               f"but got size={block_mask.BLOCK_SIZE[1]} and size={self.page_size}")
        device = block_mask.kv_num_blocks.device
        if batch_idx is None:
            batch_idx = torch.arange(B, device=device)
        page_table = self.page_table[batch_idx]
        new_kv_num_blocks = block_mask.kv_num_blocks.clone()
        new_kv_indices = torch.zeros((B, H, ROWS, self.n_pages), dtype=torch.int32, device=device)
        new_kv_indices[:, :, :, :MAX_BLOCKS_IN_COL] = (
            torch.gather(page_table, 1, block_mask.kv_indices.view(B, -1).to(torch.int64))
            .view(block_mask.kv_indices.shape).to(torch.int32))
        new_full_kv_indices, new_full_kv_num_blocks = None, None
        if block_mask.full_kv_num_blocks is not None:
            assert block_mask.full_kv_indices is not None
            new_full_kv_num_blocks = block_mask.full_kv_num_blocks.clone()
            new_full_kv_indices = torch.zeros((B, H, ROWS, self.n_pages), dtype=torch.int32, device=device)
            new_full_kv_indices[:, :, :, :MAX_BLOCKS_IN_COL] = (
                torch.gather(page_table, 1, block_mask.full_kv_indices.view(B, -1).to(torch.int64))
                .view(block_mask.full_kv_indices.shape).to(torch.int32))
        new_mask_mod = self.get_mask_mod(block_mask.mask_mod)
        seq_lengths = (block_mask.seq_lengths[0], self.n_pages * self.page_size)
        return BlockMask.from_kv_blocks(new_kv_num_blocks, new_kv_indices, new_full_kv_num_blocks,
                                        new_full_kv_indices, block_mask.BLOCK_SIZE, new_mask_mod,
                                        seq_lengths=seq_lengths)

    def get_mask_mod(self, mask_mod: Optional[_mask_mod_signature]) -> _mask_mod_signature:
        if mask_mod is None:
            mask_mod = noop_mask

        def new_mask_mod(b, h, q_idx, physical_kv_idx):
            physical_kv_block = physical_kv_idx // self.page_size
            physical_kv_offset = physical_kv_idx % self.page_size
            logical_block_idx = self.physical_to_logical[b, physical_kv_block]
            logical_kv_idx = logical_block_idx * self.page_size + physical_kv_offset
            return torch.where(logical_block_idx >= 0, mask_mod(b, h, q_idx, logical_kv_idx), False)

        return new_mask_mod

    def get_score_mod(self, score_mod: Optional[_score_mod_signature]) -> _score_mod_signature:
        if score_mod is None:
            score_mod = _identity

        def new_score_mod(score, b, h, q_idx, physical_kv_idx):
            physical_kv_block = physical_kv_idx // self.page_size
            physical_kv_offset = physical_kv_idx % self.page_size
            logical_block_idx = self.physical_to_logical[b, physical_kv_block]
            logical_kv_idx = logical_block_idx * self.page_size + physical_kv_offset
            return torch.where(logical_block_idx >= 0, score_mod(score, b, h, q_idx, logical_kv_idx), float("-inf"))

        return new_score_mod


# ---- utils.py ----
def batch_reserve(paged_attention: PagedAttention, target_seq_len: torch.Tensor):
    (B,) = target_seq_len.shape
    for b in range(B):
        paged_attention.reserve(torch.tensor(b), target_seq_len[b])


def gen_offset(off: torch.Tensor):
    def offset(b, h, m, n):
        return m + off[b] >= n

    return offset


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


# ---- model.py ----
def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    # x: [B, S, H, D], freqs_cis: [B, S, D//2, 2]
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(xshaped.size(0), xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack([
        xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
        xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
    ], -1)
    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


def precompute_freqs_cis(seq_len: int, n_elem: int, base: int = 10000, dtype: torch.dtype = torch.float32) -> Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].float() / n_elem))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    cache = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)
    return cache.to(dtype=dtype, device=DEVICE)


class PagedAttentionLayer(torch.nn.Module):
    """An attention layer with paged attention"""

    def __init__(self, n_heads, head_dim, dtype, paged_attention, block_size: int = 256):
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
        self.freqs_cis = precompute_freqs_cis(block_size, self.head_dim, dtype=dtype)  # [block_size, D//2, 2]

    def qkv(self, input_pos, x):
        B, S, _ = x.shape
        kv_size = self.n_head * self.head_dim
        q, k, v = self.wqkv(x).split([kv_size, kv_size, kv_size], dim=-1)
        q = q.view(B, S, self.n_head, self.head_dim)
        k = k.view(B, S, self.n_head, self.head_dim)
        v = v.view(B, S, self.n_head, self.head_dim)
        freqs_cis = self.freqs_cis.unsqueeze(0)[torch.zeros((B, 1), dtype=torch.int), input_pos]  # [B, S, D//2, 2]
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        return map(lambda x: x.transpose(1, 2), (q, k, v))

    def forward(self, batch_idx: Tensor, input_pos: Tensor, x: Tensor, converted_block_mask: BlockMask,
                converted_score_mod: _score_mod_signature) -> Tensor:
        # input_pos: [B, S], batch_idx: [B], x: [B, S, D]
        B, S, _ = x.shape
        q, k, v = self.qkv(input_pos, x)
        self.paged_attention.assign(batch_idx, input_pos, k, v, self.k_cache_paged, self.v_cache_paged)
        y = flex_attention(q, self.k_cache_paged, self.v_cache_paged, block_mask=converted_block_mask,
                           score_mod=converted_score_mod)
        y = y.transpose(1, 2).contiguous().view(B, S, -1)
        return self.wo(y)


def reference(layer, x_seq):
    # one request alone, unpadded: dense causal softmax over its own keys
    L = x_seq.shape[0]
    pos = torch.arange(L).view(1, L)
    q, k, v = layer.qkv(pos, x_seq[None])
    scores = q @ k.transpose(-1, -2) / math.sqrt(layer.head_dim)
    keep = torch.ones(L, L, dtype=torch.bool).tril()
    scores = scores.masked_fill(~keep, float("-inf"))
    y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(1, L, -1)
    return layer.wo(y)[0]


def main():
    bsz, n_heads, head_dim, page_size, max_seq_len = 3, 4, 16, 8, 32
    n_pages = (max_seq_len + page_size - 1) // page_size * bsz
    paged_attention = PagedAttention(n_pages, page_size, bsz)
    # round-robin reservation in growing rounds, so the requests' pages interleave in the pool
    for seq_len in [[8, 16, 8], [16, 16, 24], [24, 32, 32], [max_seq_len] * bsz]:
        batch_reserve(paged_attention, torch.tensor(seq_len, device=DEVICE))
    print("page table:\n", paged_attention.page_table[:, : max_seq_len // page_size])

    layer = PagedAttentionLayer(n_heads, head_dim, torch.float32, paged_attention).eval()
    D = n_heads * head_dim
    prompt_lens = torch.tensor([7, 4, 10])
    n_decode = 9
    total = int(prompt_lens.max()) + n_decode
    xs = torch.randn(bsz, total, D)  # every request's token embeddings, prompt then decode steps
    batch_idx = torch.arange(bsz, device=DEVICE, dtype=torch.int32)
    outs = [[] for _ in range(bsz)]
    score_mod = _identity
    converted_score_mod = paged_attention.get_score_mod(score_mod)

    with torch.no_grad():
        # prefill: prompts right-padded to the longest one
        S = int(prompt_lens.max())
        x = torch.stack([
            torch.cat([xs[b, : prompt_lens[b]], torch.zeros(S - prompt_lens[b], D)]) for b in range(bsz)])
        input_pos = torch.arange(S, device=DEVICE).expand(bsz, S)
        block_mask = create_block_mask(causal_mask, bsz, 1, S, max_seq_len, BLOCK_SIZE=page_size, device=DEVICE)
        converted_block_mask = paged_attention.convert_logical_block_mask(block_mask)
        y = layer(batch_idx, input_pos, x, converted_block_mask, converted_score_mod)
        for b in range(bsz):
            outs[b].append(y[b, : prompt_lens[b]])

        # decode: one token per request per step, each at its own position
        lengths = prompt_lens.clone()
        for step in range(n_decode):
            input_pos = lengths.view(bsz, 1).to(torch.int64)
            x = torch.stack([xs[b, lengths[b]] for b in range(bsz)]).view(bsz, 1, D)
            mask_mod = gen_offset(lengths.to(torch.int32))
            block_mask = create_block_mask(mask_mod, bsz, 1, 1, max_seq_len, BLOCK_SIZE=page_size, device=DEVICE)
            converted_block_mask = paged_attention.convert_logical_block_mask(block_mask)
            y = layer(batch_idx, input_pos, x, converted_block_mask, converted_score_mod)
            for b in range(bsz):
                outs[b].append(y[b])
            lengths = lengths + 1

        worst = 0.0
        for b in range(bsz):
            got = torch.cat(outs[b])
            L = got.shape[0]
            ref = reference(layer, xs[b, :L])
            err = (got - ref).abs().max().item()
            worst = max(worst, err)
            print(f"request {b}: {L} tokens (prompt {int(prompt_lens[b])}), max abs diff {err:.2e}")
    assert worst < 1e-4, worst


if __name__ == "__main__":
    main()
