# lightseekorg/tokenspeed#271 (commit 59e861c3, "fix: missing causal mask for attn extend kernel").
# Commit 294830e made tokenspeed_kernel's mha_extend_with_kvcache non-causal ("each request's query
# tokens attend all visible cached KV tokens"), which is right for the split-prefill path (queries
# against the cached prefix only) but MHAAttnBackend._forward_extend also uses it for an extend
# whose new KV has already been written to the paged cache (prefix-cache hit with
# mha_extend_mode="paged", multi-token spec verify): each new token then attends to the later new
# tokens of its own chunk. Fix: mha_extend_with_kvcache gets is_causal (the queries are a causal
# suffix of the cached KV), passed through to the kernels, and _forward_extend calls it with True.
# Trimmed port of python/tokenspeed/runtime/layers/attention/backends/mha.py (MHAMetadata,
# init_forward_metadata, forward_extend, _forward_prefill, _forward_extend) with a torch stand-in
# for the kernels' paged varlen semantics, a paged token_to_kv_pool and a tiny RoPE decoder.
import enum
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAGE_SIZE = 4
CONTEXT_LEN = 32
NUM_PAGES = 32
VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS = 64, 64, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS


# ---------------------------------------------------------------- tokenspeed_kernel stand-ins


def _gather_paged(cache, page_table_row, n):
    pos = torch.arange(n)
    slots = page_table_row[pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE
    return cache.view(-1, cache.shape[2], cache.shape[3])[slots]


def _attend(q, k, v, scale, causal):
    # q: [q_len, hq, d], k/v: [kv_len, hk, d]; causal is bottom-right aligned (flash-attn kvcache)
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    mask = None
    if causal:
        q_len, kv_len = q.shape[0], k.shape[0]
        mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def mha_prefill(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                window_left=-1, logit_cap=0.0, sinks=None, return_lse=False, solution=None):
    out = torch.empty_like(q)
    for b in range(cu_seqlens_q.shape[0] - 1):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        out[s:e] = _attend(q[s:e], k[s:e], v[s:e], softmax_scale, causal=True)
    return out


def mha_extend_with_kvcache(q, cu_seqlens_q, k_cache, v_cache, page_table, cache_seqlens,
                            max_seqlen_q, max_seqlen_k, softmax_scale=None, is_causal=False,
                            window_left=-1, logit_cap=0.0, sinks=None, return_lse=False,
                            solution=None):
    out = torch.empty_like(q)
    for b in range(cache_seqlens.shape[0]):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n = int(cache_seqlens[b])
        k = _gather_paged(k_cache, page_table[b], n)
        v = _gather_paged(v_cache, page_table[b], n)
        out[s:e] = _attend(q[s:e], k, v, softmax_scale, causal=is_causal)
    return out


# ---------------------------------------------------------------- runtime pieces


class ForwardMode(enum.Enum):
    EXTEND = 1
    DECODE = 2

    def is_extend(self):
        return self == ForwardMode.EXTEND

    def is_extend_or_mixed(self):
        return self == ForwardMode.EXTEND


class TokenToKVPool:
    def __init__(self):
        shape = (NUM_PAGES * PAGE_SIZE, KV_HEADS, HEAD_DIM)
        self.k_buffer = [torch.zeros(shape) for _ in range(LAYERS)]
        self.v_buffer = [torch.zeros(shape) for _ in range(LAYERS)]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None):
        self.k_buffer[layer.layer_id][loc] = cache_k
        self.v_buffer[layer.layer_id][loc] = cache_v

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id]


def build_page_table(req_pool_indices, req_to_page, page_size, max_seq_len_k):
    max_pages = (max_seq_len_k + page_size - 1) // page_size
    return req_to_page[req_pool_indices, :max_pages]


@dataclass
class MHAMetadata:
    cache_seqlens_int32: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None
    max_seq_len_q: int | None = None
    max_seq_len_k: int | None = None
    prefix_seqlens_int32: torch.Tensor | None = None
    max_prefix_seq_len: int | None = None
    has_prefix: bool = False


