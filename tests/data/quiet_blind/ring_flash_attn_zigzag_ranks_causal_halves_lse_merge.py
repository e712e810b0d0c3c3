"""Zigzag ring attention, simulated over ranks on one process.

Follows zhuzilin/ring-flash-attention, ring_flash_attn/zigzag_ring_flash_attn.py,
zigzag_ring_flash_attn_forward (and utils.py update_out_and_lse), as used by
llama-factory / 360-LLaMA-Factory sequence parallelism.

The global sequence is cut into 2*W chunks; rank r holds chunk r and chunk 2W-1-r
("zigzag"), so every rank has the same causal work. In the ring loop:
  step 0        : the rank's own kv, attended with causal=True (the local block is
                  [early half | late half], whose causal mask is exactly the global one)
  step <= rank  : kv comes from an earlier rank src < rank; ALL local queries attend
                  the FIRST half of that kv (chunk src, before both our chunks) with
                  causal=False; its second half (chunk 2W-1-src, after both our chunks)
                  is skipped entirely
  step > rank   : kv comes from a later rank src > rank; our EARLY half (chunk rank)
                  precedes both its chunks and skips it, our LATE half (q1, chunk
                  2W-1-rank) follows both and attends the WHOLE kv with causal=False.
Partial outputs are merged with their log-sum-exp. The result must equal plain
causal attention over the whole sequence.
"""
import torch

torch.manual_seed(0)
DT = torch.float64


def attn_lse(q, k, v, causal):
    # q: (s_q, h, d), k/v: (s_k, h, d); flash_attn's causal aligns bottom-right,
    # here it is only used with s_q == s_k (step 0), so top-left == bottom-right.
    s = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        m = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (h, s_q)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
    return out, lse.transpose(0, 1)  # lse: (s_q, h)


def update_out_and_lse(out, lse, block_out, block_lse):
    # ring_flash_attn/utils.py _update_out_and_lse (sigmoid form)
    if out is None:
        return block_out.clone(), block_lse.clone()
    block_lse = block_lse.unsqueeze(-1)
    lse_ = lse.unsqueeze(-1)
    new_out = out - torch.sigmoid(block_lse - lse_) * (out - block_out)
    new_lse = lse_ - torch.nn.functional.logsigmoid(lse_ - block_lse)
    return new_out, new_lse.squeeze(-1)


def zigzag_split(x, world, rank):
    chunks = x.chunk(2 * world, dim=0)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=0)


def zigzag_forward(rank, world, q_local, kv_of_rank):
    block_seq_len = q_local.shape[0] // 2
    q1 = q_local[block_seq_len:]
    out, lse = None, None
    for step in range(world):
        src = (rank - step) % world  # ring: at step s we hold rank-s's kv
        k, v = kv_of_rank[src]
        if step == 0:
            bo, bl = attn_lse(q_local, k, v, causal=True)
            out, lse = update_out_and_lse(out, lse, bo, bl)
        elif step <= rank:
            k0, v0 = k[:block_seq_len], v[:block_seq_len]
            bo, bl = attn_lse(q_local, k0, v0, causal=False)
            out, lse = update_out_and_lse(out, lse, bo, bl)
        else:
            bo, bl = attn_lse(q1, k, v, causal=False)
            o1, l1 = update_out_and_lse(out[block_seq_len:], lse[block_seq_len:], bo, bl)
            out = torch.cat([out[:block_seq_len], o1], 0)
            lse = torch.cat([lse[:block_seq_len], l1], 0)
    return out, lse


def main():
    H, D = 2, 8
    worst = 0.0
    for world, seqlen in [(2, 16), (4, 24), (3, 30)]:
        q = torch.randn(seqlen, H, D, dtype=DT)
        k = torch.randn(seqlen, H, D, dtype=DT)
        v = torch.randn(seqlen, H, D, dtype=DT)
        ref, ref_lse = attn_lse(q, k, v, causal=True)  # whole sequence, one device

        kv_of_rank = [(zigzag_split(k, world, r), zigzag_split(v, world, r)) for r in range(world)]
        for rank in range(world):
            out, lse = zigzag_forward(rank, world, zigzag_split(q, world, rank), kv_of_rank)
            d = max((out - zigzag_split(ref, world, rank)).abs().max().item(),
                    (lse - zigzag_split(ref_lse, world, rank)).abs().max().item())
            worst = max(worst, d)
            print(f"world={world} seqlen={seqlen} rank={rank} max|zigzag-full|={d:.2e}")
    assert worst < 1e-12, worst
    print("ok, max difference", worst)


if __name__ == "__main__":
    main()
