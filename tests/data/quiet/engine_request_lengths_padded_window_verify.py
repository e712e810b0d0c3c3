"""Correct per-request attention of three hand-written engines, each beside metadata that states per-request lengths.

Written for maskcli's tests (checks/reqlens.py must stay quiet):

1. a paged decode (vLLM v1's metadata: `query_start_loc`, `seq_lens`) whose torch fallback gathers each request's
   whole blocks, as the buggy fallback does, and masks the slots past `seq_lens[i]` (FlashInfer's and the
   paged-attention kernels' way: the padded slots are there, none is seen);
2. a sliding-window engine (Mistral's rolling buffer, `self.sliding_window` on the layer) whose cache keeps the last
   `sliding_window` keys only, while its metadata's `seq_lens` counts every token of the request;
3. a LightLLM-style MTP verify step: the state holds the expanded per-token `b_seq_len` (one per draft token) beside
   the per-request `b_att_seq_len` and `cu_seqlens_q`, and the kernel is handed the per-request counts, causal.
"""
import sys
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 4
_ = "--fixed" in sys.argv  # (a correct program: the same run either way)


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor


def paged_fallback(q, k_cache, v_cache, meta):
    out = torch.empty_like(q)
    for i in range(meta.block_table.shape[0]):
        start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
        keys = k_cache[meta.block_table[i]].flatten(0, 1)  # every slot of its blocks
        values = v_cache[meta.block_table[i]].flatten(0, 1)
        q_len, k_len, used = end - start, keys.shape[0], int(meta.seq_lens[i])
        pos = torch.arange(k_len)
        mask = (pos[None, :] < used) & (pos[None, :] <= used - q_len + torch.arange(q_len)[:, None])
        out[start:end] = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), keys.transpose(0, 1),
                                                        values.transpose(0, 1), attn_mask=mask).transpose(0, 1)
    return out


class PagedAttention(torch.nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)

    def forward(self, x, kv_cache, meta):
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, -1).unbind(1)
        return paged_fallback(q, kv_cache[0], kv_cache[1], meta).flatten(1)


@dataclass
class WindowMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


class RollingAttention(torch.nn.Module):
    """Decode over a rolling buffer of the last `sliding_window` keys of each request."""

    def __init__(self, hidden, heads, sliding_window):
        super().__init__()
        self.heads, self.sliding_window = heads, sliding_window
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)

    def forward(self, x, buffers, meta):
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, -1).unbind(1)
        out = torch.empty_like(q)
        for i, (keys, values) in enumerate(buffers):
            start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
            keys = torch.cat([keys, k[start:end]])[-self.sliding_window:]
            values = torch.cat([values, v[start:end]])[-self.sliding_window:]
            out[start:end] = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), keys.transpose(0, 1),
                                                            values.transpose(0, 1)).transpose(0, 1)
        return out.flatten(1)


def verify(q, k_buffer, v_buffer, state):
    """The per-request verify kernel: each request's drafts against its b_att_seq_len keys, causal at the end."""
    out = torch.empty_like(q)
    for b in range(state.cu_seqlens_q.numel() - 1):
        start, end = int(state.cu_seqlens_q[b]), int(state.cu_seqlens_q[b + 1])
        slots = state.page_table[b, : int(state.b_att_seq_len[b])].long()
        q_len, k_len = end - start, slots.numel()
        mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
        out[start:end] = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k_buffer[slots].transpose(0, 1),
                                                        v_buffer[slots].transpose(0, 1), attn_mask=mask).transpose(0, 1)
    return out


class VerifyState:
    def __init__(self, infer_state, page_table, mtp_size):
        self.infer_state = infer_state
        self.page_table = page_table
        self.b_att_seq_len = infer_state.b_seq_len[mtp_size - 1:: mtp_size].contiguous()
        requests = self.b_att_seq_len.numel()
        self.cu_seqlens_q = torch.arange(requests + 1, dtype=torch.int32) * mtp_size

    def decode_att(self, q, k_buffer, v_buffer):
        return verify(q, k_buffer, v_buffer, self)


def main():
    torch.manual_seed(0)
    hidden, heads = 16, 2
    with torch.no_grad():
        paged = PagedAttention(hidden, heads)
        cache = torch.randn(2, 6, BLOCK, heads, hidden // heads)
        paged(torch.randn(6, hidden), cache, AttentionMetadata(torch.tensor([0, 1, 6]), torch.tensor([7, 5]),
                                                               torch.tensor([[3, 1], [0, 4]])))
        rolling = RollingAttention(hidden, heads, sliding_window=4)
        buffers = [(torch.randn(3, heads, hidden // heads),) * 2, (torch.randn(3, heads, hidden // heads),) * 2]
        rolling(torch.randn(2, hidden), buffers, WindowMetadata(torch.tensor([0, 1, 2]), torch.tensor([12, 9])))
        mtp_size, lens = 3, [7, 10]
        b_seq_len = torch.tensor([n - mtp_size + 1 + i for n in lens for i in range(mtp_size)], dtype=torch.int32)
        infer_state = types.SimpleNamespace(b_seq_len=b_seq_len, batch_size=b_seq_len.numel())
        page_table = torch.stack([torch.randperm(24)[:12] for _ in lens]).int()
        state = VerifyState(infer_state, page_table, mtp_size)
        out = state.decode_att(torch.randn(6, heads, hidden // heads), torch.randn(24, heads, hidden // heads),
                               torch.randn(24, heads, hidden // heads))
    print("verify checksum:", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
