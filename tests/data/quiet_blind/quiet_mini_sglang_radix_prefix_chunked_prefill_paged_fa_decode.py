# A correct paged-KV inference engine: mini-sglang's scheduler (continuous batching of prefill and
# decode batches, chunked prefill under a token budget, a radix prefix cache over a paged token
# pool) feeding its FlashAttention backend's metadata (cu_seqlens_q, cache_seqlens, a page table
# sliced per request) to a CPU stand-in of sgl_kernel's flash_attn_with_kvcache(causal=True).
#
# Citation: sgl-project/mini-sglang @20fcd7f3c6a1898a61139fae1c97cc7a40bd8d66:
#   python/minisgl/core.py (Req, Batch, Context), python/minisgl/scheduler/{scheduler,prefill,
#   decode,cache,table,utils}.py (Scheduler._prepare_batch, _make_positions, _make_input_tuple,
#   _make_write_tuple, PrefillAdder, CacheManager.allocate_paged / cache_req, _write_page_table),
#   python/minisgl/kvcache/{radix_cache,mha_pool}.py (RadixPrefixCache, MHAKVCache.store_kv),
#   python/minisgl/attention/fa.py (FlashAttentionBackend.prepare_metadata, _fa_sgl_impl),
#   python/minisgl/layers/attention.py (AttentionLayer: q/k norm, rope, backend forward).
# Ported to CPU: no pin_memory, no CUDA streams / graphs / overlap scheduling, the JIT kernels
# (store_cache, fast_compare_key) and flash_attn_with_kvcache written in torch. The model is a
# tiny transformers Qwen3ForCausalLM whose weights the engine runs through mini-sglang's layer
# layout; every request is checked against that model run densely on the request alone.
from __future__ import annotations

import heapq
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Literal, NamedTuple, Set, Tuple

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def div_ceil(a: int, b: int) -> int:
    return (a + b - 1) // b


def align_down(a: int, b: int) -> int:
    return a // b * b


# ----------------------------------------------------------------------------- core.py


@dataclass
class SamplingParams:
    temperature: float = 0.0
    ignore_eos: bool = True
    max_tokens: int = 1024


@dataclass(eq=False)
class Req:
    input_ids: torch.Tensor  # cpu tensor
    table_idx: int
    cached_len: int
    output_len: int
    uid: int
    sampling_params: SamplingParams
    cache_handle: "RadixCacheHandle"

    def __post_init__(self) -> None:
        assert self.input_ids.is_cpu
        self.device_len = len(self.input_ids)
        self.max_device_len = len(self.input_ids) + self.output_len
        assert 0 <= self.cached_len < self.device_len <= self.max_device_len

    @property
    def remain_len(self) -> int:
        return self.max_device_len - self.device_len

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    def complete_one(self) -> None:
        self.cached_len = self.device_len
        self.device_len += 1

    def append_host(self, next_token: torch.Tensor) -> None:
        self.input_ids = torch.cat([self.input_ids, next_token])

    @property
    def can_decode(self) -> bool:
        return self.remain_len > 0


@dataclass
class Batch:
    reqs: List[Req]
    phase: Literal["prefill", "decode"]
    input_ids: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    out_loc: torch.Tensor = field(init=False)
    padded_reqs: List[Req] = field(init=False)
    attn_metadata: "FAMetadata" = field(init=False)

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def size(self) -> int:
        return len(self.reqs)


@dataclass
class Context:
    page_size: int
    # NOTE: this table always treat page_size = 1
    page_table: torch.Tensor = field(init=False)
    attn_backend: "FlashAttentionBackend" = field(init=False)
    kv_cache: "MHAKVCache" = field(init=False)
    _batch: Batch | None = field(default=None, init=False)

    @property
    def batch(self) -> Batch:
        assert self._batch is not None, "No active batch in context"
        return self._batch

    @contextmanager
    def forward_batch(self, batch: Batch):
        assert self._batch is None, "Nested forward_batch is not allowed"
        try:
            self._batch = batch
            yield
        finally:
            self._batch = None


_GLOBAL_CTX: Context | None = None


def set_global_ctx(ctx: Context):
    global _GLOBAL_CTX
    assert _GLOBAL_CTX is None, "Global context is already set"
    _GLOBAL_CTX = ctx


def get_global_ctx() -> Context:
    assert _GLOBAL_CTX is not None, "Global context is not set"
    return _GLOBAL_CTX


# ----------------------------------------------------------------------------- kvcache


