# Citation: MoonshotAI/MoBA @61e456b (moba/moba_efficient.py: calc_chunks, MixedAttention.forward, moba_attn_varlen;
#   moba/moba_naive.py: moba_attn_varlen_naive; moba/config.py: MoBAConfig; moba/wrapper.py: moba_layer's GQA
#   repeat_interleave; tests/test_moba_attn.py: the efficient path checked against the naive one), with the
#   unpad / pad glue of Dao-AILab/flash-attention flash_attn/bert_padding.py (unpad_input, pad_input).
#   flash-attn is CUDA only, so `_flash_attn_varlen_forward` is a CPU stand-in with its signature and return tuple
#   (out at [4], softmax_lse laid (H, total_q) at [5]); einops' rearrange is written as permute / reshape.
# Masking: MoBA (Mixture of Block Attention) is block-sparse causal attention. Each sequence's keys are cut into
#   chunks of moba_chunk_size; a query always attends causally inside its own chunk, and to the top (moba_topk - 1)
#   earlier, complete chunks of its own sequence, ranked by q . mean(chunk keys). The efficient path runs this as two
#   varlen attentions (per-chunk causal self attention on cu_chunk; each selected (chunk, head) pair as its own
#   non-causal varlen segment) merged by their log-sum-exp. A left-padded batch (attention_mask 1 = real token) is
#   unpadded to one packed sequence with cu_seqlens before the call and padded back after, so no padding key is a
#   chunk member, the chunks start at each row's first real token, no padding query is computed, and sequences never
#   see each other's chunks.
# Self-check: the packed efficient output equals MoBA's own dense naive reference on the same cu_seqlens, and a
#   double loop written here (each sequence alone, no padding, chunk selection and causal rule spelled out per query);
#   padding rows of the output are zero and changing the padding tokens' embeddings changes no real output.
import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MoBAConfig:
    moba_chunk_size: int
    moba_topk: int


# ---- flash_attn/bert_padding.py ----------------------------------------------------------------------------------


def index_first_axis(x, indices):
    return x.reshape(-1, *x.shape[2:])[indices]


def unpad_input(hidden_states, attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return index_first_axis(hidden_states, indices), indices, cu_seqlens, max_seqlen_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    output = torch.zeros((batch * seqlen), *hidden_states.shape[1:], device=hidden_states.device, dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.view(batch, seqlen, *hidden_states.shape[1:])


# ---- CPU stand-in for flash_attn.flash_attn_interface ----------------------------------------------------------


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal, dropout_p=0.0):
    """q [total_q, H, D], k / v [total_k, H, D]; returns flash-attn's 8-tuple, out at [4], lse (H, total_q) at [5]."""
    total_q, num_head, head_dim = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((num_head, total_q), -float("inf"), dtype=torch.float32, device=q.device)
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe = cu_seqlens_q[b].item(), cu_seqlens_q[b + 1].item()
        ks, ke = cu_seqlens_k[b].item(), cu_seqlens_k[b + 1].item()
        if qe == qs:
            continue
        s = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), k[ks:ke].float()) * softmax_scale
        if causal:
            # flash-attn >= 2.1 aligns the causal mask to the bottom right corner
            lq, lk = qe - qs, ke - ks
            keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
            s = s.masked_fill(~keep, -float("inf"))
        seg_lse = torch.logsumexp(s, dim=-1)  # [ H, lq ]
        p = torch.exp(s - seg_lse.unsqueeze(-1))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", p, v[ks:ke].float()).to(q.dtype)
        lse[:, qs:qe] = seg_lse
    return q, k, v, out, out, lse, None, None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    softmax_scale = q.shape[-1] ** (-0.5)
    return _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale, causal)[4]


# ---- moba/moba_efficient.py -------------------------------------------------------------------------------------


