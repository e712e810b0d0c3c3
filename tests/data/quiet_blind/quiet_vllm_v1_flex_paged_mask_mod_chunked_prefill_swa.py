# Correct program (quiet batch quiet-r82a).
# Citation: vllm-project/vllm vllm/v1/attention/backends/flex_attention.py
#   @00507c2ee493c43a1b52770367e26556e92ea851 (physical_to_logical_mapping, unique_static_unsorted, causal_mask_mod,
#   FlexAttentionMetadata._convert_physical_to_logical / get_paged_mask_mod / get_sliding_window_mask_mod /
#   get_mask_mod / _build_block_mask_direct / build_block_mask / __post_init__, FlexAttentionMetadataBuilder.build,
#   FlexAttentionImpl.do_kv_cache_update / forward).
# vLLM v1's FlexAttention backend over a paged KV cache: all scheduled tokens of a step are packed into one query
# row; the keys are the whole physical cache (num_gpu_blocks * block_size slots). The mask_mod maps each query to its
# request through doc_ids (from query_start_loc), each physical key slot to a logical position through the inverse
# block table, keeps keys below the request's seq_len, and compares logical positions causally, the query's
# position being offset by the request's computed tokens (decode_offset). Sliding-window layers AND a window
# |q - kv| < sliding_window on top and prune out-of-window pages in the direct block-mask build.
# Adaptation: reshape_and_cache_flash (a CUDA op) is written in Python over slot_mapping; the scheduler is a
# three-step continuous batch (a prefill, a chunked prefill in two chunks, a late-joining request, decodes);
# flex_attention / create_block_mask run eagerly on CPU. Self-check: every token's output equals a per-request run
# over its own unpadded sequence, a loop over query positions slicing keys [start, t] (no mask tensor).
import math
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask, flex_attention

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def cdiv(a, b):
    return -(a // -b)


def _offsets_to_doc_ids_tensor(offsets_cpu, device):
    counts = offsets_cpu[1:] - offsets_cpu[:-1]
    doc_ids = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts)
    return doc_ids.to(device, non_blocking=True)


def pad_to_multiple(x, multiple, dim):
    difference = (multiple - (x.shape[dim] % multiple)) % multiple
    if difference == 0:
        return x
    dim = dim if dim >= 0 else x.ndim + dim
    pad_list = []
    for i in range(x.ndim - 1, dim - 1, -1):
        if i == dim:
            pad_list.extend([0, difference])
        else:
            pad_list.extend([0, 0])
    return F.pad(x, pad_list, mode="constant", value=0)


def physical_to_logical_mapping(block_table, seq_lens, block_size, total_blocks):
    max_reqs, max_num_blocks = block_table.shape
    device = block_table.device
    physical_to_logical = torch.full((max_reqs, total_blocks), -1, dtype=torch.long, device=device)
    num_blocks_per_seq = cdiv(seq_lens, block_size)
    mask = torch.arange(max_num_blocks, device=device)[None, :] < num_blocks_per_seq[:, None]
    valid_block_table = torch.where(mask, block_table, 0)
    valid_logical_indices = torch.where(mask, torch.arange(max_num_blocks, device=device)[None, :], 0)
    physical_to_logical.scatter_reduce_(-1, valid_block_table.to(torch.int64), valid_logical_indices, reduce="amax")
    # NB - Seems like block 0 is always empty so we reset it manually
    physical_to_logical[:, 0] = -1
    return physical_to_logical


