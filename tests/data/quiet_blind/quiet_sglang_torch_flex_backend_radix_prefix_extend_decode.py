# Correct program (quiet batch quiet-r82a).
# Citation: sgl-project/sglang python/sglang/srt/layers/attention/torch_flex_backend.py
#   @106f37cea63a70dea91958cb633ccbd87c932d40 (TorchFlexAttnBackend.init_forward_metadata, _causal_mask,
#   _decode_mask, _run_flex_forward_extend, _run_flex_forward_decode, forward_extend, forward_decode).
# SGLang's FlexAttention backend over its token pool: req_to_token maps each request's positions to KV slots, so a
# radix-cache prefix hit or an earlier prefill chunk is just a prefix of slots already written. In extend mode one
# causal block mask of (seq_len, seq_len) is built per request; the request's new queries are placed at rows
# [extend_prefix_len, seq_len) of a redundant query buffer (the rows before are scratch and dropped), so the causal
# mask is aligned to absolute positions over the whole cached sequence. In decode mode the single query gets
# _decode_mask (q_idx <= kv_idx with q_idx = 0: every one of the seq_len cached keys).
# Adaptation: flex_attention runs eagerly on CPU (the backend wraps it in torch.compile); the token pool, the
# req_to_token pool, the radix-cache hit (request B reuses request A's first 8 slots) and the scheduler are small
# stand-ins; a RadixAttention-like layer holds layer_id, head counts and scaling.
# Self-check: every token's output equals a per-request run over its own unpadded sequence (prefix included),
# a loop over query positions t slicing keys [0, t] (no mask tensor).
import enum
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2

    def is_extend(self):
        return self == ForwardMode.EXTEND

    def is_decode(self):
        return self == ForwardMode.DECODE


class AttentionType(enum.Enum):
    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"


class ForwardBatch:
    def __init__(self, forward_mode, req_pool_indices, seq_lens, out_cache_loc, extend_prefix_lens=None,
                 extend_seq_lens=None):
        self.forward_mode = forward_mode
        self.req_pool_indices = req_pool_indices
        self.seq_lens = seq_lens
        self.out_cache_loc = out_cache_loc
        self.extend_prefix_lens = extend_prefix_lens
        self.extend_seq_lens = extend_seq_lens


class ReqToTokenPool:
    def __init__(self, size, max_context_len):
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int64)


class MHATokenToKVPool:
    def __init__(self, size, head_num, head_dim, layer_num):
        # slot 0 is the padding slot, as in SGLang
        self.k_buffer = [torch.zeros(size + 1, head_num, head_dim) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(size + 1, head_num, head_dim) for _ in range(layer_num)]

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[layer.layer_id][loc] = cache_k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
        self.v_buffer[layer.layer_id][loc] = cache_v.view(-1, layer.tp_v_head_num, layer.v_head_dim)


class ModelRunner:
    def __init__(self, req_to_token_pool, token_to_kv_pool):
        self.device = torch.device("cpu")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool


