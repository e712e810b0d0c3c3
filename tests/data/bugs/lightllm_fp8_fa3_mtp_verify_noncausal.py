"""LightLLM FA3 FP8 decode attention in MTP-verify mode: non-causal, expanded seqlens.

Citation: ModelTC/LightLLM#1338 (squash-merged as 2d5c0570f, "Qwen3.5 MTP
speculative decoding"); the change is commit c071ffd82 ("fix(fa3/fp8): narrow
decode verify to b_att_seq_len + causal (#4)") on the PR branch
(refs/pull/1330/head). Read in the upstream git history
(lightllm/common/basemodel/attention/fa3/fp8.py); main before #1338 had the
buggy arguments.

Bug: with MTP speculative decoding (mtp_step > 0), a verify decode step runs
mtp_size = mtp_step + 1 query tokens per request. `Fa3DecodeAttState.init_state`
narrows the batch to one row per real request (`b_att_seq_len`, `page_table`,
`cu_seqlens_q`), and the bf16 path calls `flash_attn_with_kvcache(...,
cache_seqlens=self.b_att_seq_len, causal=True)`. The FP8 subclass
`Fp8Fa3DecodeAttState._fp8_decode_att` instead passed
`cache_seqlens=self.infer_state.b_seq_len` (the expanded per-token tensor, one
entry per draft token) and `causal=False`. So each request reads the wrong
number of keys from its page-table row, and every draft token attends to the
draft tokens after it.

Fix: `cache_seqlens=self.b_att_seq_len` and `causal=True`.

This program: LightLLM's state classes and request/token tables in plain torch.
`flash_attn_with_kvcache` is replaced by a torch port of the FA3 varlen-paged
semantics (batch b: queries cu_seqlens_q[b]:cu_seqlens_q[b+1], keys
page_table[b, :cache_seqlens[b]] with page size 1, causal aligned bottom-right),
calling `F.scaled_dot_product_attention`. The FP8 quantisation
(`scaled_fp8_quant`, descales) is left out: CPU torch, and it does not touch
which keys are attended. mtp_step = 2, two requests of 7 and 10 tokens.
"""
import dataclasses
import sys
import types

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

START_ARGS = types.SimpleNamespace(mtp_step=2)


def get_env_start_args():
    return START_ARGS


def gen_cumsum_pad0_tensor(b_q_seq_len, b_kv_seq_len):
    return (
        F.pad(torch.cumsum(b_q_seq_len, 0), (1, 0)),
        F.pad(torch.cumsum(b_kv_seq_len, 0), (1, 0)),
    )


def page_table_copy(page_table, req_to_token_indexs, b_req_idx):
    page_table.copy_(req_to_token_indexs[b_req_idx, : page_table.shape[1]])


def flash_attn_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                            cu_seqlens_k_new=None, max_seqlen_q=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, **kwargs):
    """Torch port of sgl_kernel FA3 flash_attn_with_kvcache (varlen q, paged KV, page size 1)."""
    out = torch.empty_like(q)
    batch = cu_seqlens_q.numel() - 1
    for b in range(batch):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        kv_len = int(cache_seqlens[b])
        slots = page_table[b, :kv_len].long()
        k = k_cache[slots, 0]  # (kv_len, H_kv, D)
        v = v_cache[slots, 0]
        q_len = qe - qs
        groups = q.shape[1] // k.shape[1]
        qh = q[qs:qe].transpose(0, 1)
        kh = k.transpose(0, 1).repeat_interleave(groups, 0)
        vh = v.transpose(0, 1).repeat_interleave(groups, 0)
        if causal:
            mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        else:
            mask = None
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=softmax_scale)
        out[qs:qe] = o.transpose(0, 1)
    return out


@dataclasses.dataclass
class BaseDecodeAttState:
    backend: object = None
    infer_state: object = None