@lru_cache(maxsize=16)
def calc_chunks(cu_seqlen, moba_chunk_size):
    """calc chunks that needs moba attention"""

    # batch_sizes[batch_idx] = batch size ( seqlen ) of batch idx
    batch_sizes = cu_seqlen[1:] - cu_seqlen[:-1]
    # batch_num_chunk[batch_idx] = how many chunk in batch idx
    batch_num_chunk = (batch_sizes + (moba_chunk_size - 1)) // moba_chunk_size
    # cu_num_chunk[batch_idx] = first chunk id of this batch
    cu_num_chunk = torch.ones(batch_num_chunk.numel() + 1, device=cu_seqlen.device, dtype=batch_num_chunk.dtype)
    cu_num_chunk[1:] = batch_num_chunk.cumsum(dim=0)
    # total chunk ( for all batch )
    num_chunk = cu_num_chunk[-1]
    # chunk_sizes[chunk_idx] = chunk_size of chunk idx
    chunk_sizes = torch.full((num_chunk + 1,), moba_chunk_size, dtype=torch.int32, device=cu_seqlen.device)
    chunk_sizes[0] = 0  # for calc cu chunk
    batch_last_chunk_size = batch_sizes - (batch_num_chunk - 1) * moba_chunk_size
    chunk_sizes[cu_num_chunk[1:]] = batch_last_chunk_size
    # cu_chunk[chunk_idx] = the start chunk offset of chunk idx
    cu_chunk = chunk_sizes.cumsum(dim=-1, dtype=torch.int32)
    # chunk_to_batch[chunk_idx] = batch idx of the chunk idx
    chunk_to_batch = torch.zeros((num_chunk,), dtype=torch.int32, device=cu_seqlen.device)
    chunk_to_batch[cu_num_chunk[1:-1]] = 1
    chunk_to_batch = chunk_to_batch.cumsum(dim=0, dtype=torch.int32)

    """ filter chunks that need moba attn """

    # filter chunks ( remove last chunk of each batch )
    # filtered_chunk_indices: chunk index list that excludes the last chunk of each batch
    chunk_to_remove = cu_num_chunk[1:] - 1
    chunk_to_remain = torch.ones((num_chunk,), dtype=torch.bool, device=cu_seqlen.device)
    chunk_to_remain[chunk_to_remove] = False
    filtered_chunk_indices = chunk_to_remain.nonzero(as_tuple=True)[0]
    num_filtered_chunk = len(filtered_chunk_indices)

    return (
        cu_chunk,
        filtered_chunk_indices,
        num_filtered_chunk,
        chunk_to_batch,
    )


class MixedAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, self_attn_cu_seqlen, moba_q, moba_kv, moba_cu_seqlen_q, moba_cu_seqlen_kv,
                max_seqlen, moba_chunk_size, moba_q_sh_indices):
        ctx.max_seqlen = max_seqlen
        ctx.moba_chunk_size = moba_chunk_size
        ctx.softmax_scale = softmax_scale = q.shape[-1] ** (-0.5)

        # self attn
        _, _, _, _, self_attn_out_sh, self_attn_lse_hs, _, _ = _flash_attn_varlen_forward(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=self_attn_cu_seqlen,
            cu_seqlens_k=self_attn_cu_seqlen,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            softmax_scale=softmax_scale,
            causal=True,
            dropout_p=0.0,
        )

        # moba attn
        _, _, _, _, moba_attn_out, moba_attn_lse_hs, _, _ = _flash_attn_varlen_forward(
            q=moba_q,
            k=moba_kv[:, 0],
            v=moba_kv[:, 1],
            cu_seqlens_q=moba_cu_seqlen_q,
            cu_seqlens_k=moba_cu_seqlen_kv,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=moba_chunk_size,
            softmax_scale=softmax_scale,
            causal=False,
            dropout_p=0.0,
        )

        # convert lse shape hs -> sh ( follow the legacy mix attn logic )
        self_attn_lse_sh = self_attn_lse_hs.t().contiguous()
        moba_attn_lse = moba_attn_lse_hs.t().contiguous()

        # output buffer [S, H, D], same shape as q
        output = torch.zeros((q.shape[0], q.shape[1], q.shape[2]), device=q.device, dtype=torch.float32)

        # flatten vS & H for index ops
        output_2d = output.view(-1, q.shape[2])

        # calc mixed_lse
        # minus max lse to avoid exp explosion
        max_lse_1d = self_attn_lse_sh.view(-1)
        max_lse_1d = max_lse_1d.index_reduce(0, moba_q_sh_indices, moba_attn_lse.view(-1), "amax")
        self_attn_lse_sh = self_attn_lse_sh - max_lse_1d.view_as(self_attn_lse_sh)
        moba_attn_lse = (
            moba_attn_lse.view(-1).sub(max_lse_1d.index_select(0, moba_q_sh_indices)).reshape_as(moba_attn_lse)
        )

        mixed_attn_se_sh = self_attn_lse_sh.exp()
        moba_attn_se = moba_attn_lse.exp()

        mixed_attn_se_sh.view(-1).index_add_(0, moba_q_sh_indices, moba_attn_se.view(-1))
        mixed_attn_lse_sh = mixed_attn_se_sh.log()

        # add attn output
        factor = (self_attn_lse_sh - mixed_attn_lse_sh).exp()  # [ vS, H ]
        self_attn_out_sh = self_attn_out_sh * factor.unsqueeze(-1)
        output_2d += self_attn_out_sh.reshape_as(output_2d)

        # add moba output
        mixed_attn_lse = mixed_attn_lse_sh.view(-1).index_select(0, moba_q_sh_indices).view_as(moba_attn_lse)
        factor = (moba_attn_lse - mixed_attn_lse).exp()  # [ vS, H ]
        moba_attn_out = moba_attn_out * factor.unsqueeze(-1)
        raw_attn_out = moba_attn_out.view(-1, moba_attn_out.shape[-1])
        output_2d.index_add_(0, moba_q_sh_indices, raw_attn_out)
        output = output.to(q.dtype)
        # add back max lse
        mixed_attn_lse_sh = mixed_attn_lse_sh + max_lse_1d.view_as(mixed_attn_se_sh)
        return output