class TorchFlexAttnBackend:
    def __init__(self, model_runner):
        self.forward_metadata = None
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.flex_attention = flex_attention

    def init_forward_metadata(self, forward_batch):
        self.extend_block_masks = []
        self.decode_block_masks = []
        if forward_batch.forward_mode.is_extend():
            for seq_idx in range(forward_batch.seq_lens.shape[0]):
                seq_len_kv = forward_batch.seq_lens[seq_idx]
                seq_len_q = seq_len_kv
                self.extend_block_masks.append(
                    create_block_mask(self._causal_mask, None, None, seq_len_q, seq_len_kv, device=self.device,
                                      _compile=False))
        elif forward_batch.forward_mode.is_decode():
            for seq_idx in range(forward_batch.seq_lens.shape[0]):
                seq_len_q = 1
                seq_len_kv = forward_batch.seq_lens[seq_idx]
                self.decode_block_masks.append(
                    create_block_mask(self._decode_mask, None, None, seq_len_q, seq_len_kv, device=self.device,
                                      _compile=False))

    @staticmethod
    def _causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    @staticmethod
    def _decode_mask(b, h, q_idx, kv_idx):
        return q_idx <= kv_idx

    def _run_flex_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 extend_prefix_lens, extend_seq_lens, scaling=None, enable_gqa=False, causal=False):
        assert seq_lens.shape[0] == extend_prefix_lens.shape[0]
        assert seq_lens.shape[0] == extend_seq_lens.shape[0]
        query = query.movedim(0, query.dim() - 2)
        start_q, start_kv = 0, 0
        for seq_idx in range(seq_lens.shape[0]):
            extend_seq_len_q = extend_seq_lens[seq_idx]
            prefill_seq_len_q = extend_prefix_lens[seq_idx]
            seq_len_kv = seq_lens[seq_idx]
            end_q = start_q + extend_seq_len_q
            end_kv = start_kv + seq_len_kv

            per_req_query = query[:, start_q:end_q, :]
            per_req_query_redundant = torch.empty((per_req_query.shape[0], seq_len_kv, per_req_query.shape[2]),
                                                  dtype=per_req_query.dtype, device=per_req_query.device)
            per_req_query_redundant[:, prefill_seq_len_q:, :] = per_req_query

            req_pool_idx = req_pool_indices[seq_idx]
            per_req_tokens = req_to_token[req_pool_idx, :seq_len_kv]
            per_req_key = k_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_value = v_cache[per_req_tokens].movedim(0, query.dim() - 2)

            if not causal:
                raise NotImplementedError("Non-causal mode is not yet implemented.")

            per_req_out_redundant = (
                self.flex_attention(per_req_query_redundant.unsqueeze(0), per_req_key.unsqueeze(0),
                                    per_req_value.unsqueeze(0), block_mask=self.extend_block_masks[seq_idx],
                                    scale=scaling, enable_gqa=enable_gqa)
                .squeeze(0)
                .movedim(query.dim() - 2, 0)
            )
            output[start_q:end_q, :, :] = per_req_out_redundant[prefill_seq_len_q:, :, :]
            start_q, start_kv = end_q, end_kv
        return output

    def _run_flex_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 scaling=None, enable_gqa=False, causal=False):
        query = query.movedim(0, query.dim() - 2)
        start_q, start_kv = 0, 0
        for seq_idx in range(seq_lens.shape[0]):
            seq_len_q = 1
            seq_len_kv = seq_lens[seq_idx]
            end_q = start_q + seq_len_q
            end_kv = start_kv + seq_len_kv

            per_req_query = query[:, start_q:end_q, :]
            req_pool_idx = req_pool_indices[seq_idx]
            per_req_tokens = req_to_token[req_pool_idx, :seq_len_kv]
            per_req_key = k_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_value = v_cache[per_req_tokens].movedim(0, query.dim() - 2)

            per_req_out = (
                self.flex_attention(per_req_query.unsqueeze(0), per_req_key.unsqueeze(0),
                                    per_req_value.unsqueeze(0), block_mask=self.decode_block_masks[seq_idx],
                                    scale=scaling, enable_gqa=enable_gqa)
                .squeeze(0)
                .movedim(query.dim() - 2, 0)
            )
            output[start_q:end_q, :, :] = per_req_out
            start_q, start_kv = end_q, end_kv
        return output

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        o = torch.empty_like(q)
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        use_gqa = layer.tp_q_head_num != layer.tp_k_head_num
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        causal = True
        if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:
            raise NotImplementedError("TorchFlexAttnBackend does not support non-causal attention for now.")
        self._run_flex_forward_extend(q_, o_, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                                      self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                                      self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                                      forward_batch.seq_lens, forward_batch.extend_prefix_lens,
                                      forward_batch.extend_seq_lens, scaling=layer.scaling, enable_gqa=use_gqa,
                                      causal=causal)
        return o

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        o = torch.empty_like(q)
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        use_gqa = layer.tp_q_head_num != layer.tp_k_head_num
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        self._run_flex_forward_decode(q_, o_, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                                      self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                                      self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                                      forward_batch.seq_lens, scaling=layer.scaling, enable_gqa=use_gqa,
                                      causal=False)
        return o

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)


# ---------------------------------------------------------------------------------------------------------------
HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 32, 4, 2, 8, 2


class RadixAttention(torch.nn.Module):
    def __init__(self, layer_id, attn_backend):
        super().__init__()
        self.layer_id = layer_id
        self.tp_q_head_num, self.tp_k_head_num, self.tp_v_head_num = NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS
        self.qk_head_dim = self.v_head_dim = HEAD_DIM
        self.scaling = HEAD_DIM ** -0.5
        self.is_cross_attention = False
        self.attn_type = AttentionType.DECODER
        self.attn_backend = attn_backend

    def forward(self, q, k, v, forward_batch):
        return self.attn_backend.forward(q, k, v, self, forward_batch)


