"""nano-vllm: chunked prefill sets seqlen_k to the whole prompt, so a chunk attends unwritten KV slots.

Citation: GeeeekExplorer/nano-vllm PR #213 ("fix(model_runner): correct seqlen_k to chunk boundary in
prepare_prefill", commit 25794a1, fixes issue #212).

Bug: `ModelRunner.prepare_prefill` built `cu_seqlens_k` from `seqlen_k = len(seq)` even when the
scheduler had only scheduled a chunk `seq[start:start + num_scheduled_tokens]`. Because
`cu_seqlens_k[-1] > cu_seqlens_q[-1]` the paged path is taken (`block_table` given), and
`flash_attn_varlen_func(..., causal=True)` aligns the causal diagonal bottom-right: query `i` of the
chunk sees keys up to `i + seqlen_k - seqlen_q`, i.e. KV slots of tokens that are not written yet
(whatever an earlier request left in those blocks), and the last query sees the whole block table.

Fix: compute `end = start + seqlen_q` first and set `seqlen_k = end`.

Reproduction: the upstream `prepare_prefill` / `Attention.forward` / `store_kvcache` logic on CPU; the
flash-attn varlen+paged kernel is replaced by a reference that gathers each sequence's keys through
its block table and calls `F.scaled_dot_product_attention` with the bottom-right causal mask that
flash-attn applies. Two sequences: a 14-token prompt whose first 8-token chunk is scheduled, and a
6-token prompt with a 4-token prefix-cache hit. Blocks hold stale KV from an earlier request.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Context:
    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None


_CONTEXT = Context()


def get_context():
    return _CONTEXT


def set_context(is_prefill, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                slot_mapping=None, context_lens=None, block_tables=None):
    global _CONTEXT
    _CONTEXT = Context(is_prefill, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, slot_mapping,
                       context_lens, block_tables)


class Sequence:
    block_size = 4

    def __init__(self, token_ids, block_table, num_cached_tokens, num_scheduled_tokens):
        self.token_ids = list(token_ids)
        self.block_table = block_table
        self.num_cached_tokens = num_cached_tokens
        self.num_scheduled_tokens = num_scheduled_tokens

    def __len__(self):
        return len(self.token_ids)

    def __getitem__(self, key):
        return self.token_ids[key]


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k,
                           softmax_scale, causal, block_table=None):
    """CPU reference of flash-attn's varlen kernel (paged when block_table is given).

    With causal=True flash-attn aligns the mask to the bottom-right corner: query i of a sequence
    with lengths (Lq, Lk) sees keys j <= i + Lk - Lq.
    """
    out = torch.empty_like(q)
    block_size = k.shape[1] if block_table is not None else None
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        lq, lk = qe - qs, int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        if block_table is not None:
            slots = (block_table[b].repeat_interleave(block_size) * block_size
                     + torch.arange(block_size).repeat(block_table.shape[1]))[:lk]
            kb = k.flatten(0, 1)[slots]
            vb = v.flatten(0, 1)[slots]
        else:
            ks = int(cu_seqlens_k[b])
            kb, vb = k[ks:ks + lk], v[ks:ks + lk]
        mask = None
        if causal:
            mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        out[qs:qe] = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1),
            attn_mask=mask, scale=softmax_scale).transpose(0, 1)
    return out


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = key
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = value


class Attention(torch.nn.Module):
    def __init__(self, num_heads, head_dim, scale, num_kv_heads):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q, k, v):
        context = get_context()
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache.numel() and v_cache.numel():
            store_kvcache(k, v, k_cache, v_cache, context.slot_mapping)
        if context.is_prefill:
            if context.block_tables is not None:    # prefix cache
                k, v = k_cache, v_cache
            o = flash_attn_varlen_func(q, k, v,
                                       max_seqlen_q=context.max_seqlen_q, cu_seqlens_q=context.cu_seqlens_q,
                                       max_seqlen_k=context.max_seqlen_k, cu_seqlens_k=context.cu_seqlens_k,
                                       softmax_scale=self.scale, causal=True, block_table=context.block_tables)
        else:
            raise NotImplementedError("decode is not exercised here")
        return o


class ModelRunner:
    def __init__(self, block_size):
        self.block_size = block_size

    def prepare_block_tables(self, seqs):
        max_len = max(len(seq.block_table) for seq in seqs)
        block_tables = [seq.block_table + [-1] * (max_len - len(seq.block_table)) for seq in seqs]
        return torch.tensor(block_tables, dtype=torch.int32)

    def prepare_prefill(self, seqs):
        input_ids = []
        positions = []
        cu_seqlens_q = [0]
        cu_seqlens_k = [0]
        max_seqlen_q = 0
        max_seqlen_k = 0
        slot_mapping = []
        block_tables = None
        for seq in seqs:
            seqlen = len(seq)
            start = min(seq.num_cached_tokens, seqlen - 1)
            seqlen_q = seq.num_scheduled_tokens
            if FIXED:
                end = start + seqlen_q
                seqlen_k = end
            else:
                seqlen_k = seqlen
                end = start + seqlen_q
            input_ids.extend(seq[start:end])
            positions.extend(range(start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + seqlen_q)
            cu_seqlens_k.append(cu_seqlens_k[-1] + seqlen_k)
            max_seqlen_q = max(seqlen_q, max_seqlen_q)
            max_seqlen_k = max(seqlen_k, max_seqlen_k)
            if not seq.block_table:    # warmup
                continue
            start_block = start // self.block_size
            end_block = (end + self.block_size - 1) // self.block_size
            for i in range(start_block, end_block):
                slot_start = seq.block_table[i] * self.block_size
                if i == start_block:
                    slot_start += start % self.block_size
                if i != end_block - 1:
                    slot_end = seq.block_table[i] * self.block_size + self.block_size
                else:
                    slot_end = seq.block_table[i] * self.block_size + end - i * self.block_size
                slot_mapping.extend(range(slot_start, slot_end))
        if cu_seqlens_k[-1] > cu_seqlens_q[-1]:    # prefix cache
            block_tables = self.prepare_block_tables(seqs)
        input_ids = torch.tensor(input_ids, dtype=torch.int64)
        positions = torch.tensor(positions, dtype=torch.int64)
        cu_seqlens_q = torch.tensor(cu_seqlens_q, dtype=torch.int32)
        cu_seqlens_k = torch.tensor(cu_seqlens_k, dtype=torch.int32)
        slot_mapping = torch.tensor(slot_mapping, dtype=torch.int32)
        set_context(True, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, slot_mapping, None, block_tables)
        return input_ids, positions


def main():
    block_size, num_blocks, num_heads, head_dim, vocab = 4, 10, 2, 8, 50
    runner = ModelRunner(block_size)
    attn = Attention(num_heads, head_dim, head_dim ** -0.5, num_heads)
    # the pool still holds KV written by a finished request: unwritten slots are not zero
    attn.k_cache = torch.randn(num_blocks, block_size, num_heads, head_dim)
    attn.v_cache = torch.randn(num_blocks, block_size, num_heads, head_dim)
    embed = torch.nn.Embedding(vocab, num_heads * head_dim)
    wq, wk, wv = (torch.nn.Linear(num_heads * head_dim, num_heads * head_dim, bias=False) for _ in range(3))

    seq_a = Sequence(torch.randint(0, vocab, (14,)).tolist(), [3, 7, 1, 5], num_cached_tokens=0,
                     num_scheduled_tokens=8)     # first chunk of a chunked prefill
    seq_b = Sequence(torch.randint(0, vocab, (6,)).tolist(), [0, 8], num_cached_tokens=4,
                     num_scheduled_tokens=2)     # prefix-cache hit on its first block
    # the cached block of seq_b holds its real KV
    with torch.no_grad():
        hb = embed(torch.tensor(seq_b[0:4]))
        attn.k_cache[0] = wk(hb).view(4, num_heads, head_dim)
        attn.v_cache[0] = wv(hb).view(4, num_heads, head_dim)

        input_ids, positions = runner.prepare_prefill([seq_a, seq_b])
        h = embed(input_ids)
        q = wq(h).view(-1, num_heads, head_dim)
        k = wk(h).view(-1, num_heads, head_dim)
        v = wv(h).view(-1, num_heads, head_dim)
        o = attn(q, k, v)
    ctx = get_context()
    print("cu_seqlens_q", ctx.cu_seqlens_q.tolist(), "cu_seqlens_k", ctx.cu_seqlens_k.tolist())
    print("output checksum", round(float(o.abs().sum()), 4))


if __name__ == "__main__":
    main()
