# sgl-project/sglang#25045 ("Fix FA3 cross-attention batched-decode for per-request varlen encoder").
# Ported from python/sglang/srt/layers/attention/flashattention_backend.py before the fix
# (FlashAttentionBackend.init_cuda_graph_state / init_forward_metadata_capture_cuda_graph /
# init_forward_metadata_replay_cuda_graph / forward_decode, normal_decode_set_metadata), with the pools trimmed
# (ReqToTokenPool.req_to_token, MHATokenToKVPool) and a torch stand-in for sgl_kernel's flash_attn_with_kvcache
# (page_size = 1). An encoder-decoder model (MossVL / Mllama style: each request's req_to_token row holds its
# encoder (image) tokens first, then its decoder tokens) decodes one step for a batch of 3 requests whose
# images give different encoder lengths, through the CUDA-graph replay path.
# Bug: the replay path took `encoder_lens[0]` for the whole batch: `encoder_lens_int32.copy_(encoder_lens[:1])`
# broadcasts request 0's encoder length into every row (cross-attention `cache_seqlens`), and the self-attention
# page table is sliced from req_to_token at the offset `encoder_lens[0]` for every row.
# Fix (written from the PR's description; its merged diff was not read): encoder_max_seq_len_k =
# encoder_lens.max(), copy the full encoder_lens[:bs], and build the self-attention page table with each
# request's own offset encoder_lens[i].
import sys
from dataclasses import dataclass

import torch

FIXED = "--fixed" in sys.argv