class DecoderLayer(torch.nn.Module):
    def __init__(self, layer_id, attn_backend):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(HIDDEN, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
        self.o_proj = torch.nn.Linear(NUM_HEADS * HEAD_DIM, HIDDEN)
        self.attn = RadixAttention(layer_id, attn_backend)

    def qkv(self, x):
        return self.qkv_proj(x).split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], -1)

    def forward(self, x, forward_batch):
        q, k, v = self.qkv(x)
        return x + self.o_proj(self.attn(q, k, v, forward_batch))

    def reference(self, x):
        q, k, v = self.qkv(x)
        n = x.shape[0]
        q = q.view(n, NUM_HEADS, HEAD_DIM)
        rep = NUM_HEADS // NUM_KV_HEADS
        k = k.view(n, NUM_KV_HEADS, HEAD_DIM).repeat_interleave(rep, 1)
        v = v.view(n, NUM_KV_HEADS, HEAD_DIM).repeat_interleave(rep, 1)
        rows = []
        for t in range(n):
            s = torch.einsum("hd,khd->hk", q[t], k[:t + 1]) * HEAD_DIM ** -0.5
            rows.append(torch.einsum("hk,khd->hd", s.softmax(-1), v[:t + 1]))
        return x + self.o_proj(torch.stack(rows).reshape(n, -1))


def main():
    torch.manual_seed(0)
    req_to_token_pool = ReqToTokenPool(4, 64)
    token_to_kv_pool = MHATokenToKVPool(96, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS)
    backend = TorchFlexAttnBackend(ModelRunner(req_to_token_pool, token_to_kv_pool))
    layers = [DecoderLayer(i, backend) for i in range(NUM_LAYERS)]

    shared_prefix = torch.randn(8, HIDDEN)
    streams = {
        "A": torch.cat([shared_prefix, torch.randn(6, HIDDEN)]),   # 12 prompt + 2 decodes
        "B": torch.cat([shared_prefix, torch.randn(8, HIDDEN)]),   # radix hit on A's first 8, 6 new, 2 decodes
        "C": torch.randn(18, HIDDEN),                              # 16-token prompt in chunks of 10 and 6, 2 decodes
    }
    pool_idx = {"A": 2, "B": 0, "C": 3}
    free_slots = list(torch.randperm(96) + 1)  # slot 0 stays the padding slot
    done = {r: 0 for r in streams}
    outs = {r: [] for r in streams}
    # (mode, [(req, prefix_len, new tokens)])
    schedule = [
        (ForwardMode.EXTEND, [("A", 0, 12), ("C", 0, 10)]),
        (ForwardMode.EXTEND, [("B", 8, 6), ("C", 10, 6)]),
        (ForwardMode.DECODE, [("A", 12, 1), ("B", 14, 1), ("C", 16, 1)]),
        (ForwardMode.DECODE, [("C", 17, 1), ("A", 13, 1), ("B", 15, 1)]),
    ]
    with torch.no_grad():
        for mode, reqs in schedule:
            out_cache_loc, seq_lens, prefix_lens, ext_lens, xs = [], [], [], [], []
            for r, prefix, n in reqs:
                if r == "B" and done[r] == 0:
                    # radix cache match: B's first 8 positions point at A's slots
                    req_to_token_pool.req_to_token[pool_idx["B"], :8] = req_to_token_pool.req_to_token[
                        pool_idx["A"], :8]
                    done[r] = 8
                assert done[r] == prefix
                locs = torch.stack([free_slots.pop(0) for _ in range(n)])
                req_to_token_pool.req_to_token[pool_idx[r], prefix:prefix + n] = locs
                out_cache_loc.append(locs)
                seq_lens.append(prefix + n)
                prefix_lens.append(prefix)
                ext_lens.append(n)
                xs.append(streams[r][prefix:prefix + n])
            forward_batch = ForwardBatch(
                mode, torch.tensor([pool_idx[r] for r, _, _ in reqs]), torch.tensor(seq_lens),
                torch.cat(out_cache_loc),
                torch.tensor(prefix_lens) if mode.is_extend() else None,
                torch.tensor(ext_lens) if mode.is_extend() else None)
            backend.init_forward_metadata(forward_batch)
            h = torch.cat(xs)
            for layer in layers:
                h = layer(h, forward_batch)
            off = 0
            for r, prefix, n in reqs:
                outs[r].append((prefix, h[off:off + n]))
                off += n
                done[r] = prefix + n

        for r, x in streams.items():
            ref = x
            for layer in layers:
                ref = layer.reference(ref)
            for prefix, got in outs[r]:
                torch.testing.assert_close(got, ref[prefix:prefix + got.shape[0]], atol=1e-5, rtol=1e-5)
            assert done[r] == x.shape[0], (r, done[r])
    print("SGLang TorchFlexAttnBackend extend (radix prefix hit, chunked prefill) and decode match per-request runs")


if __name__ == "__main__":
    main()