def moba_attn_varlen(q, k, v, cu_seqlens, max_seqlen, moba_chunk_size, moba_topk):
    """q, k, v: [seqlen, head, head_dim] packed; cu_seqlens as in flash attn."""
    kv = torch.stack((k, v), dim=1)

    """ some basic variables """
    # qkv shape = [ S, H, D ]
    seqlen, num_head, head_dim = q.shape

    """ prepare chunk meta """
    (cu_chunk, filtered_chunk_indices, num_filtered_chunk, chunk_to_batch) = calc_chunks(cu_seqlens, moba_chunk_size)

    # we will adjust selective topk to moba_topk - 1, as the last chunk is always chosen
    moba_topk = min(moba_topk - 1, num_filtered_chunk)
    need_moba_attn = moba_topk > 0

    # corner case: if no moba attn needed, just return self attn
    if not need_moba_attn:
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)

    self_attn_cu_seqlen = cu_chunk

    # filtered_kv is a dense matrix that only contains filtered chunk of kv
    filtered_kv_indices = torch.arange(0, moba_chunk_size, dtype=torch.int32, device=q.device)[None, :].repeat(
        num_filtered_chunk, 1
    )
    filtered_kv_indices += cu_chunk[filtered_chunk_indices][:, None]
    filtered_kv = kv.index_select(0, filtered_kv_indices.view(-1))

    """ calc key_gate_weight and gate """

    # key_gate_weight [ F_N_CHUNK, HEAD, HEAD_DIM ]
    key_gate_weight = (
        filtered_kv[:, 0].view(num_filtered_chunk, moba_chunk_size, num_head, head_dim).mean(dim=1).float()
    )
    q = q.type(torch.float32)  # float logit on the fly for better gate logit perception
    key_gate_weight = key_gate_weight.type(torch.float32)  # float logit for better gate logit perception
    gate = torch.einsum("nhd,shd->nhs", key_gate_weight, q)  # gate [ F_N_CHUNK, HEAD, SEQ ]
    key_gate_weight = key_gate_weight.type_as(k)
    q = q.type_as(k)

    # pose process gate, masking unchosen batch and apply causal mask to current chunk
    gate_seq_idx = torch.arange(0, seqlen, device=q.device, dtype=torch.int32)[None, :].repeat(num_filtered_chunk, 1)
    chunk_end = cu_chunk[filtered_chunk_indices + 1]
    batch_end = cu_seqlens[chunk_to_batch[filtered_chunk_indices] + 1]
    gate_chunk_end_mask = gate_seq_idx < chunk_end[:, None]
    gate_batch_end_mask = gate_seq_idx >= batch_end[:, None]
    gate_inf_mask = gate_chunk_end_mask | gate_batch_end_mask
    gate.masked_fill_(gate_inf_mask.unsqueeze(1), -float("inf"))

    """ find moba q that needs moba attn """
    # find topk chunks
    # gate_mask [ N_CHUNK, HEAD, SEQ ], true indicates that needs attention
    _, gate_top_k_idx = torch.topk(gate, k=moba_topk, dim=0, largest=True, sorted=False)
    # apply causal mask
    gate_mask = torch.logical_not(gate.isinf())
    # select topk chunks
    gate_idx_mask = torch.zeros(gate_mask.shape, dtype=torch.bool, device=q.device)
    gate_idx_mask = gate_idx_mask.scatter_(dim=0, index=gate_top_k_idx, value=True)
    gate_mask = torch.logical_and(gate_mask, gate_idx_mask)

    # varlen trick: combining all q index that needs moba attn
    # the result will be like [ C0H0 ][ C0H1 ][ C0H2 ][ ... ][ CnHm ]
    moba_q_indices = gate_mask.reshape(gate_mask.shape[0], -1).nonzero(as_tuple=True)[-1]  # [ HS indices ] * N
    # moba_seqlen_q indicates that how many q chunks are selected for each kv chunk - head
    moba_seqlen_q = gate_mask.sum(dim=-1).flatten()
    # select all q that needs moba attn based on the moba_q_indices
    # rearrange(q, "s h d -> ( h s ) d")
    moba_q = q.permute(1, 0, 2).reshape(num_head * seqlen, head_dim).index_select(0, moba_q_indices)
    moba_q = moba_q.unsqueeze(1)
    # moba_q_sh_indices represents the position in the origin q tensor of each q token inside moba_q
    moba_q_sh_indices = moba_q_indices % seqlen * num_head + moba_q_indices // seqlen

    """ prepare moba kv """
    # Since moba_q is organized as HS * N, we need to reorganize kv to adapt to q

    # cut off zero experts
    q_zero_mask = moba_seqlen_q == 0
    valid_expert_mask = ~q_zero_mask
    zero_expert_count = q_zero_mask.sum()
    # only keep the kv that has q select > 0
    if zero_expert_count > 0:
        moba_seqlen_q = moba_seqlen_q[valid_expert_mask]
    # moba cu_seqlen for flash attn
    moba_cu_seqlen_q = torch.cat(
        (torch.tensor([0], device=q.device, dtype=moba_seqlen_q.dtype), moba_seqlen_q.cumsum(dim=0)), dim=0
    ).to(torch.int32)
    moba_kv = filtered_kv.permute(2, 0, 1, 3)  # rearrange(filtered_kv, "s x h d -> h s x d")
    moba_kv = moba_kv.split(moba_chunk_size, dim=1)
    moba_kv = torch.cat(moba_kv, dim=0)
    if zero_expert_count > 0:
        assert valid_expert_mask.sum() == moba_kv.shape[0] - zero_expert_count
        moba_kv = moba_kv[valid_expert_mask]  # cut off zero Q expert from kv , or the grad may be nan
    moba_kv = moba_kv.flatten(start_dim=0, end_dim=1).unsqueeze(2)
    moba_cu_seqlen_kv = (
        torch.arange(0, num_filtered_chunk * num_head + 1 - zero_expert_count, dtype=torch.int32, device=q.device)
        * moba_chunk_size
    )

    # Shape check
    assert moba_cu_seqlen_kv.shape == moba_cu_seqlen_q.shape, (
        f"moba_cu_seqlen_kv.shape != moba_cu_seqlen_q.shape {moba_cu_seqlen_kv.shape} != {moba_cu_seqlen_q.shape}"
    )

    return MixedAttention.apply(q, k, v, self_attn_cu_seqlen, moba_q, moba_kv, moba_cu_seqlen_q, moba_cu_seqlen_kv,
                                max_seqlen, moba_chunk_size, moba_q_sh_indices)