class MHAKVCache:
    def __init__(self, num_kv_heads, num_layers, head_dim, num_pages, page_size, dtype, device):
        self._kv_buffer = torch.empty(
            (2, num_layers, num_pages, page_size, num_kv_heads, head_dim), device=device, dtype=dtype
        )
        self._num_layers = num_layers
        self._k_buffer = self._kv_buffer[0]
        self._v_buffer = self._kv_buffer[1]
        self._device = device
        self._storage_shape = (num_pages * page_size, num_kv_heads, head_dim)

    def k_cache(self, index: int) -> torch.Tensor:
        return self._k_buffer[index]

    def v_cache(self, index: int) -> torch.Tensor:
        return self._v_buffer[index]

    def store_kv(self, k, v, out_loc, layer_id) -> None:
        # minisgl.kernel.store_cache: k_cache[indices] = k, v_cache[indices] = v
        k_cache = self._k_buffer[layer_id].view(self._storage_shape)
        v_cache = self._v_buffer[layer_id].view(self._storage_shape)
        k_cache[out_loc.long()] = k.view(-1, *self._storage_shape[1:])
        v_cache[out_loc.long()] = v.view(-1, *self._storage_shape[1:])

    @property
    def device(self) -> torch.device:
        return self._device


KEY_FN = Callable[[torch.Tensor], Any]


def fast_compare_key(key: torch.Tensor, input_ids: torch.Tensor) -> int:
    n = min(len(key), len(input_ids))
    diff = (key[:n] != input_ids[:n]).nonzero()
    return n if len(diff) == 0 else int(diff[0])


class RadixTreeNode:
    counter: int = 0

    def __init__(self, key_fn: KEY_FN, tic: int | None = None) -> None:
        self.key_fn = key_fn
        self.children: Dict[Any, RadixTreeNode] = {}
        self._parent: RadixTreeNode | None = None
        self.ref_count: int = 0
        self.uuid = RadixTreeNode.counter
        RadixTreeNode.counter += 1
        self.timestamp = tic or time.monotonic_ns()
        self._key: torch.Tensor
        self._value: torch.Tensor
        self._length: int

    def set_key_value(self, key: torch.Tensor, value: torch.Tensor) -> None:
        assert len(key) == len(value)
        self._key = key
        self._value = value
        self._length = len(key)

    def set_parent(self, parent: RadixTreeNode) -> None:
        self._parent = parent
        parent.children[self.key_fn(self._key)] = self

    @property
    def length(self) -> int:
        return self._length

    @property
    def parent(self) -> RadixTreeNode:
        assert self._parent is not None
        return self._parent

    @property
    def value(self) -> torch.Tensor:
        return self._value

    def is_root(self) -> bool:
        return self._parent is None

    def is_leaf(self) -> bool:
        return len(self.children) == 0

    def get_match_len(self, input_ids: torch.Tensor) -> int:
        return fast_compare_key(self._key, input_ids)

    def split_at(self, pos: int) -> RadixTreeNode:
        assert 0 < pos < self.length
        parent = self.parent
        new_node = RadixTreeNode(self.key_fn, self.timestamp)
        new_node.set_key_value(self._key[:pos], self._value[:pos])
        new_node.set_parent(parent)
        new_node.ref_count = self.ref_count
        self.set_key_value(self._key[pos:], self._value[pos:])
        self.set_parent(new_node)
        return new_node

    def __lt__(self, other: RadixTreeNode) -> bool:
        return self.timestamp < other.timestamp


@dataclass(frozen=True)
class RadixCacheHandle:
    cached_len: int
    node: RadixTreeNode

    def get_matched_indices(self) -> torch.Tensor:
        node = self.node
        value_list: List[torch.Tensor] = []
        while not node.is_root():
            value_list.append(node.value)
            node = node.parent
        value_list.reverse()
        return torch.cat(value_list)


class MatchResult(NamedTuple):
    cuda_handle: RadixCacheHandle


class InsertResult(NamedTuple):
    cached_len: int
    handle: RadixCacheHandle