@dataclasses.dataclass
class Fa3DecodeAttState(BaseDecodeAttState):
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_k: torch.Tensor = None
    page_table: torch.Tensor = None
    b_att_seq_len: torch.Tensor = None
    decode_max_q_seq_len: int = None

    def init_state(self):
        args_mtp_step = get_env_start_args().mtp_step
        is_mtp_verify_decode = args_mtp_step > 0 and self.infer_state.b_num_accepted_tokens is not None

        if is_mtp_verify_decode:
            mtp_size = args_mtp_step + 1
            b_q_seq_len = torch.full(
                (self.infer_state.b_seq_len.shape[0] // mtp_size,), fill_value=mtp_size, dtype=torch.int32
            )
            b_kv_seq_len = self.infer_state.b_seq_len[mtp_size - 1 :: mtp_size]
            b1_cu_q_seq_len, b1_cu_kv_seq_len = gen_cumsum_pad0_tensor(b_q_seq_len, b_kv_seq_len)
            self.cu_seqlens_q = b1_cu_q_seq_len.int()
            self.cu_seqlens_k = b1_cu_kv_seq_len.int()
        else:
            self.cu_seqlens_q = self.infer_state.b1_cu_q_seq_len.int()
            self.cu_seqlens_k = self.infer_state.b1_cu_kv_seq_len.int()

        mtp_size = args_mtp_step + 1 if is_mtp_verify_decode else 1
        att_batch_size = self.infer_state.batch_size // mtp_size
        model = self.backend.model
        self.page_table = torch.empty((att_batch_size, self.infer_state.max_kv_seq_len), dtype=torch.int32)

        if is_mtp_verify_decode:
            page_table_copy(
                page_table=self.page_table[:, : self.infer_state.max_kv_seq_len],
                req_to_token_indexs=model.req_manager.req_to_token_indexs,
                b_req_idx=self.infer_state.b_req_idx[args_mtp_step :: (args_mtp_step + 1)],
            )
            self.b_att_seq_len = self.infer_state.b_seq_len[args_mtp_step :: (args_mtp_step + 1)].contiguous()
            self.decode_max_q_seq_len = args_mtp_step + 1
        else:
            page_table_copy(
                page_table=self.page_table[:, : self.infer_state.max_kv_seq_len],
                req_to_token_indexs=model.req_manager.req_to_token_indexs,
                b_req_idx=self.infer_state.b_req_idx,
            )
            self.b_att_seq_len = self.infer_state.b_seq_len
            self.decode_max_q_seq_len = 1


@dataclasses.dataclass
class Fp8Fa3DecodeAttState(Fa3DecodeAttState):
    def decode_att(self, q, k, v):
        return self._fp8_decode_att(q=q, k=k, v=v)

    def _fp8_decode_att(self, q, k, v):
        k_head_num = k.shape[1]
        k_head_dim = k.shape[2]
        cache_k = k.view(-1, 1, k_head_num, k_head_dim)
        cache_v = v.view(-1, 1, k_head_num, k_head_dim)
        q_head_num = q.shape[1]
        o = flash_attn_with_kvcache(
            q=q.reshape(-1, q_head_num, k_head_dim),
            k_cache=cache_k,
            v_cache=cache_v,
            page_table=self.page_table,
            cache_seqlens=self.b_att_seq_len if FIXED else self.infer_state.b_seq_len,
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k_new=self.cu_seqlens_k,
            max_seqlen_q=self.decode_max_q_seq_len,
            causal=True if FIXED else False,
            window_size=(-1, -1),
            softcap=0.0,
            return_softmax_lse=False,
        )
        return o


def main():
    torch.manual_seed(0)
    head_num, kv_head_num, head_dim = 4, 2, 16
    mtp_step = START_ARGS.mtp_step
    mtp_size = mtp_step + 1

    # Two real requests; the last mtp_size tokens of each are the main token + 2 drafts.
    req_lens = [7, 10]
    max_len = 12
    total_tokens = 32
    # Token slots handed out by the mem manager (non-contiguous on purpose).
    perm = torch.randperm(total_tokens).int()
    req_to_token_indexs = torch.zeros(4, max_len, dtype=torch.int32)
    req_to_token_indexs[0, : req_lens[0]] = perm[: req_lens[0]]
    req_to_token_indexs[1, : req_lens[1]] = perm[req_lens[0] : req_lens[0] + req_lens[1]]
    kv_buffer_k = torch.randn(total_tokens, kv_head_num, head_dim)
    kv_buffer_v = torch.randn(total_tokens, kv_head_num, head_dim)

    # Expanded verify batch: one row per (request, verify token).
    b_req_idx = torch.tensor([0] * mtp_size + [1] * mtp_size, dtype=torch.int32)
    b_seq_len = torch.tensor(
        [req_lens[0] - mtp_step + i for i in range(mtp_size)] + [req_lens[1] - mtp_step + i for i in range(mtp_size)],
        dtype=torch.int32,
    )
    infer_state = types.SimpleNamespace(
        b_seq_len=b_seq_len,
        b_req_idx=b_req_idx,
        b_num_accepted_tokens=torch.ones(len(req_lens), dtype=torch.int32),
        batch_size=b_seq_len.shape[0],
        max_kv_seq_len=int(b_seq_len.max()),
    )
    model = types.SimpleNamespace(req_manager=types.SimpleNamespace(req_to_token_indexs=req_to_token_indexs))
    backend = types.SimpleNamespace(model=model)

    state = Fp8Fa3DecodeAttState(backend=backend, infer_state=infer_state)
    state.init_state()

    q = torch.randn(infer_state.batch_size, head_num, head_dim)
    o = state.decode_att(q, kv_buffer_k, kv_buffer_v)
    print("fixed" if FIXED else "buggy", "verify attention checksum:", round(o.sum().item(), 4))


if __name__ == "__main__":
    main()