# ---- moba/moba_naive.py -----------------------------------------------------------------------------------------


def moba_attn_varlen_naive(q, k, v, cu_seqlens, max_seqlen, moba_chunk_size, moba_topk):
    """Implement the moba brute-force setting for reference; qkv [seqlen, head, head_dim]."""
    # qkv shape = [ S, H, D ]
    batch = cu_seqlens.numel() - 1
    softmax_scale = q.shape[-1] ** (-0.5)

    o = torch.zeros_like(q)
    for batch_idx in range(batch):
        batch_start = cu_seqlens[batch_idx].item()
        batch_end = cu_seqlens[batch_idx + 1].item()
        # get qkv of this batch
        q_ = q[batch_start:batch_end]
        k_ = k[batch_start:batch_end]
        v_ = v[batch_start:batch_end]
        o_ = o[batch_start:batch_end]
        # calc key gate weight
        key_gate_weight = []
        batch_size = batch_end - batch_start
        num_block = math.ceil(batch_size / moba_chunk_size)
        for block_idx in range(0, num_block):
            block_start = block_idx * moba_chunk_size
            block_end = min(batch_size, block_start + moba_chunk_size)
            key_gate_weight.append(k_[block_start:block_end].mean(dim=0, keepdim=True))
        key_gate_weight = torch.cat(key_gate_weight, dim=0)  # [ N, H, D ]
        # calc & mask gate
        # use fp32 to avoid precision issue in bf16
        q_ = q_.type(torch.float32)
        key_gate_weight = key_gate_weight.type(torch.float32)
        gate = torch.einsum("shd,nhd->hsn", q_, key_gate_weight)  # [ H, S, N ]
        key_gate_weight = key_gate_weight.type_as(k)
        q_ = q_.type_as(k)
        for i in range(num_block):
            # select the future Qs that can attend to KV chunk i
            gate[:, : (i + 1) * moba_chunk_size, i] = float("-inf")
            gate[:, i * moba_chunk_size : (i + 1) * moba_chunk_size, i] = float("inf")
        # gate_top_k_idx = gate_top_k_val = [ H S K ]
        gate_top_k_val, gate_top_k_idx = torch.topk(
            gate, k=min(moba_topk, num_block), dim=-1, largest=True, sorted=False
        )
        gate_top_k_val, _ = gate_top_k_val.min(dim=-1)  # [ H, S ]
        need_attend = gate >= gate_top_k_val.unsqueeze(-1)
        # add gate_idx_mask in case of there is cornercases of same topk val been selected
        gate_idx_mask = torch.zeros(need_attend.shape, dtype=torch.bool, device=q.device)
        gate_idx_mask = gate_idx_mask.scatter_(dim=-1, index=gate_top_k_idx, value=True)
        need_attend = torch.logical_and(need_attend, gate_idx_mask)
        gate[need_attend] = 0
        gate[~need_attend] = -float("inf")
        gate = gate.repeat_interleave(moba_chunk_size, dim=-1)[:, :, :batch_size]  # [ H, S, S ]
        gate.masked_fill_(torch.ones_like(gate, dtype=torch.bool).tril().logical_not(), -float("inf"))

        # calc qk = qk^t
        q_ = q_.type(torch.float32)
        k_ = k_.type(torch.float32)
        v_ = v_.type(torch.float32)
        qk = torch.einsum("xhd,yhd->hxy", q_, k_)
        # mask
        qk += gate
        qk *= softmax_scale
        # calc o
        p = qk.softmax(dim=-1)
        o_ += torch.einsum("hxy,yhd->xhd", p, v_)
        o = o.type_as(q)

    return o


