# Correct program (quiet batch quiet-r98a).
# Citation: vllm-project/vllm vllm/v1/attention/backends/utils.py @a9e3b0a07e039954a9fd1e3def76e0513b8ed4f5
#   (CommonAttentionMetadata, make_local_attention_virtual_batches) and
#   vllm/attention/layers/chunked_local_attention.py @0213df59b989532decada57250b27e7284384658
#   (create_chunked_local_attention_backend: the underlying builder's build() runs on the virtual batches);
#   the FlashAttention backend's metadata builder / forward (reshape_and_cache_flash over slot_mapping, then
#   flash_attn_varlen_func(cu_seqlens_q, seqused_k, block_table, causal=True)).
# Llama 4's chunked local attention in vLLM v1: a RoPE layer attends only inside its attn_chunk_size chunk. vLLM does
# not hand the kernel a chunk mask: it splits every request's scheduled tokens into "virtual" requests, one per chunk
# the queries touch, each with its own cu_seqlens_q entry, seqused_k (keys of that chunk up to the last query) and a
# block table row starting at the chunk's first page; the kernel then runs plain bottom-right causal attention.
# The NoPE layer runs the same step's metadata unchanged (full causal over the request's pages).
# Adaptation: reshape_and_cache_flash (CUDA) and flash_attn_varlen_func with block_table (CUDA) are written in torch;
# a toy two-layer model (GQA, neox RoPE on the chunked layer); a five-step continuous batch (chunked prefill, a
# late-joining request whose prefill crosses chunk boundaries, decodes crossing a chunk edge), pages handed out from
# a shuffled free list. Self-check: every scheduled token's output equals its request run alone, unpadded, with a
# loop over query positions slicing keys [chunk_start(t), t] for the local layer and [0, t] for the global one.
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def cdiv(a, b):
    return -(a // -b)


@dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True


def make_local_attention_virtual_batches(
    attn_chunk_size: int,
    common_attn_metadata: CommonAttentionMetadata,
    block_size: int = 0,
) -> CommonAttentionMetadata:
    query_start_loc_np = common_attn_metadata.query_start_loc_cpu.numpy()
    seq_lens_np = common_attn_metadata.seq_lens_cpu.numpy()
    block_table = common_attn_metadata.block_table_tensor
    device = common_attn_metadata.query_start_loc.device

    q_seqlens = query_start_loc_np[1:] - query_start_loc_np[:-1]
    actual_batch_size = seq_lens_np.shape[0]

    q_tokens_in_first_block = np.minimum(
        attn_chunk_size - ((seq_lens_np - q_seqlens) % attn_chunk_size),
        q_seqlens).astype(np.int32)
    tokens_in_last_block = attn_chunk_size + (seq_lens_np % -attn_chunk_size)
    local_blocks = 1 + cdiv(q_seqlens - q_tokens_in_first_block,
                            attn_chunk_size)

    cu_num_blocks = np.cumsum(local_blocks)
    virtual_batches = cu_num_blocks[-1]
    block_offsets = np.repeat(cu_num_blocks - local_blocks, local_blocks)
    arange = np.arange(virtual_batches, dtype=np.int32) - block_offsets
    rarange = np.repeat(local_blocks, local_blocks) - arange - 1
    seqlens_q_local = \
        np.repeat(q_seqlens - q_tokens_in_first_block, local_blocks)
    seqlens_q_local[arange == 0] = q_tokens_in_first_block
    seqlens_q_local[arange > 0] = np.minimum(
        seqlens_q_local - attn_chunk_size * (arange - 1),
        attn_chunk_size)[arange > 0]

    cu_seqlens_q_local = np.empty(virtual_batches + 1, dtype=np.int32)
    np.cumsum(seqlens_q_local, out=cu_seqlens_q_local[1:])
    cu_seqlens_q_local[0] = 0

    seqlens_k_local = np.full(cu_num_blocks[-1],
                              attn_chunk_size,
                              dtype=np.int32)
    seqlens_k_local[cu_num_blocks - 1] = tokens_in_last_block
    num_computed_tokens_local = seqlens_k_local - seqlens_q_local

    k_seqstarts_absolute = np.repeat(seq_lens_np, local_blocks) - \
        (rarange * attn_chunk_size + \
            np.repeat(tokens_in_last_block, local_blocks))
    block_starts = k_seqstarts_absolute // block_size
    assert attn_chunk_size % block_size == 0, \
        f"attn_chunk_size {attn_chunk_size} is not " \
        f"divisible by block_size {block_size}"
    pages_per_local_batch = attn_chunk_size // block_size

    block_indices = (block_starts[:, None] +
                     np.arange(pages_per_local_batch, dtype=np.int32))
    block_indices = block_indices.reshape(-1).clip(max=block_table.shape[1] -
                                                   1)
    batch_indices = np.repeat(np.arange(actual_batch_size, dtype=np.int32),
                              local_blocks * pages_per_local_batch)

    batch_indices_torch = torch.from_numpy(batch_indices)
    block_indices_torch = torch.from_numpy(block_indices)
    block_table_local = block_table[batch_indices_torch, block_indices_torch]\
        .view(virtual_batches, -1)

    query_start_loc_cpu = torch.from_numpy(cu_seqlens_q_local)
    seq_lens_cpu = torch.from_numpy(seqlens_k_local)
    max_seq_len = int(seq_lens_cpu.max())

    return CommonAttentionMetadata(
        query_start_loc_cpu=query_start_loc_cpu,
        query_start_loc=query_start_loc_cpu.to(device=device,
                                               non_blocking=True),
        seq_lens_cpu=seq_lens_cpu,
        seq_lens=seq_lens_cpu.to(device=device, non_blocking=True),
        num_computed_tokens_cpu=torch.from_numpy(num_computed_tokens_local),
        num_reqs=len(seq_lens_cpu),
        num_actual_tokens=common_attn_metadata.num_actual_tokens,
        max_query_len=seqlens_q_local.max(),
        max_seq_len=max_seq_len,
        block_table_tensor=block_table_local,
        slot_mapping=common_attn_metadata.slot_mapping,
        causal=True,
    )


# ---- FlashAttention backend (vllm/v1/attention/backends/flash_attn.py), trimmed ----
@dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True


class FlashAttentionMetadataBuilder:
    def __init__(self, block_size):
        self.block_size = block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlashAttentionMetadata:
        return FlashAttentionMetadata(
            num_actual_tokens=common_attn_metadata.num_actual_tokens,
            max_query_len=int(common_attn_metadata.max_query_len),
            query_start_loc=common_attn_metadata.query_start_loc,
            max_seq_len=common_attn_metadata.max_seq_len,
            seq_lens=common_attn_metadata.seq_lens,
            block_table=common_attn_metadata.block_table_tensor,
            slot_mapping=common_attn_metadata.slot_mapping,
            causal=common_attn_metadata.causal,
        )


def create_chunked_local_attention_builder(attention_chunk_size: int, block_size: int):
    # create_chunked_local_attention_backend: a subclass of the underlying builder whose build() first turns the
    # step's metadata into local virtual batches.
    class ChunkedLocalAttention_FlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            common_attn_metadata = make_local_attention_virtual_batches(
                attention_chunk_size, common_attn_metadata, block_size)
            return super().build(common_prefix_len, common_attn_metadata, fast_build)

    return ChunkedLocalAttention_FlashAttentionMetadataBuilder(block_size)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    # key_cache: [num_blocks, block_size, num_kv_heads, head_size]
    block_size = key_cache.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    key_cache[blocks, offsets] = key
    value_cache[blocks, offsets] = value


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, softmax_scale, causal,
                           block_table, out):
    # Paged varlen kernel: batch item b owns queries cu_seqlens_q[b]:cu_seqlens_q[b+1] and its first seqused_k[b]
    # keys, read page by page through block_table[b]; causal is aligned bottom-right (the last query sees every key).
    block_size = k.shape[1]
    num_heads, num_kv_heads = q.shape[1], k.shape[2]
    for b in range(len(seqused_k)):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        seqlen_q, seqlen_k = qe - qs, int(seqused_k[b])
        if seqlen_q == 0:
            continue
        pages = block_table[b, :cdiv(seqlen_k, block_size)].long()
        kb = k[pages].reshape(-1, num_kv_heads, k.shape[-1])[:seqlen_k]
        vb = v[pages].reshape(-1, num_kv_heads, v.shape[-1])[:seqlen_k]
        kb = kb.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        vb = vb.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        qb = q[qs:qe].transpose(0, 1)
        mask = None
        if causal:
            qi = torch.arange(seqlen_q)[:, None]
            kj = torch.arange(seqlen_k)[None, :]
            mask = kj <= qi + (seqlen_k - seqlen_q)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=softmax_scale)
        out[qs:qe] = o.transpose(0, 1)
    return out


class FlashAttentionImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads):
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads

    def forward(self, query, key, value, kv_cache, attn_metadata: FlashAttentionMetadata):
        num_actual_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        reshape_and_cache_flash(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        output = torch.empty_like(query)
        flash_attn_varlen_func(
            q=query[:num_actual_tokens],
            k=key_cache,
            v=value_cache,
            out=output[:num_actual_tokens],
            cu_seqlens_q=attn_metadata.query_start_loc,
            max_seqlen_q=attn_metadata.max_query_len,
            seqused_k=attn_metadata.seq_lens,
            max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=attn_metadata.causal,
            block_table=attn_metadata.block_table,
        )
        return output


# ---- a toy Llama-4-like stack: layer 0 chunked local + RoPE, layer 1 global NoPE ----
HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 4, 2, 8
VOCAB, BLOCK_SIZE, ATTN_CHUNK, NUM_BLOCKS = 64, 4, 8, 32


def rope(x, positions, base=10000.0):
    half = x.shape[-1] // 2
    inv = 1.0 / (base ** (torch.arange(half, dtype=torch.float32) / half))
    ang = positions.float()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Layer(nn.Module):
    def __init__(self, use_rope):
        super().__init__()
        self.use_rope = use_rope
        self.qkv = nn.Linear(HIDDEN, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(NUM_HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.impl = FlashAttentionImpl(NUM_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, NUM_KV_HEADS)

    def qkv_split(self, h, positions):
        q, k, v = self.qkv(h).split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], -1)
        q = q.view(-1, NUM_HEADS, HEAD_DIM)
        k = k.view(-1, NUM_KV_HEADS, HEAD_DIM)
        v = v.view(-1, NUM_KV_HEADS, HEAD_DIM)
        if self.use_rope:
            q, k = rope(q, positions), rope(k, positions)
        return q, k, v

    def forward(self, h, positions, kv_cache, attn_metadata):
        q, k, v = self.qkv_split(h, positions)
        o = self.impl.forward(q, k, v, kv_cache, attn_metadata)
        return h + self.o_proj(o.reshape(-1, NUM_HEADS * HEAD_DIM))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Layer(use_rope=True), Layer(use_rope=False)])
        self.attention_chunk_size = [ATTN_CHUNK, None]


