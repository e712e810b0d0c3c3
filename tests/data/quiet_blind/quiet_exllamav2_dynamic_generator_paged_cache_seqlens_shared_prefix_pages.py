# Correct program (quiet batch quiet-r68a).
#
# Ported from turboderp/exllamav2 @b9c025b4b1ee78c0d34e700f2e474a02dfb13c90:
#   exllamav2/generator/dynamic.py (CachePage, _tensor_blake2b_checksum, _randomhash,
#     ExLlamaV2DynamicGenerator.reset_page_table / enqueue / iterate / iterate_start_jobs / iterate_gen /
#     get_paged_params, ExLlamaV2DynamicJob.prepare_for_queue / current_new_pages_required / allocate_pages /
#     prefill (paged path) / get_block_index / get_input_ids_list / receive_sample / deallocate_pages)
#   exllamav2/attn.py (ExLlamaV2Attention.forward_paged: rope at cache_seqlens offsets, then
#     flash_attn_with_kvcache(q, k, v, k_cache, v_cache, cache_seqlens, block_table, causal=True))
# Trimmed: no draft model / ngrams / filters / stop strings / CFG, greedy sampling, fp16 cache only, the
# partial-last-page match of `prefill` left out, page size 4 instead of 256. flash_attn_with_kvcache has no
# CPU build, so it is written out in torch the way flash-attn documents it (new k/v appended at
# cache_seqlens through block_table, keys [0, cache_seqlens + i] visible to query i, bottom-right causal).
#
# A dynamic batching generator over a paged KV cache. Jobs are enqueued at different iterations; each
# job's prompt is hashed page by page, so jobs that share a prompt prefix reference the same cache pages
# (and a later job finds the pages a finished job left behind); prefill runs per job in page-aligned
# chunks; every iteration batches one token from each job whose prefill is done, with a per-row
# block_index and cache_seqlens = that job's kv_position. Jobs finish at different lengths and their
# unique pages return to the pool, where later jobs reuse them.
#
# Self-check: every job is rerun alone (prompt + generated tokens, no padding, no cache) through the same
# weights with plain causal SDPA (is_causal=True); the logits each token was sampled from and the greedy
# tokens must match. The run also checks that shared and reused pages actually occurred.
import hashlib
import math
import sys
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

torch.manual_seed(0)