# ---- a MoBA attention layer over a padded batch (moba/wrapper.py's prefill path, unpadded first) ---------------


class MoBASelfAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads, moba_config, moba_impl=moba_attn_varlen):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.is_causal = True
        self.moba_config = moba_config
        self.moba_impl = moba_impl
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        batch, seqlen, _ = hidden_states.shape
        # varlen: only the real tokens of each row go in, one packed sequence with cu_seqlens
        hidden_unpad, indices, cu_seqlens, max_seqlen = unpad_input(hidden_states, attention_mask)
        query = self.q_proj(hidden_unpad).view(-1, self.num_heads, self.head_dim)
        key = self.k_proj(hidden_unpad).view(-1, self.num_kv_heads, self.head_dim)
        value = self.v_proj(hidden_unpad).view(-1, self.num_kv_heads, self.head_dim)
        kv_replicas = self.num_heads // self.num_kv_heads
        key = torch.repeat_interleave(key, kv_replicas, dim=1)
        value = torch.repeat_interleave(value, kv_replicas, dim=1)
        out = self.moba_impl(
            q=query,
            k=key,
            v=value,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            moba_chunk_size=self.moba_config.moba_chunk_size,
            moba_topk=self.moba_config.moba_topk,
        )
        out = self.o_proj(out.reshape(out.shape[0], -1))
        return pad_input(out, indices, batch, seqlen)