def unique_static_unsorted(x, *, M, dim=-1, ignored_val=0, pad_val=-1):
    dim = dim % x.ndim
    x_perm = x.movedim(dim, -1)
    B, N = x_perm.numel() // x_perm.shape[-1], x_perm.shape[-1]
    x_flat = x_perm.reshape(B, N)
    device = x.device
    idx = torch.arange(N, device=device).expand(B, N)
    first_idx = torch.full((B, M + 1), N, device=device)
    first_idx.scatter_reduce_(1, x_flat, idx, reduce="amin")
    keep = (x_flat != ignored_val) & (idx == first_idx.gather(1, x_flat))
    dest_pos = torch.cumsum(keep.to(torch.long), dim=1) - 1
    dest_pos = torch.where(keep, dest_pos, N)
    packed_extended = torch.full((B, N + 1), pad_val, device=device, dtype=x_flat.dtype)
    packed_flat = packed_extended.scatter_(1, dest_pos, x_flat)[:, :N]
    return packed_flat.reshape(x_perm.shape).movedim(-1, dim)


def causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def copy_to_persistent(dst, src):
    sliced = dst[tuple(slice(0, s) for s in src.shape)]
    sliced.copy_(src)
    return sliced


class FlexAttentionMetadata:
    def __init__(self, *, num_actual_tokens, max_query_len, query_start_loc, query_start_loc_cpu, max_seq_len,
                 seq_lens, block_table, slot_mapping, total_cache_tokens, block_size, num_reqs,
                 physical_to_logical, decode_offset, num_blocks_per_seq, persistent_kv_indices,
                 persistent_kv_num_blocks, persistent_doc_ids, direct_build, q_block_size, kv_block_size,
                 logical_mask_mod=causal_mask_mod):
        self.num_actual_tokens = num_actual_tokens
        self.max_query_len = max_query_len
        self.query_start_loc = query_start_loc
        self.query_start_loc_cpu = query_start_loc_cpu
        self.max_seq_len = max_seq_len
        self.seq_lens = seq_lens
        self.block_table = block_table
        self.slot_mapping = slot_mapping
        self.total_cache_tokens = total_cache_tokens
        self.block_size = block_size
        self.num_reqs = num_reqs
        self.physical_to_logical = physical_to_logical
        self.decode_offset = decode_offset
        self.num_blocks_per_seq = num_blocks_per_seq
        self.persistent_kv_indices = persistent_kv_indices
        self.persistent_kv_num_blocks = persistent_kv_num_blocks
        self.persistent_doc_ids = persistent_doc_ids
        self.direct_build = direct_build
        self.q_block_size = q_block_size
        self.kv_block_size = kv_block_size
        self.logical_mask_mod = logical_mask_mod
        self.uses_paged_kv = True
        self.sliding_window = None
        self.block_mask = None
        self.score_mod = None
        self.transformed_score_mod = None
        self.__post_init__()

    @property
    def logical_block_ids(self):
        return torch.arange(cdiv(self.max_seq_len, self.block_size), device=self.block_table.device, dtype=torch.long)

    def _convert_physical_to_logical(self, request_lookup, q_idx, physical_kv_idx):
        q_req = request_lookup[q_idx]
        physical_kv_block = physical_kv_idx // self.block_size
        physical_kv_offset = physical_kv_idx % self.block_size
        logical_block_idx = self.physical_to_logical[q_req, physical_kv_block]
        logical_kv_idx = logical_block_idx * self.block_size + physical_kv_offset
        live_block = logical_block_idx >= 0
        within_upper_bound = logical_kv_idx < self.seq_lens[q_req]
        within_lower_bound = logical_kv_idx >= 0
        is_valid = live_block & within_upper_bound & within_lower_bound
        local_q_idx = q_idx - self.query_start_loc[q_req]
        logical_q_idx = local_q_idx + self.decode_offset[q_req]
        return is_valid, logical_q_idx, logical_kv_idx

    def get_paged_mask_mod(self):
        assert self.doc_ids is not None

        def final_mask_mod(b, h, q_idx, physical_kv_idx):
            (is_valid, logical_q_idx, logical_kv_idx) = self._convert_physical_to_logical(
                self.doc_ids, q_idx, physical_kv_idx)
            return is_valid & self.logical_mask_mod(b, h, logical_q_idx, logical_kv_idx)

        return final_mask_mod

    def get_sliding_window_mask_mod(self):
        if self.sliding_window is None:
            raise ValueError("sliding_window must be set for sliding window attention")

        def sliding_window_mask_mod(b, h, q_idx, kv_idx):
            return torch.abs(q_idx - kv_idx) < self.sliding_window

        def final_mask_mod(b, h, q_idx, physical_kv_idx):
            (is_valid, logical_q_idx, logical_kv_idx) = self._convert_physical_to_logical(
                self.doc_ids, q_idx, physical_kv_idx)
            return torch.where(is_valid, sliding_window_mask_mod(b, h, logical_q_idx, logical_kv_idx), False)

        return final_mask_mod if self.uses_paged_kv else sliding_window_mask_mod

    def get_mask_mod(self):
        mask_mod = self.get_paged_mask_mod()
        if self.sliding_window is not None:
            sliding_window_mask_mod = self.get_sliding_window_mask_mod()
            mask_mod = and_masks(mask_mod, sliding_window_mask_mod)
        return mask_mod

    def _build_block_mask_direct(self):
        page_to_block_ratio = self.kv_block_size // self.block_size
        if page_to_block_ratio != 1:
            raise ValueError("FlexAttention currently requires the cache block size to equal kv_block_size")
        used_pages = self.block_table[self.doc_ids, : cdiv(self.max_seq_len, self.block_size)]
        if self.sliding_window:
            device = used_pages.device
            token_indices = torch.arange(self.doc_ids.shape[0], device=device, dtype=torch.long)
            logical_q_idx = token_indices - self.query_start_loc[self.doc_ids] + self.decode_offset[self.doc_ids]
            min_kv_idx = torch.clamp(logical_q_idx - (self.sliding_window - 1), min=0)
            min_block_idx = min_kv_idx // self.block_size
            sliding_mask = self.logical_block_ids >= min_block_idx[:, None]
            used_pages.masked_fill_(~sliding_mask, 0)
        used_pages_padded = pad_to_multiple(used_pages, multiple=self.q_block_size, dim=0)
        used_pages_padded = used_pages_padded.reshape(used_pages_padded.shape[0] // self.q_block_size, -1)
        used_pages_padded = used_pages_padded // page_to_block_ratio
        kv_indices = unique_static_unsorted((used_pages_padded.long()), M=self.num_blocks).to(torch.int32)
        kv_indices = copy_to_persistent(self.persistent_kv_indices, kv_indices)
        kv_num_blocks = (kv_indices >= 0).sum(dim=-1).to(torch.int32)
        kv_num_blocks = copy_to_persistent(self.persistent_kv_num_blocks, kv_num_blocks)
        return BlockMask.from_kv_blocks(
            seq_lengths=(self.num_actual_tokens, self.total_cache_tokens),
            kv_num_blocks=kv_num_blocks[None, None],
            kv_indices=kv_indices[None, None],
            full_kv_num_blocks=None,
            full_kv_indices=None,
            BLOCK_SIZE=(self.q_block_size, self.kv_block_size),
            mask_mod=self.mask_mod,
            compute_q_blocks=False,
        )

    def build_block_mask(self):
        mask_mod = self.get_mask_mod()
        kv_len = self.total_cache_tokens if self.uses_paged_kv else self.num_actual_tokens
        return create_block_mask(mask_mod, None, None, self.num_actual_tokens, kv_len,
                                 device=self.block_table.device, BLOCK_SIZE=(self.q_block_size, self.kv_block_size))

    def __post_init__(self):
        self.doc_ids = _offsets_to_doc_ids_tensor(self.query_start_loc_cpu, self.query_start_loc.device)
        self.doc_ids = copy_to_persistent(self.persistent_doc_ids, self.doc_ids)
        self.num_blocks = self.total_cache_tokens // self.block_size
        self.mask_mod = self.get_mask_mod()


class CommonAttentionMetadata:
    def __init__(self, query_start_loc, seq_lens, block_table_tensor, slot_mapping):
        self.query_start_loc = query_start_loc
        self.query_start_loc_cpu = query_start_loc.cpu()
        self.seq_lens = seq_lens
        self.num_reqs = seq_lens.shape[0]
        self.num_actual_tokens = int(query_start_loc[-1])
        self.max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        self.max_seq_len = int(seq_lens.max())
        self.block_table_tensor = block_table_tensor
        self.slot_mapping = slot_mapping

    def compute_num_computed_tokens(self):
        query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
        return (self.seq_lens - query_lens).to(torch.int32)


class FlexAttentionMetadataBuilder:
    def __init__(self, block_size, num_gpu_blocks, max_model_len, max_num_seqs, max_num_batched_tokens,
                 direct_build):
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.direct_build = direct_build
        self.q_block_size, self.kv_block_size = 16, block_size
        self.max_num_query_groups = cdiv(max_num_batched_tokens, self.q_block_size)
        max_num_pages_per_seq = cdiv(max_model_len, block_size)
        self.max_num_kv_indices = self.q_block_size * max_num_pages_per_seq
        self.max_num_seqs = max_num_seqs
        self.persistent_kv_num_blocks = torch.empty(self.max_num_query_groups, dtype=torch.int32)
        self.persistent_offset_tensor = torch.empty(max_num_seqs, dtype=torch.int32)
        self.persistent_doc_ids = torch.empty(max_num_batched_tokens, dtype=torch.int32)
        self.persistent_physical_to_logical = torch.empty(max_num_seqs, num_gpu_blocks, dtype=torch.long)
        self.persistent_kv_indices = torch.empty(self.max_num_query_groups, self.max_num_kv_indices,
                                                 dtype=torch.int32)

    def build(self, common_prefix_len, common_attn_metadata):
        seq_lens = common_attn_metadata.seq_lens
        block_table_tensor = common_attn_metadata.block_table_tensor
        num_blocks_per_seq = cdiv(seq_lens, self.block_size)
        total_cache_tokens = self.num_gpu_blocks * self.block_size
        inverse_block_table = physical_to_logical_mapping(block_table_tensor, seq_lens, self.block_size,
                                                          self.num_gpu_blocks)
        inverse_block_table = copy_to_persistent(self.persistent_physical_to_logical, inverse_block_table)
        offset_tensor = common_attn_metadata.compute_num_computed_tokens()
        offset_tensor = copy_to_persistent(self.persistent_offset_tensor, offset_tensor)
        out = FlexAttentionMetadata(
            num_actual_tokens=common_attn_metadata.num_actual_tokens,
            max_query_len=common_attn_metadata.max_query_len,
            query_start_loc=common_attn_metadata.query_start_loc,
            query_start_loc_cpu=common_attn_metadata.query_start_loc_cpu,
            max_seq_len=common_attn_metadata.max_seq_len,
            seq_lens=seq_lens,
            block_table=block_table_tensor,
            slot_mapping=common_attn_metadata.slot_mapping,
            total_cache_tokens=total_cache_tokens,
            block_size=self.block_size,
            num_reqs=common_attn_metadata.num_reqs,
            physical_to_logical=inverse_block_table,
            decode_offset=offset_tensor,
            num_blocks_per_seq=num_blocks_per_seq,
            persistent_kv_indices=self.persistent_kv_indices,
            persistent_kv_num_blocks=self.persistent_kv_num_blocks,
            persistent_doc_ids=self.persistent_doc_ids,
            direct_build=self.direct_build,
            q_block_size=self.q_block_size,
            kv_block_size=self.kv_block_size,
        )
        if out.block_mask is None:
            out.block_mask = out._build_block_mask_direct() if out.direct_build else out.build_block_mask()
        return out


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    block_size = key_cache.shape[1]
    blk = slot_mapping // block_size
    off = slot_mapping % block_size
    key_cache[blk, off] = key
    value_cache[blk, off] = value


class FlexAttentionImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads, sliding_window):
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window

    @staticmethod
    def view_as_4d(tensor):
        if tensor.ndim == 4:
            return tensor
        return tensor[None, :, :, :]

    def do_kv_cache_update(self, key, value, kv_cache, slot_mapping):
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping)

    def forward(self, query, key, value, kv_cache, attn_metadata, output):
        enable_gqa = self.num_kv_heads != self.num_heads
        num_actual_tokens = attn_metadata.num_actual_tokens
        needs_rebuild_block_mask = False
        if attn_metadata.sliding_window != self.sliding_window:
            attn_metadata.sliding_window = self.sliding_window
            if attn_metadata.direct_build:
                attn_metadata.mask_mod = attn_metadata.get_mask_mod()
            needs_rebuild_block_mask = True
        if needs_rebuild_block_mask or attn_metadata.block_mask is None:
            if attn_metadata.direct_build:
                attn_metadata.block_mask = attn_metadata._build_block_mask_direct()
            else:
                attn_metadata.block_mask = attn_metadata.build_block_mask()

        kv_cache = kv_cache.transpose(1, 2)
        hs = self.head_size
        key_cache, value_cache = kv_cache.split(hs, dim=-1)
        key_cache = key_cache.view(-1, self.num_kv_heads, self.head_size)
        value_cache = value_cache.view(-1, self.num_kv_heads, self.head_size)
        query, key_tensor, value_tensor = map(lambda x: self.view_as_4d(x).permute(0, 2, 1, 3),
                                              (query, key_cache, value_cache))
        query = query[:, :, :num_actual_tokens, :]
        out = flex_attention(query, key_tensor, value_tensor, attn_metadata.transformed_score_mod,
                             attn_metadata.block_mask, self.scale, enable_gqa=enable_gqa)
        out = out.permute(0, 2, 1, 3).squeeze(0)
        output[:num_actual_tokens, :, :].copy_(out)
        return output