# ---------------------------------------------------------------------------------------------
# flash_attn.flash_attn_with_kvcache, written out in torch (paged: k_cache is (num_blocks, page_size,
# kv_heads, head_dim), block_table (batch, max_blocks), cache_seqlens (batch,))
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                            causal=False, softmax_scale=None):
    batch, q_len, n_heads, head_dim = q.shape
    page_size = k_cache.shape[1]
    n_kv = k_cache.shape[2]
    if k is not None:
        for b in range(batch):
            for i in range(q_len):
                pos = int(cache_seqlens[b]) + i
                page = int(block_table[b, pos // page_size])
                k_cache[page, pos % page_size] = k[b, i]
                v_cache[page, pos % page_size] = v[b, i]
    max_blocks = block_table.shape[1]
    keys = k_cache[block_table.long()].reshape(batch, max_blocks * page_size, n_kv, head_dim)
    values = v_cache[block_table.long()].reshape(batch, max_blocks * page_size, n_kv, head_dim)
    seqlens_k = cache_seqlens.long() + (q_len if k is not None else 0)
    key_idx = torch.arange(max_blocks * page_size)[None, None, :]
    q_idx = torch.arange(q_len)[None, :, None]
    visible = key_idx < seqlens_k[:, None, None]
    if causal:
        visible = visible & (key_idx <= q_idx + (seqlens_k[:, None, None] - q_len))
    rep = n_heads // n_kv
    keys = keys.repeat_interleave(rep, dim=2).transpose(1, 2)
    values = values.repeat_interleave(rep, dim=2).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=visible[:, None],
                                         scale=softmax_scale)
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# exllamav2/attn_params.py PagedParams, exllamav2/cache.py ExLlamaV2Cache (paged, fp16 -> fp32 here)
@dataclass
class PagedParams:
    batch_size: int
    block_index: torch.Tensor
    cache_seqlens: torch.Tensor
    max_cache_seqlen: int
    page_size: int
    q_len: int

    def get_cache_seqlens(self, device_idx=0):
        return self.cache_seqlens

    def get_block_index(self, device_idx=0):
        return self.block_index


class ExLlamaV2Cache:
    def __init__(self, cfg, max_seq_len):
        shape = (1, max_seq_len, cfg.num_key_value_heads, cfg.head_dim)
        # noise, not zeros: a slot read before it is written would show
        self.key_states = [torch.randn(shape) * 4 for _ in range(cfg.num_hidden_layers)]
        self.value_states = [torch.randn(shape) * 4 for _ in range(cfg.num_hidden_layers)]
        self.q_block = 1

    def get_kv_state(self, layer_idx, batch_size, a, b, page_size, cache_seqlens, block_table):
        return self.key_states[layer_idx], self.value_states[layer_idx]

    def store_kv_state(self, layer_idx, batch_size, a, b, page_size, cache_seqlens, block_table):
        return


# ---------------------------------------------------------------------------------------------
# A small Llama with ExLlamaV2Attention.forward_paged as its attention.
@dataclass
class Config:
    vocab_size: int = 101
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_hidden_layers: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 256


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_(t, sin, cos, positions):
    # ext_c.rope_ (NEOX style), in place, positions (batch, q_len) = cache_seqlens[b] + i
    s = sin[positions][:, :, None, :]
    c = cos[positions][:, :, None, :]
    half = t.shape[-1] // 2
    rot = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    t.copy_(t * c + rot * s)


class ExLlamaV2Attention(torch.nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_attention_heads = cfg.num_attention_heads
        self.num_key_value_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scaling = 1.0 / math.sqrt(cfg.head_dim)
        self.pre_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.q_proj = torch.nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward_paged(self, hidden_states, cache, attn_params, sin, cos):
        page_size = attn_params.page_size
        batch_size, q_len, _ = hidden_states.shape
        cache_seqlens = attn_params.get_cache_seqlens()
        block_table = attn_params.get_block_index()

        k_cache_f, v_cache_f = cache.get_kv_state(self.layer_idx, batch_size, 0, 0, page_size, cache_seqlens,
                                                  block_table)
        k_cache = k_cache_f.view(k_cache_f.shape[1] // page_size, page_size, k_cache_f.shape[2], k_cache_f.shape[3])
        v_cache = v_cache_f.view(v_cache_f.shape[1] // page_size, page_size, v_cache_f.shape[2], v_cache_f.shape[3])

        residual = hidden_states
        hidden_states = self.pre_layernorm(hidden_states)
        q = self.q_proj(hidden_states).view(batch_size, q_len, self.num_attention_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(batch_size, q_len, self.num_key_value_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(batch_size, q_len, self.num_key_value_heads, self.head_dim)
        positions = cache_seqlens.long()[:, None] + torch.arange(q_len)[None, :]
        rope_(q, sin, cos, positions)
        rope_(k, sin, cos, positions)

        attn_output = flash_attn_with_kvcache(
            q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
            block_table=block_table, causal=True, softmax_scale=self.scaling,
        )
        attn_output = attn_output.reshape((batch_size, q_len, self.num_attention_heads * self.head_dim))
        cache.store_kv_state(self.layer_idx, batch_size, 0, q_len, page_size, cache_seqlens, block_table)
        hidden_states = self.o_proj(attn_output)
        return hidden_states + residual


class MLP(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_proj = torch.nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class ExLlamaV2(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.attn = torch.nn.ModuleList([ExLlamaV2Attention(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.mlp = torch.nn.ModuleList([MLP(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        freqs = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.register_buffer("cos", emb.cos(), persistent=False)

    @torch.no_grad()
    def forward_chunk(self, input_ids, attn_params, cache, preprocess_only=False):
        x = self.embed_tokens(input_ids)
        for attn, mlp in zip(self.attn, self.mlp):
            x = attn.forward_paged(x, cache, attn_params, self.sin, self.cos)
            x = mlp(x)
        if preprocess_only:
            return {"logits": None}
        return {"logits": self.lm_head(self.norm(x)).float()}


# ---------------------------------------------------------------------------------------------
# generator/dynamic.py
def _tensor_blake2b_checksum(tensor, prev_hash):
    hasher = hashlib.blake2b(digest_size=16)
    if prev_hash is not None:
        hasher.update(prev_hash)
    hasher.update(tensor.numpy().tobytes())
    return hasher.digest()


_tensor_hash_checksum = _tensor_blake2b_checksum

_uniquehash = 0


def _randomhash():
    global _uniquehash
    _uniquehash += 1
    return _uniquehash.to_bytes(16, byteorder="big")


class CachePage:
    def __init__(self, generator, page_index, phash, sequence, access_serial):
        self.generator = generator
        self.page_index = page_index
        self.phash = phash
        self.phash_revert = phash
        self.prev_hash = None
        self.prev_hash_revert = None
        self.ref_count = 0
        self.access_serial = access_serial
        self.access_serial_revert = 0
        self.kv_position = 0
        self.kv_position_revert = 0
        self.sequence = sequence
        self.can_revert = False

    def backup(self):
        self.phash_revert = self.phash
        self.prev_hash_revert = self.prev_hash
        self.access_serial_revert = self.access_serial
        self.kv_position_revert = self.kv_position
        self.can_revert = True

    def revert(self):
        assert self.can_revert
        self.phash = self.phash_revert
        self.prev_hash = self.prev_hash_revert
        self.access_serial = self.access_serial_revert
        self.kv_position = self.kv_position_revert
        self.can_revert = False

    def add_ref(self, serial):
        if self.ref_count == 0:
            del self.generator.unreferenced_pages[self.phash]
            assert self.phash not in self.generator.referenced_pages
            self.generator.referenced_pages[self.phash] = self
        self.ref_count += 1
        self.access_serial = max(serial, self.access_serial)
        self.can_revert = False

    def add_ref_clear(self, serial, newhash):
        assert self.ref_count == 0
        del self.generator.unreferenced_pages[self.phash]
        self.phash = newhash
        assert self.phash not in self.generator.referenced_pages
        self.generator.referenced_pages[self.phash] = self
        self.ref_count += 1
        self.access_serial = serial
        self.prev_hash = None
        self.can_revert = False
        self.kv_position = 0

    def add_ref_unique(self, serial):
        self.backup()
        assert self.ref_count == 0
        del self.generator.unreferenced_pages[self.phash]
        self.phash = _randomhash()
        assert self.phash not in self.generator.referenced_pages
        self.generator.referenced_pages[self.phash] = self
        self.ref_count += 1
        self.access_serial = serial
        self.prev_hash = None
        self.kv_position = 0

    def sub_ref(self):
        self.ref_count -= 1
        if self.ref_count == 0:
            del self.generator.referenced_pages[self.phash]
            if self.can_revert:
                self.revert()
            if self.phash in self.generator.referenced_pages or self.phash in self.generator.unreferenced_pages:
                self.phash = _randomhash()
                self.prev_hash = None
            assert self.phash not in self.generator.unreferenced_pages
            self.generator.unreferenced_pages[self.phash] = self

    def clear(self):
        assert self.ref_count == 0
        del self.generator.unreferenced_pages[self.phash]
        self.phash = _randomhash()
        self.prev_hash = None
        self.kv_position = 0
        self.can_revert = False
        self.sequence[:, :] = 0
        assert self.phash not in self.generator.unreferenced_pages
        self.generator.unreferenced_pages[self.phash] = self

    def update_hash(self, newhash):
        assert self.ref_count > 0
        assert self.kv_position == self.generator.page_size
        del self.generator.referenced_pages[self.phash]
        self.phash = newhash
        self.can_revert = False
        assert self.phash not in self.generator.referenced_pages
        self.generator.referenced_pages[self.phash] = self


class ExLlamaV2DynamicGenerator:
    def __init__(self, model, cache, max_batch_size, max_chunk_size, page_size, max_pages):
        self.model = model
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_chunk_size = max_chunk_size
        self.page_size = page_size
        self.max_pages = max_pages
        self.paged = True
        self.pending_jobs = []
        self.active_jobs = []
        self.job_serial = 0
        self.reset_page_table()
        self.shared_page_uses = 0
        self.reused_unique_pages = 0

    def reset_page_table(self):
        self.referenced_pages = {}
        self.unreferenced_pages = {}
        self.all_pages = []
        for idx in range(self.max_pages):
            h = _randomhash()
            cp = CachePage(self, idx, h, torch.empty((1, self.page_size), dtype=torch.long), idx)
            self.all_pages.append(cp)
            self.unreferenced_pages[h] = cp
        self.access_serial = self.max_pages

    def num_remaining_jobs(self):
        return len(self.pending_jobs) + len(self.active_jobs)

    def enqueue(self, job):
        job.prepare_for_queue(self, self.job_serial)
        self.job_serial += 1
        self.pending_jobs.append(job)

    def get_paged_params(self, batch_size, block_index, cache_seqlens, q_len):
        return PagedParams(batch_size=batch_size, block_index=block_index, cache_seqlens=cache_seqlens,
                           max_cache_seqlen=cache_seqlens.max().item(), page_size=self.page_size, q_len=q_len)

    @torch.inference_mode()
    def iterate(self):
        results = []
        self.iterate_start_jobs(results)
        for job in self.active_jobs:
            job.prefill(results)
        self.iterate_gen(results)
        return results

    def iterate_gen(self, results):
        batch_size = 0
        max_seq_len = 0
        for job in self.active_jobs:
            if not job.is_prefill_done():
                continue
            max_seq_len = max(max_seq_len, job.get_max_seq_len())
            batch_size += len(job.sequences)
        if batch_size == 0:
            return

        max_pages_batch = (max_seq_len + self.page_size - 1) // self.page_size
        block_index = torch.zeros((batch_size, max_pages_batch), dtype=torch.int32)
        cache_seqlens = torch.zeros((batch_size,), dtype=torch.int32)

        batch = 0
        for job in self.active_jobs:
            if not job.is_prefill_done():
                continue
            for seq in job.sequences:
                t_len = len(seq.sequence_ids)
                seq_block_index = job.get_block_index(seq, t_len)
                block_index[batch, :seq_block_index.shape[-1]].copy_(seq_block_index)
                cache_seqlens[batch] = seq.kv_position
                batch += 1

        input_ids_list = []
        logit_mapping = []
        for job in self.active_jobs:
            logit_mapping.append(len(input_ids_list))
            if not job.is_prefill_done():
                continue
            input_ids_list += job.get_input_ids_list(add_to_cache=True)
        logit_mapping.append(len(input_ids_list))

        batch_ids = torch.cat(input_ids_list, dim=0)
        attn_params = self.get_paged_params(batch_size, block_index, cache_seqlens, batch_ids.shape[-1])
        batch_logits = self.model.forward_chunk(input_ids=batch_ids, attn_params=attn_params,
                                                cache=self.cache)["logits"]

        completed_jobs = []
        for job, a, b in zip(self.active_jobs, logit_mapping[:-1], logit_mapping[1:]):
            if a == b:
                continue
            job_logits = batch_logits[a:b, 0:1, :]
            next_token = torch.argmax(job_logits[:, -1, :], dim=-1, keepdim=True)  # greedy receive_logits
            eos = job.receive_sample(job_logits, next_token, results)
            if eos:
                completed_jobs.append(job)

        for job in completed_jobs:
            job.deallocate_pages()
            self.active_jobs.remove(job)

    def iterate_start_jobs(self, results):
        current_max_batch = 0
        for job in self.active_jobs:
            current_max_batch += len(job.sequences)
        if len(self.unreferenced_pages) and len(self.pending_jobs) and current_max_batch < self.max_batch_size:
            skipped_jobs = []
            for job in self.pending_jobs.copy():
                if (len(job.sequences) + current_max_batch > self.max_batch_size or
                        job.current_new_pages_required() > len(self.unreferenced_pages)):
                    skipped_jobs.append(job)
                    continue
                for j in skipped_jobs:
                    if j.skips >= j.max_skips:
                        return
                for j in skipped_jobs:
                    j.skips += 1
                self.pending_jobs.remove(job)
                self.active_jobs.append(job)
                job.allocate_pages()
                current_max_batch += len(job.sequences)
                results.append({"job": job, "stage": "started"})


class ExLlamaV2DynamicJob:
    class Sequence:
        pass

    def __init__(self, input_ids, max_new_tokens, identifier=None):
        self.max_new_tokens = max_new_tokens
        self.identifier = identifier
        self.new_tokens = 0
        self.max_skips = 4
        self.cached_pages = 0
        self.cached_tokens = 0
        self.total_pages = 0
        self.sequences = []
        seq = ExLlamaV2DynamicJob.Sequence()
        seq.input_ids = input_ids.clone()
        seq.sequence_ids = input_ids[0].tolist()  # SeqTensor stand-in
        seq.kv_position = 0
        seq.page_hashes = None
        seq.new_unique_pages = 0
        seq.allocated_pages = None
        seq.block_index_tensor = None
        seq.live = True
        seq.prefill_complete = False
        self.sequences.append(seq)
        self.output_ids = []
        self.output_logits = []

    def ids_slice(self, seq, a, b):
        return torch.tensor([seq.sequence_ids[a:b]], dtype=torch.long)

    def prepare_for_queue(self, generator, serial_number):
        self.serial_number = serial_number
        self.generator = generator
        self.skips = 0
        page_size = self.generator.page_size
        all_unique_hashes = set()
        for seq in self.sequences:
            seq.page_hashes = []
            max_len = len(seq.sequence_ids) + self.max_new_tokens
            context_pages = (len(seq.sequence_ids) - 1) // page_size
            total_pages = (max_len + page_size - 1) // page_size
            r_hash = None
            for i in range(context_pages):
                page_ids = self.ids_slice(seq, i * page_size, (i + 1) * page_size)
                assert page_ids.shape[-1] == self.generator.page_size
                r_hash = _tensor_hash_checksum(page_ids, r_hash)
                seq.page_hashes.append(r_hash)
                all_unique_hashes.add(r_hash)
            seq.new_unique_pages = total_pages - context_pages
        self.all_unique_hashes = list(all_unique_hashes)

    def current_new_pages_required(self):
        new_pages = 0
        for h in self.all_unique_hashes:
            if h not in self.generator.referenced_pages:
                new_pages += 1
        for s in self.sequences:
            new_pages += s.new_unique_pages
        return new_pages

    def is_prefill_done(self):
        return all(seq.kv_position == len(seq.sequence_ids) - 1 for seq in self.sequences)

    def get_max_seq_len(self):
        if not self.is_prefill_done():
            return 0
        max_seq_len = 0
        for seq in self.sequences:
            if seq.kv_position == len(seq.sequence_ids) - 1:
                max_seq_len = max(max_seq_len, len(seq.sequence_ids))
        return max_seq_len

    def get_input_ids_list(self, add_to_cache=False):
        input_ids_list = []
        for seq in self.sequences:
            ids = self.ids_slice(seq, seq.kv_position, None)
            input_ids_list.append(ids)
            if add_to_cache:
                tokens_to_add = ids.shape[-1]
                skvp = seq.kv_position
                while tokens_to_add:
                    page = seq.allocated_pages[skvp // self.generator.page_size]
                    assert page.ref_count == 1
                    tokens_page = min(tokens_to_add, self.generator.page_size - page.kv_position)
                    page.sequence[:, page.kv_position:page.kv_position + tokens_page] = ids[:, :tokens_page]
                    page.kv_position += tokens_page
                    skvp += tokens_page
                    ids = ids[:, tokens_page:]
                    tokens_to_add -= tokens_page
                    page.can_revert = False
        return input_ids_list

    def receive_sample(self, logits, next_token, results):
        page_size = self.generator.page_size
        self.new_tokens += 1
        for seq in self.sequences:
            seq.sequence_ids.append(int(next_token))
            page_before = seq.kv_position // page_size
            seq.kv_position += 1
            pos = seq.kv_position
            page_after = pos // page_size
            if page_after > page_before:
                assert page_after == page_before + 1
                page = seq.allocated_pages[page_before]
                if page_before > 0:
                    last_hash = seq.allocated_pages[page_before - 1].phash
                else:
                    last_hash = None
                page_ids = self.ids_slice(seq, page_before * page_size, page_after * page_size)
                new_hash = _tensor_hash_checksum(page_ids, last_hash)
                if new_hash in self.generator.referenced_pages:
                    new_serial = page.access_serial
                    page.sub_ref()
                    page = self.generator.referenced_pages[new_hash]
                    assert page.kv_position == page_size
                    seq.allocated_pages[page_before] = page
                    seq.block_index_tensor = None
                    page.add_ref(new_serial)
                else:
                    if new_hash in self.generator.unreferenced_pages:
                        up = self.generator.unreferenced_pages[new_hash]
                        up.clear()
                    page.update_hash(new_hash)
                page = seq.allocated_pages[page_after]
                page.prev_hash = new_hash
                page.can_revert = False
        self.output_ids.append(int(next_token))
        self.output_logits.append(logits[0, -1].clone())
        eos = self.new_tokens >= self.max_new_tokens
        results.append({"job": self, "stage": "streaming", "eos": eos})
        return eos

    def prefill(self, results):
        page_size = self.generator.page_size
        for seq in self.sequences:
            if seq.prefill_complete:
                continue
            prefill_start = seq.kv_position
            prefill_end = seq.kv_position + self.generator.max_chunk_size
            prefill_end = (prefill_end // page_size) * page_size
            prefill_end = min(prefill_end, len(seq.sequence_ids) - 1)

            p0 = prefill_start // page_size
            p1 = (prefill_end + page_size - 1) // page_size
            for local_idx in range(p0, p1):
                page = seq.allocated_pages[local_idx]
                if page.kv_position == page_size:
                    prefill_start = (local_idx + 1) * page_size
                    seq.kv_position = prefill_start
                    self.cached_pages += 1
                    page.can_revert = False
                else:
                    break
            p0 = prefill_start // page_size
            for local_idx in range(p0, p1):
                page = seq.allocated_pages[local_idx]
                if page.kv_position == page_size:
                    prefill_end = local_idx * page_size
                    break
            if prefill_end <= prefill_start:
                if seq.kv_position == len(seq.sequence_ids) - 1:
                    seq.prefill_complete = True
                continue

            prefill_ids = self.ids_slice(seq, prefill_start, prefill_end)

            # (the partial-last-page match against other pages is left out of this port)
            p0 = prefill_start // page_size
            p1 = prefill_end // page_size

            attn_params = self.generator.get_paged_params(
                1, self.get_block_index(seq, prefill_end).unsqueeze(0),
                torch.tensor([prefill_start], dtype=torch.int32), prefill_ids.shape[-1],
            )
            self.generator.model.forward_chunk(input_ids=prefill_ids, preprocess_only=True,
                                               attn_params=attn_params, cache=self.generator.cache)
            seq.kv_position = prefill_end
            p2 = min(p1 + 1, len(seq.allocated_pages))
            for local_idx in range(p0, p2):
                page = seq.allocated_pages[local_idx]
                page.kv_position = min(max(prefill_end - local_idx * page_size, 0), page_size)
                if local_idx == 0:
                    page.prev_hash = None
                else:
                    page.prev_hash = seq.allocated_pages[local_idx - 1].phash
                pf_a = max(local_idx * page_size, prefill_start)
                pf_b = min(local_idx * page_size + page_size, prefill_end)
                pfp_a = pf_a - local_idx * page_size
                pfp_b = pf_b - local_idx * page_size
                page.sequence[:, pfp_a:pfp_b].copy_(self.ids_slice(seq, pf_a, pf_b))
                page.can_revert = False
            if seq.kv_position >= len(seq.sequence_ids) - 1:
                seq.prefill_complete = True

    def get_block_index(self, seq, max_len):
        page_size = self.generator.page_size
        if seq.block_index_tensor is None:
            block_index = [page.page_index for page in seq.allocated_pages]
            seq.block_index_tensor = torch.tensor(block_index, dtype=torch.int32)
        num_blocks = (max_len + page_size - 1) // page_size
        return seq.block_index_tensor[:num_blocks]

    def allocate_pages(self):
        page_size = self.generator.page_size
        for seq in self.sequences:
            seq.allocated_pages = []
            available_pages = None
            for h in seq.page_hashes:
                self.generator.access_serial += 1
                rp = self.generator.referenced_pages.get(h)
                if rp:
                    rp.add_ref(self.generator.access_serial)
                    seq.allocated_pages.append(rp)
                    self.generator.shared_page_uses += 1
                else:
                    up = self.generator.unreferenced_pages.get(h)
                    if up:
                        up.add_ref(self.generator.access_serial)
                        seq.allocated_pages.append(up)
                        self.generator.shared_page_uses += 1
                    else:
                        if available_pages is None:
                            available_pages = list(self.generator.unreferenced_pages.values())
                            available_pages.sort(key=lambda x: x.access_serial)
                            available_pages = deque(available_pages)
                        else:
                            while available_pages[0].ref_count:
                                available_pages.popleft()
                        np_ = available_pages.popleft()
                        np_.add_ref_clear(self.generator.access_serial, h)
                        seq.allocated_pages.append(np_)
            for npi in range(seq.new_unique_pages):
                self.generator.access_serial += 1
                if available_pages is None:
                    available_pages = list(self.generator.unreferenced_pages.values())
                    available_pages.sort(key=lambda x: x.access_serial)
                    available_pages = deque(available_pages)
                else:
                    while available_pages[0].ref_count:
                        available_pages.popleft()
                np_ = available_pages.popleft()
                if np_.access_serial >= self.generator.max_pages:
                    self.generator.reused_unique_pages += 1
                np_.add_ref_unique(self.generator.access_serial)
                seq.allocated_pages.append(np_)
            for page in seq.allocated_pages:
                if page.kv_position == page_size:
                    seq.kv_position += page_size
                    self.cached_pages += 1
                else:
                    break
            self.total_pages += len(seq.allocated_pages)

    def deallocate_pages(self):
        for seq in self.sequences:
            if seq.allocated_pages is not None:
                for page in seq.allocated_pages:
                    page.sub_ref()
                seq.allocated_pages = []


# ---------------------------------------------------------------------------------------------
def reference_logits(model, ids):
    """One job alone: its whole sequence, no cache, no padding, plain causal SDPA."""
    x = model.embed_tokens(torch.tensor([ids]))
    T = len(ids)
    pos = torch.arange(T)[None]
    for attn, mlp in zip(model.attn, model.mlp):
        h = attn.pre_layernorm(x)
        q = attn.q_proj(h).view(1, T, attn.num_attention_heads, attn.head_dim)
        k = attn.k_proj(h).view(1, T, attn.num_key_value_heads, attn.head_dim)
        v = attn.v_proj(h).view(1, T, attn.num_key_value_heads, attn.head_dim)
        rope_(q, model.sin, model.cos, pos)
        rope_(k, model.sin, model.cos, pos)
        rep = attn.num_attention_heads // attn.num_key_value_heads
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
                                           v.repeat_interleave(rep, 2).transpose(1, 2), is_causal=True,
                                           scale=attn.scaling)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(1, T, -1))
        x = mlp(x)
    return model.lm_head(model.norm(x)).float()[0]


def main():
    cfg = Config()
    model = ExLlamaV2(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" not in name and "norm.weight" not in name:
                p.normal_(0.0, 0.25)
    page_size = 4
    max_pages = 26
    cache = ExLlamaV2Cache(cfg, max_seq_len=max_pages * page_size)
    generator = ExLlamaV2DynamicGenerator(model, cache, max_batch_size=4, max_chunk_size=8,
                                          page_size=page_size, max_pages=max_pages)

    g = torch.Generator().manual_seed(5)
    system = torch.randint(1, cfg.vocab_size, (9,), generator=g).tolist()  # shared system prompt (2 full pages)

    def user(n):
        return torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist()

    # (enqueue iteration, prompt, max_new_tokens)
    plan = [
        (0, system + user(4), 6),
        (0, system + user(7), 4),
        (0, user(5), 8),
        (2, user(13), 5),
        (3, system + user(2), 7),
        (6, user(3), 6),
        (9, system + user(10), 5),
        (12, user(8), 9),
        (15, system + user(1), 4),
        (18, user(11), 6),
    ]
    jobs = []
    it = 0
    while it < 300:
        for arr, prompt, mnt in plan:
            if arr == it:
                job = ExLlamaV2DynamicJob(torch.tensor([prompt]), max_new_tokens=mnt, identifier=len(jobs))
                job.prompt = list(prompt)
                jobs.append(job)
                generator.enqueue(job)
        if it > max(p[0] for p in plan) and generator.num_remaining_jobs() == 0:
            break
        generator.iterate()
        it += 1
    assert generator.num_remaining_jobs() == 0
    assert generator.shared_page_uses > 0, "no job shared prompt pages"
    assert generator.reused_unique_pages > 0, "no freed page was reused"

    worst = 0.0
    for job in jobs:
        assert len(job.output_ids) == job.max_new_tokens
        full = job.prompt + job.output_ids
        ref = reference_logits(model, full)
        for k, got in enumerate(job.output_logits):
            want = ref[len(job.prompt) - 1 + k]
            worst = max(worst, (got - want).abs().max().item())
            assert int(want.argmax()) == job.output_ids[k], (job.identifier, k)
    assert worst < 1e-4, worst
    print(f"{len(jobs)} jobs, {generator.shared_page_uses} shared page uses, {generator.reused_unique_pages} "
          f"reused pages: max |logit diff| vs per-job causal run = {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
