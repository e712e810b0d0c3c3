# sgl-project/sglang#37505 (commit 718bd39f, "[Fix] DP attention: correct the decode->extend prefix
# off-by-one"; bug added by #36288). Under --enable-dp-attention a running decode batch is turned into a
# 1-token extend batch by ScheduleBatch.convert_decode_to_extend, which took each request's prefix from its
# token list: len(origin_input_ids) + len(output_ids) + (0 if enable_overlap else -1). Under overlap that
# assumes output_ids trails seq_lens by one step; after an iteration that ran prefill instead of decode the
# lag is drained and the formula gives prefix_len == seq_len. The extend then runs its token at RoPE position
# seq_len (one past its own KV slot), writes its K/V one row further, and its causal window over
# req_to_token reaches one slot too far (a stale slot of the row's previous request).
# Fix: the prefix is taken from the batch's own seq_lens: prefix_len = seq_len - 1.
# Ported to plain torch: req_to_token pool, token_to_kv pool, TorchNativeAttnBackend-style extend
# (per request SDPA over the pool, query padded in front to the prefix, is_causal=True).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(1)


class ModelConfig:
    vocab_size = 48
    hidden_size = 32
    num_attention_heads = 4
    head_dim = 8
    rope_theta = 10000.0


class ReqToTokenPool:
    def __init__(self, size, max_context_len):
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64)


class MHATokenToKVPool:
    def __init__(self, size, head_num, head_dim):
        self.k_buffer = torch.zeros((size, head_num, head_dim))
        self.v_buffer = torch.zeros((size, head_num, head_dim))
        self.free_slots = list(range(1, size))

    def alloc(self, n):
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, idx):
        self.free_slots = sorted(self.free_slots + idx.tolist())

    def set_kv_buffer(self, loc, k, v):
        self.k_buffer[loc] = k
        self.v_buffer[loc] = v


def apply_rotary(x, positions, theta, dim):
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class ForwardBatch:
    def __init__(self, input_ids, positions, req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens,
                 out_cache_loc, req_to_token_pool, token_to_kv_pool):
        self.input_ids = input_ids
        self.positions = positions
        self.req_pool_indices = req_pool_indices
        self.seq_lens = seq_lens
        self.extend_prefix_lens = extend_prefix_lens
        self.extend_seq_lens = extend_seq_lens
        self.out_cache_loc = out_cache_loc
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool


class TorchNativeAttnBackend:
    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                 seq_lens, extend_prefix_lens, extend_seq_lens, scaling=None, causal=True):
        assert seq_lens.shape[0] == extend_prefix_lens.shape[0]
        assert seq_lens.shape[0] == extend_seq_lens.shape[0]
        query = query.movedim(0, query.dim() - 2)  # [heads, tokens, dim]
        start_q = 0
        for seq_idx in range(seq_lens.shape[0]):
            extend_seq_len_q = int(extend_seq_lens[seq_idx])
            prefill_seq_len_q = int(extend_prefix_lens[seq_idx])
            seq_len_kv = int(seq_lens[seq_idx])
            end_q = start_q + extend_seq_len_q
            per_req_query = query[:, start_q:end_q, :]
            per_req_query_redudant = torch.empty(
                (per_req_query.shape[0], seq_len_kv, per_req_query.shape[2]), dtype=per_req_query.dtype)
            per_req_query_redudant[:, prefill_seq_len_q:, :] = per_req_query
            req_pool_idx = req_pool_indices[seq_idx]
            per_req_tokens = req_to_token[req_pool_idx, :seq_len_kv]
            per_req_key = k_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_value = v_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_out_redudant = F.scaled_dot_product_attention(
                per_req_query_redudant.unsqueeze(0), per_req_key.unsqueeze(0), per_req_value.unsqueeze(0),
                scale=scaling, is_causal=causal,
            ).squeeze(0).movedim(query.dim() - 2, 0)
            output[start_q:end_q, :, :] = per_req_out_redudant[prefill_seq_len_q:, :, :]
            start_q = end_q
        return output

    def forward_extend(self, q, k, v, forward_batch, scaling):
        forward_batch.token_to_kv_pool.set_kv_buffer(forward_batch.out_cache_loc, k, v)
        o = torch.empty_like(q)
        return self._run_sdpa_forward_extend(
            q, o, forward_batch.token_to_kv_pool.k_buffer, forward_batch.token_to_kv_pool.v_buffer,
            forward_batch.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
            forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens,
            scaling=scaling, causal=True)