# ---------------------------------------------------------------------------------------------------------------
# A tiny two-layer decoder (layer 0 global, layer 1 sliding window) and a continuous-batching scheduler.
HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 4, 2, 8
BLOCK_SIZE, NUM_GPU_BLOCKS, MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_BATCHED = 16, 10, 64, 4, 64
SLIDING_WINDOWS = [None, 8]


class Layer(torch.nn.Module):
    def __init__(self, sliding_window):
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE)
        self.o = torch.nn.Linear(NUM_HEADS * HEAD_SIZE, HIDDEN)
        self.sliding_window = sliding_window
        self.impl = FlexAttentionImpl(NUM_HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, NUM_KV_HEADS, sliding_window)

    def split(self, x):
        q, k, v = self.qkv(x).split([NUM_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE], -1)
        return (q.view(-1, NUM_HEADS, HEAD_SIZE), k.view(-1, NUM_KV_HEADS, HEAD_SIZE),
                v.view(-1, NUM_KV_HEADS, HEAD_SIZE))

    def forward(self, x, kv_cache, attn_metadata):
        q, k, v = self.split(x)
        self.impl.do_kv_cache_update(k, v, kv_cache, attn_metadata.slot_mapping)
        output = torch.empty(q.shape[0], NUM_HEADS, HEAD_SIZE)
        self.impl.forward(q, k, v, kv_cache, attn_metadata, output)
        return x + self.o(output.reshape(q.shape[0], -1))

    def reference(self, x):
        # One request alone, unpadded: for query position t, keys [start, t].
        q, k, v = self.split(x)
        rep = NUM_HEADS // NUM_KV_HEADS
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        rows = []
        for t in range(x.shape[0]):
            start = 0 if self.sliding_window is None else max(0, t - self.sliding_window + 1)
            s = torch.einsum("hd,khd->hk", q[t], k[start:t + 1]) * HEAD_SIZE ** -0.5
            rows.append(torch.einsum("hk,khd->hd", s.softmax(-1), v[start:t + 1]))
        return x + self.o(torch.stack(rows).reshape(x.shape[0], -1))