class MHAAttnBackend:
    def __init__(self):
        self.mha_extend_mode = "paged"
        self.max_context_len = CONTEXT_LEN
        self.page_size = PAGE_SIZE
        self.kernel_solution = "triton"
        self.forward_prefill_metadata = None

    def init_forward_metadata(self, bs, req_pool_indices, seq_lens, forward_mode, req_to_page,
                              extend_prefix_lens=None, **kwargs):
        seq_lens = seq_lens[:bs]
        page_table = build_page_table(req_pool_indices[:bs], req_to_page, self.page_size,
                                      self.max_context_len)
        assert forward_mode.is_extend_or_mixed()
        if extend_prefix_lens is None:
            extend_seq_lens = seq_lens
        else:
            extend_seq_lens = seq_lens - extend_prefix_lens[:bs]
        extend_seq_lens_cpu = kwargs.get("extend_seq_lens_cpu")
        max_seq_len_q = int(extend_seq_lens_cpu[:bs].max().item())
        extend_prefix_lens_cpu = kwargs.get("extend_prefix_lens_cpu")
        if extend_prefix_lens is None:
            has_prefix = False
        elif extend_prefix_lens_cpu is not None:
            has_prefix = bool(extend_prefix_lens_cpu[:bs].any().item())
        else:
            has_prefix = False
        prefix_seqlens = None
        max_prefix_seq_len = None
        if extend_prefix_lens is not None:
            prefix_seqlens = extend_prefix_lens[:bs]
            max_prefix_seq_len = int(extend_prefix_lens_cpu[:bs].max().item())
        self.forward_prefill_metadata = MHAMetadata(
            cache_seqlens_int32=seq_lens,
            cu_seqlens_q=self._make_cu_seqlens(extend_seq_lens),
            page_table=page_table,
            max_seq_len_q=max_seq_len_q,
            max_seq_len_k=self.max_context_len,
            prefix_seqlens_int32=prefix_seqlens,
            max_prefix_seq_len=max_prefix_seq_len,
            has_prefix=has_prefix,
        )

    def forward_extend(self, q, k, v, layer, out_cache_loc, token_to_kv_pool, bs,
                       save_kv_cache=False, **kwargs):
        metadata = self.forward_prefill_metadata
        cu_seqlens_q = metadata.cu_seqlens_q
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
        v = v.view(-1, layer.tp_v_head_num, layer.v_head_dim)
        if metadata.has_prefix:
            # mha_extend_mode == "paged" (the default); "ragged" takes _forward_split_prefill
            return self._forward_extend(q, k, v, layer, out_cache_loc, token_to_kv_pool, metadata,
                                        cu_seqlens_q, save_kv_cache, kwargs.get("sinks"))
        return self._forward_prefill(q, k, v, layer, out_cache_loc, token_to_kv_pool, metadata,
                                     cu_seqlens_q, save_kv_cache, kwargs.get("sinks"))

    def _forward_prefill(self, q, k, v, layer, out_cache_loc, token_to_kv_pool, metadata,
                         cu_seqlens_q, save_kv_cache, sinks):
        output = mha_prefill(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                             max_seqlen_q=metadata.max_seq_len_q,
                             max_seqlen_k=metadata.max_seq_len_q,
                             softmax_scale=layer.scaling, window_left=layer.sliding_window_size,
                             sinks=sinks, solution=self.kernel_solution)
        output = output.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
        if save_kv_cache:
            token_to_kv_pool.set_kv_buffer(layer, out_cache_loc, k, v)
        return output

    def _forward_extend(self, q, k, v, layer, out_cache_loc, token_to_kv_pool, metadata,
                        cu_seqlens_q, save_kv_cache, sinks):
        if save_kv_cache:
            token_to_kv_pool.set_kv_buffer(layer, out_cache_loc, k, v)
        else:
            raise ValueError("mha_extend_with_kvcache requires KV to be prewritten")
        k_cache, v_cache = self._get_kv_cache(layer, token_to_kv_pool)
        extra = {"is_causal": True} if FIXED else {}
        result = mha_extend_with_kvcache(
            q=q,
            cu_seqlens_q=cu_seqlens_q,
            k_cache=k_cache,
            v_cache=v_cache,
            page_table=metadata.page_table,
            cache_seqlens=metadata.cache_seqlens_int32,
            softmax_scale=layer.scaling,
            window_left=layer.sliding_window_size,
            sinks=sinks,
            max_seqlen_q=metadata.max_seq_len_q,
            max_seqlen_k=metadata.max_seq_len_k,
            solution=self.kernel_solution,
            **extra,
        )
        return result.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _get_kv_cache(self, layer, token_to_kv_pool):
        k_cache = token_to_kv_pool.get_key_buffer(layer.layer_id).view(
            -1, self.page_size, layer.tp_k_head_num, layer.qk_head_dim)
        v_cache = token_to_kv_pool.get_value_buffer(layer.layer_id).view(
            -1, self.page_size, layer.tp_v_head_num, layer.v_head_dim)
        return k_cache, v_cache

    @staticmethod
    def _make_cu_seqlens(lengths):
        return F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