def flash_attn_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, cu_seqlens_k_new=None,
                            max_seqlen_q=1, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            k_descale=None, v_descale=None):
    # CPU stand-in for sgl_kernel.flash_attn.flash_attn_with_kvcache: varlen q, paged KV (page_size = 1),
    # row b attends to the cache_seqlens[b] slots page_table[b, :cache_seqlens[b]], causal aligned bottom-right.
    k_flat = k_cache.reshape(-1, k_cache.shape[-2], k_cache.shape[-1])
    v_flat = v_cache.reshape(-1, v_cache.shape[-2], v_cache.shape[-1])
    out = torch.empty_like(q)
    for b in range(cache_seqlens.shape[0]):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n_k = int(cache_seqlens[b])
        slots = page_table[b, :n_k].long()
        k, v = k_flat[slots], v_flat[slots]  # (n_k, H, D)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe], k) * softmax_scale
        if causal:
            n_q = qe - qs
            allowed = torch.arange(n_k)[None, :] <= (torch.arange(n_q)[:, None] + n_k - n_q)
            scores = scores.masked_fill(~allowed, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def normal_decode_set_metadata(cache_seqlens_int32, cu_seqlens_k, page_table, req_to_token, req_pool_indices,
                               strided_indices, max_seq_pages, seq_lens, seq_len_delta, page_size):
    cache_seqlens_int32.copy_(seq_lens + seq_len_delta)
    cu_seqlens_k[1:].copy_(torch.cumsum(cache_seqlens_int32, dim=0, dtype=torch.int32))
    page_indices = req_to_token[req_pool_indices[:, None], strided_indices[:max_seq_pages][None, :]]
    page_table[:, :max_seq_pages].copy_(page_indices // page_size)


@dataclass
class FlashAttentionMetadata:
    cache_seqlens_int32: torch.Tensor = None
    max_seq_len_q: int = 1
    max_seq_len_k: int = 0
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_k: torch.Tensor = None
    page_table: torch.Tensor = None
    encoder_cu_seqlens_k: torch.Tensor = None
    encoder_max_seq_len_k: int = 0
    encoder_lens_int32: torch.Tensor = None
    encoder_page_table: torch.Tensor = None


@dataclass
class RadixAttention:
    layer_id: int
    is_cross_attention: bool
    tp_q_head_num: int = 2
    tp_k_head_num: int = 2
    head_dim: int = 8
    scaling: float = 8 ** -0.5
    logit_cap: float = 0.0


class MHATokenToKVPool:
    def __init__(self, size, head_num, head_dim, layer_num):
        self.k_buffer = [torch.zeros(size + 1, head_num, head_dim) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(size + 1, head_num, head_dim) for _ in range(layer_num)]

    def get_kv_buffer(self, layer_id):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[layer.layer_id][loc] = cache_k
        self.v_buffer[layer.layer_id][loc] = cache_v


class FlashAttentionBackend:
    def __init__(self, req_to_token, token_to_kv_pool, max_context_len, page_size=1):
        self.req_to_token = req_to_token
        self.token_to_kv_pool = token_to_kv_pool
        self.max_context_len = max_context_len
        self.page_size = page_size
        self.forward_metadata = None

    def init_cuda_graph_state(self, max_bs):
        self.decode_cuda_graph_metadata = {
            "cache_seqlens": torch.zeros(max_bs, dtype=torch.int32),
            "cu_seqlens_q": torch.arange(0, max_bs + 1, dtype=torch.int32),
            "cu_seqlens_k": torch.zeros(max_bs + 1, dtype=torch.int32),
            "page_table": torch.zeros(max_bs, self.max_context_len, dtype=torch.int32),
            "strided_indices": torch.arange(0, self.max_context_len, self.page_size),
        }
        self.encoder_metadata = {
            "encoder_page_table": torch.zeros(max_bs, self.max_context_len, dtype=torch.int32),
            "encoder_lens_int32": torch.zeros(max_bs, dtype=torch.int32),
            "encoder_cu_seqlens_k": torch.zeros(max_bs + 1, dtype=torch.int32),
        }

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens):
        metadata = FlashAttentionMetadata()
        # Normal Decode
        metadata.cache_seqlens_int32 = self.decode_cuda_graph_metadata["cache_seqlens"][:bs]
        metadata.cu_seqlens_k = self.decode_cuda_graph_metadata["cu_seqlens_k"][: bs + 1]
        metadata.max_seq_len_k = seq_lens.max().item()
        metadata.page_table = self.decode_cuda_graph_metadata["page_table"][:bs, :]
        metadata.cu_seqlens_q = torch.arange(0, bs + 1, dtype=torch.int32)
        self.decode_cuda_graph_metadata[bs] = metadata
        if encoder_lens is not None:
            encoder_bs = encoder_lens.numel()
            metadata.encoder_lens_int32 = self.encoder_metadata["encoder_lens_int32"][:encoder_bs]
            metadata.encoder_cu_seqlens_k = self.encoder_metadata["encoder_cu_seqlens_k"][: (encoder_bs + 1)]
            metadata.encoder_page_table = self.encoder_metadata["encoder_page_table"][:bs, :]
        self.forward_metadata = metadata

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                seq_lens_cpu):
        seq_lens = seq_lens[:bs]
        seq_lens_cpu = seq_lens_cpu[:bs]
        req_pool_indices = req_pool_indices[:bs]
        # Normal Decode
        metadata = self.decode_cuda_graph_metadata[bs]
        max_len = seq_lens_cpu.max().item()
        max_seq_pages = (max_len + self.page_size - 1) // self.page_size
        metadata.max_seq_len_k = max_len
        normal_decode_set_metadata(metadata.cache_seqlens_int32, metadata.cu_seqlens_k, metadata.page_table,
                                   self.req_to_token, req_pool_indices,
                                   self.decode_cuda_graph_metadata["strided_indices"], max_seq_pages, seq_lens, 0,
                                   self.page_size)

        if encoder_lens is not None:
            if not FIXED:
                # Only support encoder size 1 for now
                metadata.encoder_max_seq_len_k = encoder_lens[0]
                metadata.encoder_lens_int32.copy_(encoder_lens[:1])
            else:
                metadata.encoder_max_seq_len_k = encoder_lens[:bs].max().item()
                metadata.encoder_lens_int32.copy_(encoder_lens[:bs])
            metadata.encoder_cu_seqlens_k[1:].copy_(
                torch.cumsum(metadata.encoder_lens_int32, dim=0, dtype=torch.int32))
            metadata.encoder_page_table[:, : metadata.encoder_max_seq_len_k].copy_(
                self.req_to_token[req_pool_indices, : metadata.encoder_max_seq_len_k])
            # Update the regular page table
            if not FIXED:
                page_table = self.req_to_token[
                    req_pool_indices,
                    metadata.encoder_max_seq_len_k: (metadata.encoder_max_seq_len_k + metadata.max_seq_len_k),
                ]
            else:
                cols = encoder_lens[:bs].long()[:, None] + torch.arange(metadata.max_seq_len_k)[None, :]
                page_table = self.req_to_token[req_pool_indices[:, None].long(), cols]
            metadata.page_table[:, : metadata.max_seq_len_k].copy_(page_table)
        self.forward_metadata = metadata

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if k is not None:
            assert v is not None
            if save_kv_cache:
                cache_loc = (forward_batch["out_cache_loc"] if not layer.is_cross_attention
                             else forward_batch["encoder_out_cache_loc"])
                self.token_to_kv_pool.set_kv_buffer(layer, cache_loc, k, v)
        metadata = self.forward_metadata
        key_cache, value_cache = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        key_cache = key_cache.view(-1, self.page_size, layer.tp_k_head_num, layer.head_dim)
        value_cache = value_cache.view(-1, self.page_size, layer.tp_k_head_num, layer.head_dim)
        q_reshaped = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
        if layer.is_cross_attention:
            o = flash_attn_with_kvcache(q=q_reshaped, k_cache=key_cache, v_cache=value_cache,
                                        page_table=metadata.encoder_page_table,
                                        cache_seqlens=metadata.encoder_lens_int32,
                                        cu_seqlens_q=metadata.cu_seqlens_q, cu_seqlens_k_new=None, max_seqlen_q=1,
                                        softmax_scale=layer.scaling, causal=False, window_size=(-1, -1),
                                        softcap=layer.logit_cap)
        else:
            o = flash_attn_with_kvcache(q=q_reshaped, k_cache=key_cache, v_cache=value_cache,
                                        page_table=metadata.page_table, cache_seqlens=metadata.cache_seqlens_int32,
                                        cu_seqlens_q=metadata.cu_seqlens_q, cu_seqlens_k_new=metadata.cu_seqlens_k,
                                        max_seqlen_q=metadata.max_seq_len_q, softmax_scale=layer.scaling,
                                        causal=True, window_size=(-1, -1), softcap=layer.logit_cap)
        return o.view(-1, layer.tp_q_head_num * layer.head_dim)