class RadixPrefixCache:
    def __init__(self, device: torch.device):
        self.device = device
        self.page_size = get_global_ctx().page_size
        self.key_fn = _get_key_fn(self.page_size)
        self.empty_tensor = torch.empty(0, dtype=torch.int32, device=device)
        self.evictable_size = 0
        self.protected_size = 0
        self.root_node = RadixTreeNode(self.key_fn)
        self.root_node.ref_count = 1  # root is always protected

    def lock_handle(self, handle: RadixCacheHandle, unlock: bool = False) -> None:
        node = handle.node
        if unlock:
            while not node.is_root():
                node.ref_count -= 1
                assert node.ref_count >= 0
                if node.ref_count == 0:
                    self.evictable_size += node.length
                    self.protected_size -= node.length
                node = node.parent
        else:
            while not node.is_root():
                if node.ref_count == 0:
                    self.evictable_size -= node.length
                    self.protected_size += node.length
                node.ref_count += 1
                node = node.parent

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        node, prefix_len = self._tree_walk(input_ids)
        return MatchResult(RadixCacheHandle(prefix_len, node))

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        insert_len = align_down(len(input_ids), self.page_size)
        input_ids, indices = input_ids[:insert_len], indices[:insert_len]
        node, prefix_len = self._tree_walk(input_ids)
        if prefix_len != insert_len:  # NOTE: prefix_len < insert_len
            new_node = RadixTreeNode(self.key_fn)
            new_node.set_key_value(input_ids[prefix_len:], indices[prefix_len:].clone())
            new_node.set_parent(node)
            self.evictable_size += new_node.length
            node = new_node
        return InsertResult(prefix_len, RadixCacheHandle(insert_len, node))

    def evict(self, size: int) -> torch.Tensor:
        if size == 0:
            return self.empty_tensor
        assert size <= self.evictable_size
        leave_nodes = self._collect_leave_nodes_for_evict()
        heapq.heapify(leave_nodes)
        evicted_indices: List[torch.Tensor] = []
        evicted_size = 0
        while evicted_size < size:
            assert leave_nodes
            node = heapq.heappop(leave_nodes)
            assert node.ref_count == 0 and node.is_leaf() and not node.is_root()
            evicted_size += node.length
            evicted_indices.append(node.value)
            self.evictable_size -= node.length
            parent = node.parent
            del parent.children[self.key_fn(node._key)]
            if parent.is_leaf() and parent.ref_count == 0:
                heapq.heappush(leave_nodes, parent)
        return torch.cat(evicted_indices)

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def _collect_leave_nodes_for_evict(self) -> List[RadixTreeNode]:
        nodes: List[RadixTreeNode] = [self.root_node]
        leave_nodes: List[RadixTreeNode] = []
        while len(nodes) > 0:
            node = nodes.pop()
            if node.is_leaf():
                if node.ref_count == 0:
                    leave_nodes.append(node)
            else:
                for child in node.children.values():
                    nodes.append(child)
        return leave_nodes

    def _tree_walk(self, input_ids: torch.Tensor) -> Tuple[RadixTreeNode, int]:
        prefix_len = 0
        indice_len = len(input_ids)
        node = self.root_node
        tic = time.monotonic_ns()
        while prefix_len < indice_len:
            child_node = node.children.get(self.key_fn(input_ids[prefix_len:]))
            if child_node is None:
                return node, prefix_len
            node = child_node
            # NOTE: at least 1 page is matched, so match_len >= page_size
            match_len = node.get_match_len(input_ids[prefix_len:])
            match_len = align_down(match_len, self.page_size)
            prefix_len += match_len
            if match_len != node.length:
                node = node.split_at(match_len)
                return node, prefix_len
            node.timestamp = tic
        return node, prefix_len


def _get_key_fn(page_size: int) -> KEY_FN:
    if page_size == 1:
        return lambda x: x[0].item()
    return lambda x: tuple(x[:page_size].tolist())


# ----------------------------------------------------------------------------- scheduler


@dataclass
class PendingReq:
    uid: int
    input_ids: torch.Tensor
    sampling_params: SamplingParams
    chunked_req: "ChunkedReq | None" = None

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def output_len(self) -> int:
        return self.sampling_params.max_tokens