# ---- reference written here: each sequence alone, no padding, selection spelled out per query ----------------


def moba_reference_one_sequence(layer, x):
    """x [L, hidden] (real tokens only) -> [L, hidden], by a loop over heads and queries."""
    cfg = layer.moba_config
    L = x.shape[0]
    H, D = layer.num_heads, layer.head_dim
    rep = H // layer.num_kv_heads
    q = layer.q_proj(x).view(L, H, D)
    k = layer.k_proj(x).view(L, layer.num_kv_heads, D)
    v = layer.v_proj(x).view(L, layer.num_kv_heads, D)
    chunk = cfg.moba_chunk_size
    out = torch.zeros(L, H, D)
    for h in range(H):
        kh, vh = k[:, h // rep], v[:, h // rep]
        for i in range(L):
            own = i // chunk
            # earlier chunks are all complete (only the last chunk of a sequence can be short)
            scores = [(torch.dot(q[i, h], kh[c * chunk:(c + 1) * chunk].mean(0)).item(), c) for c in range(own)]
            picked = {c for _, c in sorted(scores, reverse=True)[: cfg.moba_topk - 1]}
            keys = [j for j in range(i + 1) if j // chunk == own or j // chunk in picked]
            logits = torch.stack([torch.dot(q[i, h], kh[j]) for j in keys]) / math.sqrt(D)
            p = torch.softmax(logits, dim=0)
            out[i, h] = sum(p[n] * vh[j] for n, j in enumerate(keys))
    return layer.o_proj(out.reshape(L, H * D))


def main():
    torch.manual_seed(0)
    hidden_size, num_heads, num_kv_heads = 32, 4, 2
    moba_config = MoBAConfig(moba_chunk_size=4, moba_topk=3)
    layer = MoBASelfAttention(hidden_size, num_heads, num_kv_heads, moba_config).eval()

    # a left-padded batch (prompts), attention_mask 1 = real token
    lengths = [19, 11, 6, 14]
    batch, seqlen = len(lengths), max(lengths)
    attention_mask = torch.zeros(batch, seqlen, dtype=torch.long)
    for b, n in enumerate(lengths):
        attention_mask[b, seqlen - n:] = 1
    embed = nn.Embedding(50, hidden_size, padding_idx=0)
    input_ids = torch.randint(1, 50, (batch, seqlen)) * attention_mask
    hidden_states = embed(input_ids)

    with torch.no_grad():
        out = layer(hidden_states, attention_mask)

        # MoBA's own check (tests/test_moba_attn.py): the efficient path against the dense naive one
        layer_naive = MoBASelfAttention(hidden_size, num_heads, num_kv_heads, moba_config,
                                        moba_impl=moba_attn_varlen_naive)
        layer_naive.load_state_dict(layer.state_dict())
        out_naive = layer_naive(hidden_states, attention_mask)
        diff_naive = (out - out_naive).abs().max().item()
        assert diff_naive < 1e-5, diff_naive

        # each sequence alone, unpadded, against the loop
        worst = 0.0
        for b, n in enumerate(lengths):
            ref = moba_reference_one_sequence(layer, hidden_states[b, seqlen - n:])
            worst = max(worst, (out[b, seqlen - n:] - ref).abs().max().item())
            assert torch.all(out[b, : seqlen - n] == 0)
        assert worst < 1e-5, worst

        # the padding tokens' content reaches no real output
        noisy = hidden_states + torch.randn_like(hidden_states) * (1 - attention_mask)[..., None]
        out_noisy = layer(noisy, attention_mask)
        assert torch.allclose(out_noisy, out, atol=1e-6)

    print(f"lengths {lengths}, chunk {moba_config.moba_chunk_size}, topk {moba_config.moba_topk}")
    print(f"max |efficient - naive| = {diff_naive:.2e}, max |efficient - per-sequence loop| = {worst:.2e}")


if __name__ == "__main__":
    main()