def main():
    torch.manual_seed(0)
    H, D, max_bs, max_context_len, pool_size = 2, 8, 4, 32, 128
    req_to_token = torch.zeros(max_bs, max_context_len, dtype=torch.int32)
    pool = MHATokenToKVPool(pool_size, H, D, layer_num=2)
    self_attn, cross_attn = RadixAttention(0, False), RadixAttention(1, True)
    backend = FlashAttentionBackend(req_to_token, pool, max_context_len)
    backend.init_cuda_graph_state(max_bs)

    # Startup: capture the decode graph for bs = 3 (dummy seq_lens / encoder_lens buffers).
    bs = 3
    buf_seq_lens = torch.ones(max_bs, dtype=torch.int64)
    buf_encoder_lens = torch.zeros(max_bs, dtype=torch.int32)
    buf_req_pool_indices = torch.zeros(max_bs, dtype=torch.int64)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs, buf_req_pool_indices[:bs], buf_seq_lens[:bs],
                                                     buf_encoder_lens[:bs])

    # Three requests already prefilled: image tokens (encoder) then text tokens (decoder) in each row.
    encoder_lens = [6, 3, 9]
    decoder_lens = [4, 5, 2]
    next_slot = 1  # slot 0 is the pool's padding slot
    for r in range(bs):
        n = encoder_lens[r] + decoder_lens[r] + 1  # + the slot of this decode step's token
        req_to_token[r, :n] = torch.arange(next_slot, next_slot + n, dtype=torch.int32)
        next_slot += n
        enc_loc = req_to_token[r, : encoder_lens[r]].long()
        pool.set_kv_buffer(cross_attn, enc_loc, torch.randn(encoder_lens[r], H, D), torch.randn(encoder_lens[r], H, D))
        dec_loc = req_to_token[r, encoder_lens[r]: encoder_lens[r] + decoder_lens[r]].long()
        pool.set_kv_buffer(self_attn, dec_loc, torch.randn(decoder_lens[r], H, D), torch.randn(decoder_lens[r], H, D))

    # Decode step: one new text token per request.
    seq_lens = torch.tensor(decoder_lens) + 1
    out_cache_loc = torch.stack([req_to_token[r, encoder_lens[r] + decoder_lens[r]] for r in range(bs)]).long()
    forward_batch = {"out_cache_loc": out_cache_loc, "encoder_out_cache_loc": None}
    # CudaGraphRunner.replay_prepare: copy the batch into the static buffers, then replay the metadata.
    buf_seq_lens[:bs].copy_(seq_lens)
    buf_encoder_lens[:bs].copy_(torch.tensor(encoder_lens, dtype=torch.int32))
    buf_req_pool_indices[:bs].copy_(torch.arange(bs))
    backend.init_forward_metadata_replay_cuda_graph(bs, buf_req_pool_indices[:bs], buf_seq_lens[:bs],
                                                    int(seq_lens.sum()), buf_encoder_lens[:bs],
                                                    buf_seq_lens[:bs].clone())

    q = torch.randn(bs, H * D)
    k_new, v_new = torch.randn(bs, H, D), torch.randn(bs, H, D)
    self_out = backend.forward_decode(q, k_new, v_new, self_attn, forward_batch)
    cross_out = backend.forward_decode(q, None, None, cross_attn, forward_batch)
    for r in range(bs):
        print("request %d (encoder %d, decoder %d): self %s cross %s" % (
            r, encoder_lens[r], int(seq_lens[r]), [round(x, 4) for x in self_out[r, :3].tolist()],
            [round(x, 4) for x in cross_out[r, :3].tolist()]))


if __name__ == "__main__":
    main()