# ---- the engine: persistent block table, scheduler steps, metadata per step ----
class Engine:
    def __init__(self, model, max_num_reqs=4, max_blocks_per_req=8):
        self.model = model
        self.block_table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32)
        g = torch.Generator().manual_seed(1)
        self.free_blocks = (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()  # block 0 is the null block
        self.kv_caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for _ in model.layers]
        self.builders = [
            create_chunked_local_attention_builder(c, BLOCK_SIZE) if c is not None
            else FlashAttentionMetadataBuilder(BLOCK_SIZE)
            for c in model.attention_chunk_size
        ]
        self.req_ids, self.num_computed, self.num_blocks = [], [], []

    def add_request(self, req_id):
        self.req_ids.append(req_id)
        self.num_computed.append(0)
        self.num_blocks.append(0)

    @torch.no_grad()
    def step(self, scheduled):  # scheduled: {req_id: list of token ids}
        input_ids, positions, slots, q_lens, seq_lens, computed = [], [], [], [], [], []
        for i, rid in enumerate(self.req_ids):
            toks = scheduled[rid]
            start = self.num_computed[i]
            need = cdiv(start + len(toks), BLOCK_SIZE)
            while self.num_blocks[i] < need:
                self.block_table[i, self.num_blocks[i]] = self.free_blocks.pop(0)
                self.num_blocks[i] += 1
            pos = torch.arange(start, start + len(toks))
            input_ids.append(torch.tensor(toks))
            positions.append(pos)
            slots.append(self.block_table[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
            q_lens.append(len(toks))
            seq_lens.append(start + len(toks))
            computed.append(start)
        num_reqs = len(self.req_ids)
        query_start_loc_cpu = torch.zeros(num_reqs + 1, dtype=torch.int32)
        query_start_loc_cpu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc_cpu.clone(),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=seq_lens_cpu.clone(),
            seq_lens_cpu=seq_lens_cpu,
            num_computed_tokens_cpu=torch.tensor(computed, dtype=torch.int32),
            num_reqs=num_reqs,
            num_actual_tokens=int(query_start_loc_cpu[-1]),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            block_table_tensor=self.block_table[:num_reqs],
            slot_mapping=torch.cat(slots),
        )
        attn_metadata = [b.build(0, common) for b in self.builders]
        positions = torch.cat(positions)
        h = self.model.embed(torch.cat(input_ids))
        for layer, kv_cache, md in zip(self.model.layers, self.kv_caches, attn_metadata):
            h = layer(h, positions, kv_cache, md)
        for i, n in enumerate(q_lens):
            self.num_computed[i] += n
        outs = {}
        for i, rid in enumerate(self.req_ids):
            outs[rid] = h[int(query_start_loc_cpu[i]):int(query_start_loc_cpu[i + 1])]
        return outs


@torch.no_grad()
def reference(model, tokens):
    # One request alone, unpadded: a loop over query positions, keys sliced by hand.
    ids = torch.tensor(tokens)
    positions = torch.arange(len(tokens))
    h = model.embed(ids)
    for layer, chunk in zip(model.layers, model.attention_chunk_size):
        q, k, v = layer.qkv_split(h, positions)
        k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        o = torch.empty_like(q)
        for t in range(len(tokens)):
            lo = (t // chunk) * chunk if chunk is not None else 0
            s = torch.einsum("hd,khd->hk", q[t], k[lo:t + 1]) * HEAD_DIM ** -0.5
            o[t] = torch.einsum("hk,khd->hd", s.softmax(-1), v[lo:t + 1])
        h = h + layer.o_proj(o.reshape(-1, NUM_HEADS * HEAD_DIM))
    return h


def main():
    model = Model().eval()
    g = torch.Generator().manual_seed(2)
    streams = {
        "A": torch.randint(0, VOCAB, (16,), generator=g).tolist(),  # prompt 13, then 3 decodes
        "B": torch.randint(0, VOCAB, (10,), generator=g).tolist(),  # prompt 6, then 4 decodes
        "C": torch.randint(0, VOCAB, (21,), generator=g).tolist(),  # prompt 19 (two chunks of prefill), 2 decodes
    }
    schedule = [
        {"A": (0, 10), "B": (0, 6)},                      # A's prompt chunked: 10 of 13
        {"A": (10, 13), "B": (6, 7), "C": (0, 9)},        # C joins; its first chunk of prefill crosses position 8
        {"A": (13, 14), "B": (7, 8), "C": (9, 19)},       # C's second chunk crosses position 16
        {"A": (14, 15), "B": (8, 9), "C": (19, 20)},      # B's decode opens a new local chunk
        {"A": (15, 16), "B": (9, 10), "C": (20, 21)},
    ]
    engine = Engine(model)
    refs = {rid: reference(model, toks) for rid, toks in streams.items()}
    worst = 0.0
    for step in schedule:
        for rid in step:
            if rid not in engine.req_ids:
                engine.add_request(rid)
        outs = engine.step({rid: streams[rid][a:b] for rid, (a, b) in step.items()})
        for rid, (a, b) in step.items():
            err = (outs[rid] - refs[rid][a:b]).abs().max().item()
            worst = max(worst, err)
            assert torch.allclose(outs[rid], refs[rid][a:b], atol=1e-5), (rid, a, b, err)
    print(f"chunked-local virtual batches over paged KV match the per-request reference (max err {worst:.2e})")


if __name__ == "__main__":
    main()