def alloc_kv_cache():
    # physical layout (num_blocks, block_size, num_kv_heads, 2 * head_size); logical (B, H, N, 2C) via stride order
    return torch.zeros(NUM_GPU_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE).permute(0, 2, 1, 3)


def run_engine(layers, prompts, schedule, direct_build):
    builder = FlexAttentionMetadataBuilder(BLOCK_SIZE, NUM_GPU_BLOCKS, MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_BATCHED,
                                           direct_build)
    kv_caches = [alloc_kv_cache() for _ in layers]
    free_blocks = [7, 3, 9, 1, 5, 8, 2, 6, 4]  # block 0 is the null block
    req_blocks = {r: [] for r in prompts}
    computed = {r: 0 for r in prompts}
    outputs = {r: [] for r in prompts}
    for step in schedule:  # list of (req, num_new_tokens)
        reqs = [r for r, _ in step]
        # garbage in unused block-table entries, as a persistent block table may hold
        block_table = torch.full((MAX_NUM_SEQS, cdiv(MAX_MODEL_LEN, BLOCK_SIZE)), 9, dtype=torch.int32)
        xs, slots, qsl, seq_lens = [], [], [0], []
        for i, (r, n) in enumerate(step):
            start, end = computed[r], computed[r] + n
            while len(req_blocks[r]) * BLOCK_SIZE < end:
                req_blocks[r].append(free_blocks.pop(0))
            block_table[i, :len(req_blocks[r])] = torch.tensor(req_blocks[r], dtype=torch.int32)
            xs.append(prompts[r][start:end])
            slots += [req_blocks[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
        common = CommonAttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens,
                                         dtype=torch.int32), block_table[:len(reqs)],
                                         torch.tensor(slots, dtype=torch.long))
        attn_metadata = builder.build(common_prefix_len=0, common_attn_metadata=common)
        h = torch.cat(xs)
        for layer, kv_cache in zip(layers, kv_caches):
            h = layer(h, kv_cache, attn_metadata)
        for i, (r, n) in enumerate(step):
            outputs[r].append(h[qsl[i]:qsl[i + 1]])
            computed[r] += n
    return {r: torch.cat(o) for r, o in outputs.items()}