class TinyLlama(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.attn_backend = TorchNativeAttnBackend()

    def forward(self, forward_batch):
        c = self.config
        h = self.embed_tokens(forward_batch.input_ids)
        q, k, v = self.qkv_proj(h).view(-1, 3, c.num_attention_heads, c.head_dim).unbind(1)
        q = apply_rotary(q, forward_batch.positions, c.rope_theta, c.head_dim)
        k = apply_rotary(k, forward_batch.positions, c.rope_theta, c.head_dim)
        o = self.attn_backend.forward_extend(q, k, v, forward_batch, scaling=c.head_dim ** -0.5)
        h = h + self.o_proj(o.reshape(-1, c.hidden_size))
        return self.lm_head(h)


class Req:
    def __init__(self, rid, origin_input_ids):
        self.rid = rid
        self.origin_input_ids = origin_input_ids
        self.output_ids = []
        self.req_pool_idx = None


class ScheduleBatch:
    def __init__(self, reqs, req_to_token_pool, token_to_kv_pool, enable_overlap):
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.enable_overlap = enable_overlap
        self.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs])
        self.seq_lens = None
        self.input_ids = None

    def convert_decode_to_extend(self):
        # seq_lens already counts the token this step computes (prepare_for_decode ran)
        if FIXED:
            self.prefix_lens = (self.seq_lens - 1).tolist()
        else:
            delta = 0 if self.enable_overlap else -1
            self.prefix_lens = [len(r.origin_input_ids) + len(r.output_ids) + delta for r in self.reqs]
        self.extend_lens = [1] * len(self.reqs)
        self.extend_num_tokens = sum(self.extend_lens)
        self.seq_lens = torch.tensor([p + e for p, e in zip(self.prefix_lens, self.extend_lens)])
        self.out_cache_loc = self.token_to_kv_pool.alloc(self.extend_num_tokens)
        pt = 0
        for i, r in enumerate(self.reqs):
            p, e = self.prefix_lens[i], self.extend_lens[i]
            self.req_to_token_pool.req_to_token[r.req_pool_idx, p:p + e] = self.out_cache_loc[pt:pt + e]
            pt += e
        self.positions = torch.cat([torch.arange(p, p + e) for p, e in zip(self.prefix_lens, self.extend_lens)])
        return self

    def get_forward_batch(self):
        return ForwardBatch(self.input_ids, self.positions, self.req_pool_indices, self.seq_lens,
                            torch.tensor(self.prefix_lens), torch.tensor(self.extend_lens), self.out_cache_loc,
                            self.req_to_token_pool, self.token_to_kv_pool)


def prefill(model, req, req_to_token_pool, kv_pool):
    ids = torch.tensor(req.origin_input_ids)
    n = len(ids)
    loc = kv_pool.alloc(n)
    req_to_token_pool.req_to_token[req.req_pool_idx, :n] = loc
    fb = ForwardBatch(ids, torch.arange(n), torch.tensor([req.req_pool_idx]), torch.tensor([n]),
                      torch.tensor([0]), torch.tensor([n]), loc, req_to_token_pool, kv_pool)
    logits = model(fb)
    req.output_ids.append(int(logits[-1].argmax()))
    return loc


def main():
    config = ModelConfig()
    model = TinyLlama(config).eval()
    req_to_token_pool = ReqToTokenPool(4, 32)
    kv_pool = MHATokenToKVPool(128, config.num_attention_heads, config.head_dim)

    with torch.no_grad():
        # earlier requests on rows 0 and 1, finished and freed: their slot ids stay in the rows
        for row in (0, 1):
            old = Req(f"old{row}", torch.randint(1, config.vocab_size, (14,)).tolist())
            old.req_pool_idx = row
            kv_pool.free(prefill(model, old, req_to_token_pool, kv_pool))

        reqs = [Req("a", [5, 9, 13, 2, 7, 30]), Req("b", [11, 4, 25, 8, 16, 3, 40, 21])]
        for i, r in enumerate(reqs):
            r.req_pool_idx = i
            prefill(model, r, req_to_token_pool, kv_pool)

        batch = ScheduleBatch(reqs, req_to_token_pool, kv_pool, enable_overlap=True)
        # prepare_for_decode: the step computes each request's last sampled token; seq_lens counts it
        batch.input_ids = torch.tensor([r.output_ids[-1] for r in reqs])
        batch.seq_lens = torch.tensor([len(r.origin_input_ids) + 1 for r in reqs])
        # overlap: request "a"'s sampled token is still pending (output_ids trails by one); request "b"'s
        # landed during an iteration that ran prefill instead of decode (lag drained)
        pending_a = reqs[0].output_ids.pop()

        batch.convert_decode_to_extend()
        fb = batch.get_forward_batch()
        logits = model(fb)
        next_tokens = logits.argmax(-1)
        reqs[0].output_ids.append(pending_a)

    print("prefix_lens", batch.prefix_lens, "positions", fb.positions.tolist())
    print("next tokens", next_tokens.tolist())
    print("logits[b][:6]", [round(x, 4) for x in logits[1, :6].tolist()])


if __name__ == "__main__":
    main()