# ---------------------------------------------------------------- tiny decoder


def rope(x, positions):
    half = HEAD_DIM // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    ang = positions.float()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class PagedAttention(nn.Module):
    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.tp_q_head_num, self.tp_k_head_num, self.tp_v_head_num = HEADS, KV_HEADS, KV_HEADS
        self.qk_head_dim = self.v_head_dim = HEAD_DIM
        self.scaling = 1.0 / math.sqrt(HEAD_DIM)
        self.sliding_window_size = -1


class DecoderLayer(nn.Module):
    def __init__(self, layer_id):
        super().__init__()
        self.ln1, self.ln2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.q = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.kv = nn.Linear(HIDDEN, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.SiLU(), nn.Linear(4 * HIDDEN, HIDDEN))
        self.attn = PagedAttention(layer_id)

    def forward(self, x, positions, batch):
        h = self.ln1(x)
        q = rope(self.q(h).view(-1, HEADS, HEAD_DIM), positions)
        k, v = self.kv(h).view(-1, 2, KV_HEADS, HEAD_DIM).unbind(1)
        k = rope(k, positions)
        a = batch.attn_backend.forward_extend(q, k, v, self.attn, batch.out_cache_loc,
                                              batch.token_to_kv_pool, batch.bs, save_kv_cache=True)
        x = x + self.o(a)
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(DecoderLayer(i) for i in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    @torch.no_grad()
    def forward(self, input_ids, positions, batch):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions, batch)
        return self.lm_head(self.norm(x))


@dataclass
class ForwardBatch:
    bs: int
    out_cache_loc: torch.Tensor
    token_to_kv_pool: TokenToKVPool
    attn_backend: MHAAttnBackend


def run_extend(model, backend, pool, req_to_page, reqs):
    """reqs: list of (req_pool_idx, all_token_ids, prefix_len). Pages already set in req_to_page."""
    bs = len(reqs)
    ids, positions, locs, ends = [], [], [], []
    for ridx, tokens, prefix_len in reqs:
        new = torch.tensor(tokens[prefix_len:])
        pos = torch.arange(prefix_len, len(tokens))
        ids.append(new)
        positions.append(pos)
        locs.append(req_to_page[ridx, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE)
    seq_lens = torch.tensor([len(t) for _, t, _ in reqs], dtype=torch.int32)
    prefix_lens = torch.tensor([p for _, _, p in reqs], dtype=torch.int32)
    backend.init_forward_metadata(
        bs, torch.tensor([r for r, _, _ in reqs]), seq_lens, ForwardMode.EXTEND, req_to_page,
        extend_prefix_lens=prefix_lens, extend_seq_lens_cpu=seq_lens - prefix_lens,
        extend_prefix_lens_cpu=prefix_lens)
    batch = ForwardBatch(bs, torch.cat(locs), pool, backend)
    logits = model(torch.cat(ids), torch.cat(positions), batch)
    cu = backend.forward_prefill_metadata.cu_seqlens_q
    return [logits[int(cu[i]):int(cu[i + 1])] for i in range(bs)]


def main():
    model = TinyCausalLM().eval()
    backend = MHAAttnBackend()
    pool = TokenToKVPool()
    req_to_page = torch.zeros(8, CONTEXT_LEN // PAGE_SIZE, dtype=torch.int32)

    prompt_a = torch.randint(0, VOCAB, (16,)).tolist()
    req_to_page[1, :4] = torch.tensor([3, 7, 1, 9])
    run_extend(model, backend, pool, req_to_page, [(1, prompt_a, 0)])

    # Two new requests share cached pages of request 1 (radix prefix-cache hits on page boundaries)
    prompt_b = prompt_a[:8] + torch.randint(0, VOCAB, (6,)).tolist()
    prompt_c = prompt_a[:4] + torch.randint(0, VOCAB, (5,)).tolist()
    req_to_page[2, :4] = torch.tensor([3, 7, 12, 13])
    req_to_page[3, :3] = torch.tensor([3, 15, 16])
    outs = run_extend(model, backend, pool, req_to_page, [(2, prompt_b, 8), (3, prompt_c, 4)])

    for name, lg in zip(("b", "c"), outs):
        print(f"request {name}: greedy next tokens over the extend {lg.argmax(-1).tolist()}, "
              f"last-token logits[:3] {[round(x, 4) for x in lg[-1, :3].tolist()]}")


if __name__ == "__main__":
    main()