def main():
    torch.manual_seed(0)
    layers = [Layer(w) for w in SLIDING_WINDOWS]
    lens = {"A": 21, "B": 35, "C": 9}
    # the "prompt + generated" stream of each request, embedded (decode steps feed the next embedding)
    prompts = {r: torch.randn(n, HIDDEN) for r, n in lens.items()}
    schedule = [
        [("A", 19), ("B", 12)],               # A prefill, B first chunk
        [("A", 1), ("B", 17), ("C", 7)],      # A decode, B second chunk (crosses a block), C joins
        [("A", 1), ("B", 1), ("C", 1)],       # decodes
        [("B", 5), ("C", 1)],                 # B finishes its prompt late (chunk), C decodes
    ]
    with torch.no_grad():
        refs = {}
        for r, x in prompts.items():
            h = x
            for layer in layers:
                h = layer.reference(h)
            refs[r] = h
        for direct_build in (True, False):
            outs = run_engine(layers, prompts, schedule, direct_build)
            for r in prompts:
                n = outs[r].shape[0]
                assert n == lens[r], (r, n)
                torch.testing.assert_close(outs[r], refs[r][:n], atol=1e-5, rtol=1e-5)
    print("vLLM v1 FlexAttention paged mask_mod (global + sliding window, direct and create_block_mask builds) "
          "matches per-request runs")


if __name__ == "__main__":
    main()