class TableManager:
    def __init__(self, max_running_reqs: int, page_table: torch.Tensor) -> None:
        self._free_slots = list(range(max_running_reqs))
        self.page_table = page_table
        self.token_pool = torch.zeros_like(page_table, dtype=torch.int32)

    @property
    def available_size(self) -> int:
        return len(self._free_slots)

    def allocate(self) -> int:
        return self._free_slots.pop()

    def free(self, slot: int) -> None:
        self._free_slots.append(slot)


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, page_table: torch.Tensor):
        device = page_table.device
        self.free_slots = torch.arange(num_pages, dtype=torch.int32, device=device) * page_size
        self.prefix_cache = RadixPrefixCache(device=device)
        self.device = device
        self.num_pages = num_pages
        self.page_table = page_table
        self.page_size = page_size

    def match_req(self, req: PendingReq) -> MatchResult:
        input_len = req.input_len
        assert input_len > 0, "Input length must be greater than 0."
        return self.prefix_cache.match_prefix(req.input_ids[: input_len - 1])

    @property
    def available_size(self) -> int:
        return self.prefix_cache.evictable_size + len(self.free_slots) * self.page_size

    def lock(self, handle: RadixCacheHandle) -> None:
        self.prefix_cache.lock_handle(handle, unlock=False)

    def unlock(self, handle: RadixCacheHandle) -> None:
        self.prefix_cache.lock_handle(handle, unlock=True)

    def allocate_paged(self, reqs: List[Req]) -> None:
        needed_pages = 0
        allocation_info: List[Tuple[int, int, int]] = []
        for req in reqs:
            first_page = div_ceil(req.cached_len, self.page_size)
            last_page = div_ceil(req.device_len, self.page_size)
            if last_page > first_page:
                needed_pages += last_page - first_page
                allocation_info.append((req.table_idx, first_page, last_page))
        if needed_pages > 0:
            allocated = self._page_to_token(self._allocate(needed_pages))
            _write_page_table(self.page_table, allocated, allocation_info, self.page_size)

    def cache_req(self, req: Req, *, finished: bool) -> None:
        insert_ids = req.input_ids[: req.cached_len]
        page_indices = self.page_table[req.table_idx, : req.cached_len]
        old_handle = req.cache_handle
        cached_len, new_handle = self.prefix_cache.insert_prefix(insert_ids, page_indices)
        self.unlock(old_handle)
        # this part is already in the prefix cache, free it
        self._free(page_indices[old_handle.cached_len : cached_len])
        if finished:  # this tail part should be freed
            self._free(page_indices[new_handle.cached_len :])
        else:
            req.cache_handle = new_handle
            self.lock(new_handle)

    def check_integrity(self) -> None:
        cache_pages = self.prefix_cache.total_size // self.page_size
        if len(self.free_slots) + cache_pages != self.num_pages:
            raise RuntimeError("CacheManager integrity check failed")

    @contextmanager
    def lazy_free_region(self):
        def lazy_free(indices: torch.Tensor) -> None:
            lazy_free_list.append(indices[:: self.page_size])

        lazy_free_list: List[torch.Tensor] = []
        try:
            self._free = lazy_free
            yield
        finally:
            del self._free
            self.free_slots = torch.cat([self.free_slots] + lazy_free_list)

    def _allocate(self, needed_pages: int) -> torch.Tensor:
        if needed_pages > (free_pages := len(self.free_slots)):
            evicted = self.prefix_cache.evict((needed_pages - free_pages) * self.page_size)
            self.free_slots = torch.cat([self.free_slots, evicted[:: self.page_size]])
            assert len(self.free_slots) >= needed_pages, "Eviction did not free enough space."
        allocated = self.free_slots[:needed_pages]
        self.free_slots = self.free_slots[needed_pages:]
        return allocated

    def _free(self, indices: torch.Tensor) -> None:
        if len(indices) > 0:
            self.free_slots = torch.cat([self.free_slots, indices[:: self.page_size]])

    def _page_to_token(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages
        offsets = torch.arange(self.page_size, device=self.device, dtype=torch.int32)
        return (pages.unsqueeze(1) + offsets).flatten()


def _write_page_table(page_table, allocated, allocation_info, page_size) -> None:
    needed_tokens = len(allocated)
    table_idxs = torch.empty(needed_tokens, dtype=torch.int64)
    offsets = torch.empty(needed_tokens, dtype=torch.int64)
    offset = 0
    for table_idx, first_page, last_page in allocation_info:
        first_pos, last_pos = first_page * page_size, last_page * page_size
        length = last_pos - first_pos
        table_idxs[offset : offset + length].fill_(table_idx)
        torch.arange(first_pos, last_pos, out=offsets[offset : offset + length])
        offset += length
    assert offset == needed_tokens, "Mismatch in allocated tokens and filled tokens."
    page_table[table_idxs, offsets] = allocated


class ChunkedReq(Req):
    def append_host(self, next_token: torch.Tensor) -> None:
        raise NotImplementedError("ChunkedReq should not be sampled")

    @property
    def can_decode(self) -> bool:
        return False  # avoid being added to decode manager


@dataclass
class DecodeManager:
    page_size: int
    running_reqs: Set[Req] = field(default_factory=set)

    def filter_reqs(self, reqs: Iterable[Req]) -> None:
        self.running_reqs = {req for req in self.running_reqs.union(reqs) if req.can_decode}

    def remove_req(self, req: Req) -> None:
        self.running_reqs.discard(req)

    @property
    def inflight_tokens(self) -> int:
        tokens_reserved = (self.page_size - 1) * len(self.running_reqs)  # 1 page reserved
        return sum(req.remain_len for req in self.running_reqs) + tokens_reserved

    def schedule_next_batch(self) -> Batch | None:
        if not self.runnable:
            return None
        return Batch(reqs=list(self.running_reqs), phase="decode")

    @property
    def runnable(self) -> bool:
        return len(self.running_reqs) > 0


@dataclass
class PrefillAdder:
    token_budget: int
    reserved_size: int
    cache_manager: CacheManager
    table_manager: TableManager

    def _try_allocate_one(self, req: PendingReq):
        if self.table_manager.available_size == 0:
            return None
        handle = self.cache_manager.match_req(req).cuda_handle
        cached_len = handle.cached_len
        extend_len = req.input_len - cached_len
        estimated_len = extend_len + req.output_len
        if estimated_len + self.reserved_size > self.cache_manager.available_size:
            return None
        self.cache_manager.lock(handle)
        if estimated_len + self.reserved_size > self.cache_manager.available_size:
            return self.cache_manager.unlock(handle)
        table_idx = self.table_manager.allocate()
        if cached_len > 0:  # NOTE: set the cached part
            device_ids = self.table_manager.token_pool[table_idx][:cached_len]
            page_entry = self.table_manager.page_table[table_idx][:cached_len]
            device_ids.copy_(req.input_ids[:cached_len])
            page_entry.copy_(handle.get_matched_indices())
        return handle, table_idx

    def _add_one_req(self, pending_req, cache_handle, table_idx, cached_len) -> Req:
        remain_len = pending_req.input_len - cached_len
        chunk_size = min(self.token_budget, remain_len)
        is_chunked = chunk_size < remain_len
        CLS = ChunkedReq if is_chunked else Req
        self.token_budget -= chunk_size
        self.reserved_size += remain_len + pending_req.output_len
        _slice = slice(cached_len, cached_len + chunk_size)
        device_ids = self.table_manager.token_pool[table_idx, _slice]
        device_ids.copy_(pending_req.input_ids[_slice])
        return CLS(
            input_ids=pending_req.input_ids[: cached_len + chunk_size],
            table_idx=table_idx,
            cached_len=cached_len,
            output_len=pending_req.output_len,
            uid=pending_req.uid,
            cache_handle=cache_handle,
            sampling_params=pending_req.sampling_params,
        )

    def try_add_one(self, pending_req: PendingReq) -> Req | None:
        if self.token_budget <= 0:
            return None
        if chunked_req := pending_req.chunked_req:
            return self._add_one_req(
                pending_req=pending_req,
                cache_handle=chunked_req.cache_handle,
                table_idx=chunked_req.table_idx,
                cached_len=chunked_req.cached_len,
            )
        if resource := self._try_allocate_one(pending_req):
            cache_handle, table_idx = resource
            return self._add_one_req(
                pending_req=pending_req,
                cache_handle=cache_handle,
                table_idx=table_idx,
                cached_len=cache_handle.cached_len,
            )
        return None


@dataclass
class PrefillManager:
    cache_manager: CacheManager
    table_manager: TableManager
    decode_manager: DecodeManager
    pending_list: List[PendingReq] = field(default_factory=list)

    def add_one_req(self, uid: int, input_ids: torch.Tensor, sampling_params: SamplingParams):
        self.pending_list.append(PendingReq(uid, input_ids, sampling_params))

    def schedule_next_batch(self, prefill_budget: int) -> Batch | None:
        if len(self.pending_list) == 0:
            return None
        adder = PrefillAdder(
            token_budget=prefill_budget,
            reserved_size=self.decode_manager.inflight_tokens,
            cache_manager=self.cache_manager,
            table_manager=self.table_manager,
        )
        reqs: List[Req] = []
        chunked_list: List[PendingReq] = []
        for pending_req in self.pending_list:
            if req := adder.try_add_one(pending_req):
                pending_req.chunked_req = None
                if isinstance(req, ChunkedReq):
                    pending_req.chunked_req = req
                    chunked_list.append(pending_req)
                reqs.append(req)
            else:
                break
        if len(reqs) == 0:
            return None
        self.pending_list = chunked_list + self.pending_list[len(reqs) :]
        return Batch(reqs=reqs, phase="prefill")

    @property
    def runnable(self) -> bool:
        return len(self.pending_list) > 0


# ----------------------------------------------------------------------------- attention/fa.py


@dataclass
class FAMetadata:
    cu_seqlens_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cache_seqlens: torch.Tensor
    max_seqlen_k: int
    max_seqlen_q: int
    page_table: torch.Tensor

    def get_last_indices(self, bs: int) -> torch.Tensor:
        return self.cu_seqlens_q[1 : 1 + bs] - 1


class FlashAttentionBackend:
    def __init__(self, head_dim: int):
        ctx = get_global_ctx()
        self.kvcache = ctx.kv_cache
        self.page_size = ctx.page_size
        self.scale = head_dim**-0.5

    def forward(self, q, k, v, layer_id: int, batch: Batch) -> torch.Tensor:
        metadata = batch.attn_metadata
        self.kvcache.store_kv(k, v, batch.out_loc, layer_id)
        return flash_attn_with_kvcache(
            q=q,
            k_cache=self.kvcache.k_cache(layer_id),
            v_cache=self.kvcache.v_cache(layer_id),
            page_table=metadata.page_table,
            cache_seqlens=metadata.cache_seqlens,
            cu_seqlens_q=metadata.cu_seqlens_q,
            cu_seqlens_k_new=metadata.cu_seqlens_k,
            max_seqlen_q=metadata.max_seqlen_q,
            softmax_scale=self.scale,
            causal=True,
        )

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        padded_size = len(reqs)
        seqlens_q = [req.extend_len for req in reqs]
        seqlens_k = [req.device_len for req in reqs]
        cached_lens = [req.cached_len for req in reqs]
        max_seqlen_k = max(seqlens_k)
        max_seqlen_q = max(seqlens_q)
        CPU_KWARGS = {"device": "cpu", "dtype": torch.int32}

        device = self.kvcache.device
        cache_seqlens = torch.tensor(seqlens_k, **CPU_KWARGS).to(device)
        cu_seqlens_k = torch.tensor([0] + seqlens_k, **CPU_KWARGS).cumsum_(dim=0).to(device)

        if max_seqlen_q == 1:
            cu_seqlens_q = torch.arange(0, padded_size + 1, device=device, dtype=torch.int32)
        elif all(l == 0 for l in cached_lens):  # prefill with no cache hit
            cu_seqlens_q = cu_seqlens_k
        else:  # normal extend prefill, with partial cache hit
            cu_seqlens_q = torch.tensor([0] + seqlens_q, **CPU_KWARGS).cumsum_(dim=0).to(device)

        page_table = get_global_ctx().page_table
        new_page_table = torch.stack(  # NOTE: global page table treat page_size = 1, we need slice
            [page_table[req.table_idx, : max_seqlen_k : self.page_size] for req in reqs]
        )
        if self.page_size > 1:
            new_page_table.div_(self.page_size, rounding_mode="floor")
        batch.attn_metadata = FAMetadata(
            cu_seqlens_k=cu_seqlens_k,
            cu_seqlens_q=cu_seqlens_q,
            cache_seqlens=cache_seqlens,
            max_seqlen_k=max_seqlen_k,
            max_seqlen_q=max_seqlen_q,
            page_table=new_page_table,
        )


def flash_attn_with_kvcache(
    q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, cu_seqlens_k_new,
    max_seqlen_q, softmax_scale, causal=True,
):
    """CPU stand-in for sgl_kernel.flash_attn.flash_attn_with_kvcache over a paged cache
    (k_cache: [num_pages, page_size, kv_heads, head_dim]); causal masks are aligned to the
    bottom-right corner, so query i of a request with seqlen_q queries and seqlen_k keys sees
    keys [0, seqlen_k - seqlen_q + i]."""
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    for b in range(page_table.shape[0]):
        q_start, q_end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        seqlen_q, seqlen_k = q_end - q_start, int(cache_seqlens[b])
        pages = page_table[b, : div_ceil(seqlen_k, page_size)].long()
        k = k_cache[pages].flatten(0, 1)[:seqlen_k]  # [seqlen_k, kv_heads, head_dim]
        v = v_cache[pages].flatten(0, 1)[:seqlen_k]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        qb = q[q_start:q_end]
        scores = torch.einsum("qhd,khd->hqk", qb.float(), k.float()) * softmax_scale
        if causal:
            q_idx = torch.arange(seqlen_q).unsqueeze(1) + (seqlen_k - seqlen_q)
            k_idx = torch.arange(seqlen_k).unsqueeze(0)
            scores = scores.masked_fill(k_idx > q_idx, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    return out


# ----------------------------------------------------------------------------- model (Qwen3)


def apply_rotary_neox(positions, x, head_dim, base):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class AttentionLayer:
    def __init__(self, hf_attn, layer_id, num_qo_heads, num_kv_heads, head_dim, rope_base):
        self.hf_attn = hf_attn
        self.layer_id = layer_id
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.rope_base = rope_base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_global_ctx()
        attn = self.hf_attn
        q = attn.q_norm(attn.q_proj(x).view(-1, self.num_qo_heads, self.head_dim))
        k = attn.k_norm(attn.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        v = attn.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        q = apply_rotary_neox(ctx.batch.positions, q, self.head_dim, self.rope_base)
        k = apply_rotary_neox(ctx.batch.positions, k, self.head_dim, self.rope_base)
        o = ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch)
        return attn.o_proj(o.reshape(-1, self.num_qo_heads * self.head_dim))


class Qwen3ForCausalLMEngine:
    """mini-sglang's Qwen3 layout over flattened tokens, running an HF model's weights."""

    def __init__(self, hf: Qwen3ForCausalLM):
        cfg = hf.config
        self.hf = hf
        self.attn = [
            AttentionLayer(layer.self_attn, i, cfg.num_attention_heads, cfg.num_key_value_heads,
                           cfg.head_dim, cfg.rope_parameters["rope_theta"])
            for i, layer in enumerate(hf.model.layers)
        ]

    def forward(self) -> torch.Tensor:
        batch = get_global_ctx().batch
        x = self.hf.model.embed_tokens(batch.input_ids.long())
        for layer, attn in zip(self.hf.model.layers, self.attn):
            x = x + attn.forward(layer.input_layernorm(x))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.hf.model.norm(x)
        # ParallelLMHead keeps only each request's last token in a prefill batch
        x = x[batch.attn_metadata.get_last_indices(batch.size)]
        return self.hf.lm_head(x)


# ----------------------------------------------------------------------------- scheduler.py


class Scheduler:
    def __init__(self, hf_model, *, page_size, num_pages, max_running_req, max_seq_len,
                 max_extend_tokens):
        cfg = hf_model.config
        ctx = Context(page_size=page_size)
        set_global_ctx(ctx)
        self.device = torch.device("cpu")
        self.page_table = torch.zeros((max_running_req, max_seq_len), dtype=torch.int32)
        ctx.page_table = self.page_table
        ctx.kv_cache = MHAKVCache(cfg.num_key_value_heads, cfg.num_hidden_layers, cfg.head_dim,
                                  num_pages, page_size, torch.float32, self.device)
        ctx.attn_backend = FlashAttentionBackend(cfg.head_dim)
        self.ctx = ctx
        self.model = Qwen3ForCausalLMEngine(hf_model)

        self.table_manager = TableManager(max_running_req, self.page_table)
        self.cache_manager = CacheManager(num_pages, page_size, self.page_table)
        self.decode_manager = DecodeManager(page_size)
        self.prefill_manager = PrefillManager(
            self.cache_manager, self.table_manager, self.decode_manager
        )
        self.finished_reqs: Set[Req] = set()
        self.token_pool = self.table_manager.token_pool
        self.prefill_budget = max_extend_tokens
        self.outputs: Dict[int, List[int]] = {}
        self.step_logits: Dict[int, List[torch.Tensor]] = {}
        self.phases: List[Tuple[str, List[Tuple[int, int, int]]]] = []

    def add_request(self, uid: int, input_ids: torch.Tensor, max_tokens: int) -> None:
        self.outputs[uid], self.step_logits[uid] = [], []
        self.prefill_manager.add_one_req(uid, input_ids, SamplingParams(max_tokens=max_tokens))

    @property
    def busy(self) -> bool:
        return self.prefill_manager.runnable or self.decode_manager.runnable

    def normal_loop(self) -> None:
        batch = (
            self.prefill_manager.schedule_next_batch(self.prefill_budget)
            or self.decode_manager.schedule_next_batch()
        )
        if batch is None:
            return
        self.phases.append(
            (batch.phase, [(r.uid, r.cached_len, r.extend_len) for r in batch.reqs])
        )
        batch.padded_reqs = batch.reqs  # no CUDA-graph padding on CPU
        self.cache_manager.allocate_paged(batch.reqs)
        batch.positions = _make_positions(batch)
        input_mapping = _make_input_tuple(batch)
        write_mapping = _make_write_tuple(batch)
        batch.out_loc = self.page_table[input_mapping]
        self.ctx.attn_backend.prepare_metadata(batch)

        batch.input_ids = self.token_pool[input_mapping]
        with self.ctx.forward_batch(batch):
            logits = self.model.forward()
        for req in batch.reqs:
            req.complete_one()
        next_tokens = torch.argmax(logits[: batch.size], dim=-1).to(torch.int32)
        self.token_pool[write_mapping] = next_tokens
        self.decode_manager.filter_reqs(batch.reqs)
        self._process_last_data(batch, next_tokens, logits)

    def _process_last_data(self, batch: Batch, next_tokens_cpu, logits) -> None:
        new_finished_reqs: Set[Req] = set()
        with self.cache_manager.lazy_free_region():
            for i, req in enumerate(batch.reqs):
                if isinstance(req, ChunkedReq):
                    continue
                next_token = next_tokens_cpu[i]
                req.append_host(next_token.unsqueeze(0))
                self.outputs[req.uid].append(int(next_token))
                self.step_logits[req.uid].append(logits[i])
                finished = not req.can_decode
                if finished and req not in self.finished_reqs:
                    self.decode_manager.remove_req(req)
                    self._free_req_resources(req)
                    new_finished_reqs.add(req)
                elif batch.is_prefill:  # for prefill, non-chunk req, cache the prefix
                    self.cache_manager.cache_req(req, finished=False)
        self.finished_reqs = new_finished_reqs

    def _free_req_resources(self, req: Req) -> None:
        self.table_manager.free(req.table_idx)
        self.cache_manager.cache_req(req, finished=True)


def _make_positions(batch: Batch) -> torch.Tensor:
    needed_size = sum(r.extend_len for r in batch.padded_reqs)
    indices_host = torch.empty(needed_size, dtype=torch.int32)
    offset = 0
    for req in batch.padded_reqs:
        length = req.extend_len
        torch.arange(req.cached_len, req.device_len, dtype=torch.int32,
                     out=indices_host[offset : offset + length])
        offset += length
    return indices_host


def _make_input_tuple(batch: Batch):
    mapping_host = torch.empty(len(batch.positions), dtype=torch.int64)
    offset = 0
    for req in batch.padded_reqs:
        length = req.extend_len
        mapping_host[offset : offset + length].fill_(req.table_idx)
        offset += length
    return mapping_host, batch.positions.to(torch.int64)


def _make_write_tuple(batch: Batch):
    mapping_host = torch.tensor([req.table_idx for req in batch.reqs], dtype=torch.int64)
    write_host = torch.tensor(
        [(req.device_len if req.can_decode else -1) for req in batch.reqs], dtype=torch.int64
    )
    return mapping_host, write_host


# ----------------------------------------------------------------------------- driver + reference


@torch.no_grad()
def dense_greedy(model: Qwen3ForCausalLM, prompt: torch.Tensor, max_tokens: int):
    """The request alone: no cache, no pages, the whole sequence re-run each step."""
    ids = prompt.long().unsqueeze(0)
    tokens, logits = [], []
    for _ in range(max_tokens):
        step = model(input_ids=ids).logits[0, -1]
        tok = int(step.argmax())
        tokens.append(tok)
        logits.append(step)
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return tokens, logits


@torch.no_grad()
def main() -> None:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(config).eval()

    system = torch.randint(1, 97, (13,), dtype=torch.int32)  # shared system prompt
    def prompt(n):
        return torch.cat([system, torch.randint(1, 97, (n,), dtype=torch.int32)])

    # (arrival step, uid, prompt, max_tokens): later arrivals hit the radix cache; uid 2 is longer
    # than the prefill budget and is chunked; uid 4 repeats uid 0's prompt exactly.
    arrivals = [
        (0, 0, prompt(5), 6),
        (0, 1, prompt(3), 9),
        (2, 2, prompt(30), 5),
        (3, 3, torch.randint(1, 97, (7,), dtype=torch.int32), 7),
        (6, 4, None, 4),
        (9, 5, prompt(1), 6),
    ]
    prompts = {}
    sched = Scheduler(model, page_size=4, num_pages=40, max_running_req=4, max_seq_len=64,
                      max_extend_tokens=24)
    step = 0
    while step == 0 or sched.busy or any(a[0] >= step for a in arrivals):
        for arrive, uid, ids, max_tokens in arrivals:
            if arrive == step:
                prompts[uid] = prompts[0].clone() if ids is None else ids
                sched.add_request(uid, prompts[uid], max_tokens)
        sched.normal_loop()
        step += 1
    sched.cache_manager.check_integrity()

    first_prefill: Dict[int, int] = {}
    for phase, rs in sched.phases:
        for uid, cached, _ in rs:
            if phase == "prefill":
                first_prefill.setdefault(uid, cached)
    hits = [(uid, cached) for uid, cached in first_prefill.items() if cached > 0]
    chunks = sum(1 for phase, rs in sched.phases if phase == "prefill" for uid, _, _ in rs if uid == 2)
    mixed = any(phase == "decode" and len(rs) > 1 for phase, rs in sched.phases)
    assert hits and chunks > 1 and mixed, (hits, chunks, mixed)

    for _, uid, _, max_tokens in arrivals:
        ref_tokens, ref_logits = dense_greedy(model, prompts[uid], max_tokens)
        assert sched.outputs[uid] == ref_tokens, (uid, sched.outputs[uid], ref_tokens)
        diff = (torch.stack(sched.step_logits[uid]) - torch.stack(ref_logits)).abs().max()
        assert diff < 1e-4, (uid, float(diff))
        print(f"req {uid}: prompt {len(prompts[uid])}, tokens {ref_tokens}, max |dlogit| {float(diff):.2e}")
    print(f"{step} engine steps, prefix-cache hits (uid, cached_len): {hits}, uid 2 chunks: {chunks}")
    print("paged engine matches the dense per-request reference")


if __name__ == "__main__":
    main()
