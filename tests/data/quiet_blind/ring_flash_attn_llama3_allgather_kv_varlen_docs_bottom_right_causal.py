"""Llama-3 style context parallelism: all-gather K/V, local queries at their offset.

Follows zhuzilin/ring-flash-attention, ring_flash_attn/llama3_flash_attn_varlen.py:
llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size) and
llama3_flash_attn_varlen_forward (the scheme of the Llama 3 paper, sec. 3.3.2).

A packed batch of documents (global cu_seqlens) is cut into W equal contiguous
slices, one per rank. Each rank all-gathers K/V and, for its local queries, builds
  cu_seqlens_q : the local pieces of each document that overlaps the slice
  cu_seqlens_k : for the same documents, keys from the DOCUMENT START up to the end
                 of the local slice (keys after the slice are never needed)
  local_k_slice: the gathered key range those cu_seqlens_k index
and calls flash_attn_varlen_func(..., causal=True). With seqlen_q < seqlen_k,
flash-attn's causal mask is aligned to the BOTTOM-RIGHT corner, which is exactly
"a query at global position p sees keys up to p of its own document".
The result must equal document-causal attention over the whole packed sequence.
"""
import torch

torch.manual_seed(0)
DT = torch.float64


def flash_attn_varlen_ref(q, k, v, cu_q, cu_k, causal):
    """What flash_attn_varlen_func computes: per segment, causal aligned bottom-right."""
    out = torch.zeros_like(q)
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        sq, sk = qe - qs, ke - ks
        if sq == 0:
            continue
        s = torch.einsum("qhd,khd->hqk", q[qs:qe], k[ks:ke]) / q.shape[-1] ** 0.5
        if causal:
            qi = torch.arange(sq)[:, None]
            kj = torch.arange(sk)[None, :]
            s = s.masked_fill(kj > qi + (sk - sq), float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[ks:ke])
    return out


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size):
    total_length = cu_seqlens[-1].item()
    assert total_length % world_size == 0
    length_per_rank = total_length // world_size
    left = torch.searchsorted(cu_seqlens, rank * length_per_rank)
    right = torch.searchsorted(cu_seqlens, (rank + 1) * length_per_rank)
    # after this, cu_seqlens[left:right + 1] contains all the sequence for this rank
    if cu_seqlens[left] != rank * length_per_rank:
        left -= 1
    left, right = left.item(), right.item()
    # q is always the same. just calculate the cu_seqlens for the local slice
    cu_seqlens_q = cu_seqlens[left:right + 1].clone()
    cu_seqlens_q -= rank * length_per_rank
    cu_seqlens_q[0] = 0
    cu_seqlens_q[-1] = length_per_rank
    cu_seqlens_k = cu_seqlens[left:right + 1].clone()
    if causal:
        # the last k seq ends where the local q slice ends
        slice_right = (rank + 1) * length_per_rank
        cu_seqlens_k[-1] = slice_right
    else:
        slice_right = cu_seqlens[right].item()
    slice_left = cu_seqlens[left].item()
    cu_seqlens_k -= slice_left
    max_seqlen_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()
    local_k_slice = slice(slice_left, slice_right)
    return cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), max_seqlen_q, local_k_slice


def main():
    H, D = 2, 8
    worst = 0.0
    cases = [(4, [5, 11, 3, 13]), (2, [32]), (4, [1, 7, 2, 6, 16]), (3, [4, 4, 4, 4, 8])]
    for world, doc_lens in cases:
        cu = torch.tensor([0] + doc_lens).cumsum(0)
        T = int(cu[-1])
        q, k, v = (torch.randn(T, H, D, dtype=DT) for _ in range(3))
        ref = flash_attn_varlen_ref(q, k, v, cu.tolist(), cu.tolist(), causal=True)

        per = T // world
        for rank in range(world):
            q_local = q[rank * per:(rank + 1) * per]
            k_all, v_all = k, v  # the all-gather of every rank's local k/v
            cu_q, cu_k, _, kslice = llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, world)
            out = flash_attn_varlen_ref(q_local, k_all[kslice], v_all[kslice], cu_q, cu_k, causal=True)
            d = (out - ref[rank * per:(rank + 1) * per]).abs().max().item()
            worst = max(worst, d)
            print(f"docs={doc_lens} world={world} rank={rank} cu_q={cu_q} cu_k={cu_k} "
                  f"max|cp-full|={d:.2e}")
    assert worst < 1e-12, worst
    print("ok, max difference", worst)


if __name__ == "__main__":
    main()
