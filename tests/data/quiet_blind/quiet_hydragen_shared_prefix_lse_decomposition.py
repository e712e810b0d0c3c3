# Hydragen (shared-prefix attention decomposition + inter-sequence batching), ported from
# ScalingIntelligence/hydragen @1ea2255db0778f5cf47a4f72a535dc77a8b6b7bd:
#   hydragen/attention.py  (combine_lse_torch, hydragen_attention, hydragen_attention_nopad)
#   hydragen/flash.py      (flash_attention, flash_attention_varlen, flash_attention_seqlen)
#   tests/test_attention.py (the per-sequence reference: shared + unique KVs concatenated, one flash call)
# The flash-attn kernels (_flash_attn_forward / _flash_attn_varlen_forward) and hydragen's split-K xformers triton
# kernel are replaced by plain-torch stand-ins with the same arguments and the same (out, lse) layouts: the shared
# cache levels are attended without a mask (each group of sequences sees only its own shared prefix, through the
# batch fold or cu_seqlens), the unique suffix is right padded and bounded by seq_lens, and the partial results are
# merged with log-sum-exp. Decoding queries (qlen 1), fp32 on CPU; the combine uses the torch path.
import math

import torch
from torch import Tensor


def rearrange_q_shared(q, num_shared_seq):
    # "(num_shared_seq seq_per_shared) nq hq d -> num_shared_seq (seq_per_shared nq) hq d"
    b, nq, hq, d = q.shape
    return q.reshape(num_shared_seq, (b // num_shared_seq) * nq, hq, d)


def _expand_kv(k, hq):
    # flash-attn GQA: query head h reads kv head h // (hq // hk)
    hk = k.shape[-2]
    return k.repeat_interleave(hq // hk, dim=-2)


def _attend(q, k, v, keep, softmax_scale):
    # q [q, hq, d], k/v [k, hq, d], keep [q, k] bool (True = attend). returns out [q, hq, d], lse [hq, q]
    s = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale
    s = s.masked_fill(~keep[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("hqk,khd->qhd", p, v)
    return out, lse


# ---------------------------------------------------------------- hydragen/flash.py (plain-torch stand-ins)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False):
    """
    q: [b, seq q, qheads, dim]
    k: [b, seq k, kheads, dim]
    v: [b, seq k, kheads, dim]
    returns out [b, seq q, qheads, dim], softmax_lse [b, qheads, seq q]
    """
    softmax_scale = q.shape[-1] ** -0.5
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    k = _expand_kv(k, hq)
    v = _expand_kv(v, hq)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    if causal:
        keep = j <= i + (sk - sq)  # flash-attn >= 2.1: causal aligned to the bottom right
    else:
        keep = torch.ones(sq, sk, dtype=torch.bool)
    outs, lses = [], []
    for bi in range(b):
        o, l = _attend(q[bi], k[bi], v[bi], keep, softmax_scale)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    """
    q: [b*seq q, qheads, dim]
    k: [b*seq k, kheads, dim]
    v: [b*seq k, kheads, dim]
    returns out [total_q, qheads, dim], softmax_lse [b, qheads, max_seqlen_q]
    """
    softmax_scale = q.shape[-1] ** -0.5
    hq = q.shape[-2]
    k = _expand_kv(k, hq)
    v = _expand_kv(v, hq)
    nb = cu_seqlens_q.shape[0] - 1
    out = torch.zeros_like(q)
    lse = torch.full((nb, hq, max_seqlen_q), float("inf"))
    for bi in range(nb):
        qs, qe = cu_seqlens_q[bi].item(), cu_seqlens_q[bi + 1].item()
        ks, ke = cu_seqlens_k[bi].item(), cu_seqlens_k[bi + 1].item()
        lq, lk = qe - qs, ke - ks
        i = torch.arange(lq)[:, None]
        j = torch.arange(lk)[None, :]
        keep = (j <= i + (lk - lq)) if causal else torch.ones(lq, lk, dtype=torch.bool)
        o, l = _attend(q[qs:qe], k[ks:ke], v[ks:ke], keep, softmax_scale)
        out[qs:qe] = o
        lse[bi, :, :lq] = l
    return out, lse


def flash_attention_seqlen(raw_q: Tensor, raw_k: Tensor, raw_v: Tensor, seq_len=None):
    """
    q shape: [batch, qseq_len, qheads, dim]
    k shape: [batch, kseq_len, kheads, dim]
    v shape: [batch, kseq_len, kheads, dim]
    Stand-in for the split-K xformers kernel: key n of row z is read only while n < Seq_len[z]
    (USE_SEQ_LEN / BOUNDS_CHECKS_N). returns out [b, q, qheads, d], lse [b, q, qheads]
    """
    softmax_scale = raw_q.shape[-1] ** -0.5
    b, sq, hq, d = raw_q.shape
    sk = raw_k.shape[1]
    k = _expand_kv(raw_k, hq)
    v = _expand_kv(raw_v, hq)
    outs, lses = [], []
    for z in range(b):
        n_valid = sk if seq_len is None else int(seq_len[z])
        keep = (torch.arange(sk) < n_valid)[None, :].expand(sq, sk)
        o, l = _attend(raw_q[z], k[z], v[z], keep, softmax_scale)
        outs.append(o)
        lses.append(l.transpose(0, 1))  # "(b 1 kh) (q qh) -> b q (kh qh)"
    return torch.stack(outs), torch.stack(lses)


# ---------------------------------------------------------------- hydragen/attention.py


def combine_lse_torch(outs: list, lses: list):
    outs = torch.stack(outs)
    lses = torch.stack(lses)

    max_lse = lses.max(0).values

    adjust_factors = (lses - max_lse[None]).exp()

    new_denominator = adjust_factors.sum(0)

    aggregated = ((outs * adjust_factors.unsqueeze(-1)).sum(0)) / new_denominator.unsqueeze(-1)

    return aggregated.to(outs.dtype)


def combine_lse(outs, lses, enable_triton: bool = True):
    # the triton kernel is not available on CPU; combine_lse_torch is the same merge
    return combine_lse_torch(outs, lses)


def hydragen_attention(q, k, v, shared_ks, shared_vs, shared_cu_seq_lens, shared_max_seq_lens, use_varlens,
                       seq_lens=None):
    assert q.ndim == 4, f"{q.shape}"
    assert k.ndim == 4, f"{k.shape}"
    assert v.ndim == 4, f"{v.shape}"

    assert k.shape == v.shape
    assert len(shared_ks) == len(shared_vs) == len(shared_cu_seq_lens) == len(shared_max_seq_lens) == len(use_varlens)

    for shared_prompt_key, shared_prompt_value in zip(shared_ks, shared_vs):
        assert shared_prompt_key.shape == shared_prompt_value.shape

    b, nq, hq, d = q.shape

    outs, lses = [], []

    for sk, sv, scu, smax, use_varlen in zip(shared_ks, shared_vs, shared_cu_seq_lens, shared_max_seq_lens,
                                             use_varlens):
        # the varlen kernel seems to perform poorly at low batch sizes, so when we don't need the padding,
        # we use the non-varlen kernel.
        if not use_varlen:
            num_shared_sequences = sk.shape[0]

            batched_q = rearrange_q_shared(q, num_shared_sequences)

            shared_out, shared_lse = flash_attention(batched_q, sk, sv)

            shared_out = shared_out.view(b, nq, hq, d)
            if k.shape[1] == 0 and len(shared_ks) == 1:
                return shared_out

            # "num_shared_seq h (seq_per_shared nq) -> (num_shared_seq seq_per_shared) nq h"
            shared_lse = (
                shared_lse.reshape(num_shared_sequences, hq, b // num_shared_sequences, nq)
                .permute(0, 2, 3, 1)
                .reshape(b, nq, hq)
                .contiguous()
            )

        else:
            num_shared_sequences = scu.shape[0] - 1

            assert b % num_shared_sequences == 0, f"{b} {num_shared_sequences}"

            sequences_per_shared = b // num_shared_sequences
            queries_per_shared = sequences_per_shared * nq

            batched_q = q.reshape(b * nq, hq, d)  # "b nq hq d -> (b nq) hq d"

            qlens_to_cumsum = torch.cat(
                [
                    torch.zeros((1,), dtype=torch.int32, device=q.device),
                    torch.full((num_shared_sequences,), queries_per_shared, dtype=torch.int32, device=q.device),
                ]
            )

            q_culens = qlens_to_cumsum.cumsum(0, dtype=torch.int32)

            shared_out, shared_lse = flash_attention_varlen(
                batched_q,
                sk,
                sv,
                cu_seqlens_q=q_culens,
                cu_seqlens_k=scu,
                max_seqlen_q=queries_per_shared,
                max_seqlen_k=smax,
            )

            # "(ngroups groupsize nq) hq d -> (ngroups groupsize) nq hq d"
            shared_out = shared_out.reshape(b, nq, hq, d).contiguous()

            if k.shape[1] == 0 and len(shared_ks) == 1:
                return shared_out

            # "ngroups h (groupsize nq) -> (ngroups groupsize) nq h"
            shared_lse = (
                shared_lse.reshape(num_shared_sequences, hq, sequences_per_shared, nq)
                .permute(0, 2, 3, 1)
                .reshape(b, nq, hq)
                .contiguous()
            )

        outs.append(shared_out)
        lses.append(shared_lse)

    if seq_lens is None:
        unique_out, unique_lse = flash_attention(q, k, v, causal=True)
        unique_lse = unique_lse.transpose(1, 2).contiguous()  # "b h q -> b q h"
    else:
        unique_out, unique_lse = flash_attention_seqlen(q, k, v, seq_len=seq_lens)

    outs.append(unique_out)
    lses.append(unique_lse)

    aggregated = combine_lse(outs, lses, enable_triton=True)

    return aggregated


def hydragen_attention_nopad(q, k, v, shared_ks, shared_vs, seq_len=None):
    return hydragen_attention(
        q,
        k,
        v,
        shared_ks=shared_ks,
        shared_vs=shared_vs,
        shared_cu_seq_lens=[None] * len(shared_ks),
        shared_max_seq_lens=[None] * len(shared_ks),
        use_varlens=[False] * len(shared_ks),
        seq_lens=seq_len,
    )


# ---------------------------------------------------------------- tests/test_attention.py, with an own reference


def reference_attention(q, ks, vs):
    # one sequence, no mask at all: q [1, 1, hq, d], ks/vs [1, L, hk, d] hold exactly the keys it may read
    hq = q.shape[2]
    k = ks[0].repeat_interleave(hq // ks.shape[2], dim=1)
    v = vs[0].repeat_interleave(hq // vs.shape[2], dim=1)
    out = torch.empty_like(q[0])
    for h in range(hq):
        for i in range(q.shape[1]):
            scores = [float((q[0, i, h] * k[j, h]).sum()) / math.sqrt(q.shape[-1]) for j in range(k.shape[0])]
            m = max(scores)
            w = torch.tensor([math.exp(s - m) for s in scores], dtype=q.dtype)
            w = w / w.sum()
            out[i, h] = (w[:, None] * v[:, h]).sum(0)
    return out.unsqueeze(0)


def test_attention():
    torch.manual_seed(0)

    qheads_list = [4]
    kvheads_list = [1, 2, 4]
    dim = 16

    # each element is a test case: a list of seq lengths in each cache level; the last level is the
    # unique-per-sequence (right-padded) cache, the others are shared by groups of sequences.
    sizes_list = [
        [[1], [10]],
        [[3], [6, 6]],
        [[3], [6, 7]],
        [[5], [6, 2, 9, 1]],
        [[7, 7], [9, 10, 11, 4], [13, 2, 3, 4, 5, 6, 7, 12]],
        [[40], [1, 12, 25]],
    ]

    dtype = torch.float32
    worst = 0.0
    n_cases = 0

    for sizes in sizes_list:
        for qheads in qheads_list:
            for kvheads in kvheads_list:
                batch_sizes = [len(s) for s in sizes]
                final_batch_size = batch_sizes[-1]

                q = torch.randn(final_batch_size, 1, qheads, dim, dtype=dtype)

                shared_ks, shared_vs, shared_culens, max_seqlens, use_varlens = [], [], [], [], []

                for seq_lens in sizes[:-1]:
                    total_len = sum(seq_lens)
                    use_varlen = len(set(seq_lens)) > 1
                    use_varlens.append(use_varlen)

                    if use_varlen:
                        sk = torch.randn(total_len, kvheads, dim, dtype=dtype)
                        tensor_seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
                        cumsums = tensor_seq_lens.cumsum(0)
                        culens = torch.cat([torch.zeros((1,), dtype=torch.int32), cumsums]).to(torch.int32)
                        shared_culens.append(culens)
                        max_seqlens.append(max(seq_lens))
                    else:
                        each_len = seq_lens[0]
                        sk = torch.randn(len(seq_lens), each_len, kvheads, dim, dtype=dtype)
                        shared_culens.append(None)
                        max_seqlens.append(None)

                    sv = torch.randn_like(sk)
                    shared_ks.append(sk)
                    shared_vs.append(sv)

                final_sizes = sizes[-1]
                max_len = max(final_sizes)

                # right padding of the unique cache holds junk (as a reused decode buffer would)
                k = torch.randn(final_batch_size, max_len, kvheads, dim, dtype=dtype) * 3.0
                v = torch.randn(final_batch_size, max_len, kvheads, dim, dtype=dtype) * 3.0

                if len(set(final_sizes)) > 1:
                    unique_seq_lens = torch.tensor(final_sizes, dtype=torch.int32)
                else:
                    unique_seq_lens = None

                hy_out = hydragen_attention(
                    q=q,
                    k=k,
                    v=v,
                    shared_ks=shared_ks,
                    shared_vs=shared_vs,
                    shared_cu_seq_lens=shared_culens,
                    shared_max_seq_lens=max_seqlens,
                    use_varlens=use_varlens,
                    seq_lens=unique_seq_lens,
                )

                results = []
                for i in range(final_batch_size):
                    sliced_q = q[i : i + 1]
                    sliced_k = k[i : i + 1]
                    sliced_v = v[i : i + 1]

                    if unique_seq_lens is not None:
                        sliced_k = sliced_k[:, : unique_seq_lens[i]]
                        sliced_v = sliced_v[:, : unique_seq_lens[i]]

                    sliced_shared_ks, sliced_shared_vs = [], []
                    for j in range(len(shared_ks)):
                        sk = shared_ks[j]
                        sv = shared_vs[j]
                        if use_varlens[j]:
                            culens = shared_culens[j]
                            shared_batch_size = culens.shape[0] - 1
                            seqs_per_shared = final_batch_size // shared_batch_size
                            shared_index = i // seqs_per_shared
                            start = culens[shared_index]
                            end = culens[shared_index + 1]
                            sliced_shared_ks.append(sk[start:end].unsqueeze(0))
                            sliced_shared_vs.append(sv[start:end].unsqueeze(0))
                        else:
                            shared_batch_size = sk.shape[0]
                            seqs_per_shared = final_batch_size // shared_batch_size
                            shared_index = i // seqs_per_shared
                            sliced_shared_ks.append(sk[shared_index].unsqueeze(0))
                            sliced_shared_vs.append(sv[shared_index].unsqueeze(0))

                    # full attention state of sequence i: its shared prefixes then its own suffix
                    ks = torch.cat(sliced_shared_ks + [sliced_k], dim=1)
                    vs = torch.cat(sliced_shared_vs + [sliced_v], dim=1)
                    results.append(reference_attention(sliced_q, ks, vs))

                cat_results = torch.cat(results, dim=0)
                diff = (cat_results - hy_out).abs().max().item()
                assert diff < 1e-5, f"Failed for {sizes=}, {qheads=}, {kvheads=}: {diff}"
                worst = max(worst, diff)
                n_cases += 1

    # the no-padding entry point, one shared level of 2 prompts for a batch of 4, unique suffix of 3 each
    q = torch.randn(4, 1, 4, dim)
    sk = torch.randn(2, 8, 2, dim)
    sv = torch.randn(2, 8, 2, dim)
    k = torch.randn(4, 3, 2, dim)
    v = torch.randn(4, 3, 2, dim)
    out = hydragen_attention_nopad(q, k, v, [sk], [sv])
    for i in range(4):
        ref = reference_attention(q[i : i + 1], torch.cat([sk[i // 2 : i // 2 + 1], k[i : i + 1]], 1),
                                  torch.cat([sv[i // 2 : i // 2 + 1], v[i : i + 1]], 1))
        d = (out[i : i + 1] - ref).abs().max().item()
        assert d < 1e-5, d
        worst = max(worst, d)
    n_cases += 1

    print(f"hydragen attention matches per-sequence attention over shared+unique KVs: {n_cases} cases, "
          f"max abs diff {worst:.2e}")


if __name__ == "__main__":
    test_attention()
