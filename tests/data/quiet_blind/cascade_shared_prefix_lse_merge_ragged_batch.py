"""Cascade (shared-prefix) attention for a serving batch: prefix KV stored once, merged by LSE.

Follows flashinfer-ai/flashinfer python/flashinfer/cascade.py (merge_state, the two-level
MultiLevelCascadeAttentionWrapper: level 0 = shared prefix, level 1 = per-request unique KV with
qo_indptr / kv_indptr), written in plain torch. Three requests share a 12-token system prompt whose
K/V exist once. This step mixes a decode (1 query), a 3-token chunked prefill of a new turn and
another decode; queries are flattened ragged ([total_q, heads, dim], qo_indptr).
Level 0: every query attends to all 12 shared-prefix keys, unmasked (the prefix is strictly in the
past of every query). Level 1: each request's queries attend to that request's own unique keys,
causal with the queries placed at the end of its unique KV (bottom-right aligned). The two partial
outputs are merged with their log-sum-exp (natural log here): the result equals attention over
[prefix ; unique] with the request's causal mask, which the program checks.
Mask meant: level 0 all-True [total_q x 12]; level 1 per request [q_len x kv_len] with key j visible
to query i iff j <= kv_len - q_len + i; other requests' keys never visible.
"""
import torch


def attention_with_lse(q, k, v, mask=None):
    """q [n, h, d], k/v [m, h, d] -> (out [n, h, d], lse [n, h]); mask [n, m] bool, True = visible."""
    scores = torch.einsum("nhd,mhd->hnm", q, k) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), v)
    return out, lse.transpose(0, 1)


def merge_state(v_a, s_a, v_b, s_b):
    """Merge two attention states computed over disjoint key sets."""
    s = torch.logaddexp(s_a, s_b)
    return v_a * torch.exp(s_a - s)[..., None] + v_b * torch.exp(s_b - s)[..., None], s


def batch_unique_attention(q, qo_indptr, k_unique, v_unique, kv_indptr):
    outs, lses = [], []
    for r in range(len(qo_indptr) - 1):
        qs, qe = int(qo_indptr[r]), int(qo_indptr[r + 1])
        ks, ke = int(kv_indptr[r]), int(kv_indptr[r + 1])
        q_len, kv_len = qe - qs, ke - ks
        # causal, bottom-right aligned: the new tokens are the last q_len of the request's unique KV
        i = torch.arange(q_len)[:, None]
        j = torch.arange(kv_len)[None, :]
        mask = j <= kv_len - q_len + i
        o, s = attention_with_lse(q[qs:qe], k_unique[ks:ke], v_unique[ks:ke], mask)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs), torch.cat(lses)


if __name__ == "__main__":
    torch.manual_seed(0)
    num_heads, head_dim = 4, 16
    shared_len = 12
    # request 0: 5 unique tokens cached + 1 decode; request 1: 4 cached + 3-token new turn;
    # request 2: 9 cached + 1 decode (the new tokens' K/V are already appended to the unique KV)
    q_lens = torch.tensor([1, 3, 1])
    kv_lens = torch.tensor([6, 7, 10])
    qo_indptr = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0))
    kv_indptr = torch.nn.functional.pad(kv_lens.cumsum(0), (1, 0))

    k_shared = torch.randn(shared_len, num_heads, head_dim)
    v_shared = torch.randn(shared_len, num_heads, head_dim)
    k_unique = torch.randn(int(kv_indptr[-1]), num_heads, head_dim)
    v_unique = torch.randn(int(kv_indptr[-1]), num_heads, head_dim)
    q = torch.randn(int(qo_indptr[-1]), num_heads, head_dim)

    # level 0: all queries of the batch against the shared prefix, no mask
    v_a, s_a = attention_with_lse(q, k_shared, v_shared)
    # level 1: each request against its own unique KV
    v_b, s_b = batch_unique_attention(q, qo_indptr, k_unique, v_unique, kv_indptr)
    o, _ = merge_state(v_a, s_a, v_b, s_b)

    # the same attention without the cascade: [shared ; unique] per request
    ref = []
    for r in range(3):
        qs, qe = int(qo_indptr[r]), int(qo_indptr[r + 1])
        ks, ke = int(kv_indptr[r]), int(kv_indptr[r + 1])
        k_full = torch.cat([k_shared, k_unique[ks:ke]])
        v_full = torch.cat([v_shared, v_unique[ks:ke]])
        total, q_len = k_full.shape[0], qe - qs
        mask = torch.arange(total)[None, :] <= total - q_len + torch.arange(q_len)[:, None]
        ref.append(attention_with_lse(q[qs:qe], k_full, v_full, mask)[0])
    ref = torch.cat(ref)
    assert torch.allclose(o, ref, atol=1e-5)
    print("cascade output", tuple(o.shape), "max diff vs full attention %.1e" % (o - ref).abs().max())
