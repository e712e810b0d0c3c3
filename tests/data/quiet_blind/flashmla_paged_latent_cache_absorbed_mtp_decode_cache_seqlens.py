"""DeepSeek MLA decode on a paged latent cache, FlashMLA calling convention.

Follows deepseek-ai/FlashMLA, tests/test_flash_mla.py (test_flash_mla: block_table,
cache_seqlens, blocked_k with dv = kv_lora_rank, and its reference
scaled_dot_product_attention whose is_causal mask is tril(diagonal=s_k - s_q)), fed the
way deepseek-ai/DeepSeek-V3 inference/model.py MLA.forward (attn_impl == "absorb")
prepares its operands:
  q_nope is absorbed through wkv_b's key part: q_lat = q_nope @ W_UK  (per head)
  the cache holds only kv_norm(c_kv) ++ rope(k_pe) per token, ONE kv head (h_kv = 1)
  the value is the first kv_lora_rank columns of the same cache row (dv = kv_lora_rank)
  softmax_scale stays 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) (the ORIGINAL head dim)
  the latent output is expanded through wkv_b's value part: o = o_lat @ W_UV.
The cache is paged: each sequence owns blocks listed in block_table (shuffled physical
blocks), the slots past cache_seqlens[i] hold stale values of an earlier request, and
cache_seqlens already counts the s_q new tokens (MTP decode with s_q = 2): the new rows
see the whole cache up to themselves -- causal aligned to the bottom-right.
Check: equals naive MLA (K and V decompressed per head) over each sequence alone,
full recompute without any cache, at the same last s_q positions.
"""
import torch

torch.manual_seed(0)
DT = torch.float64
DIM, NH, RANK, NOPE, ROPE, VD, BLOCK = 32, 3, 8, 6, 4, 5, 4
SCALE = (NOPE + ROPE) ** -0.5


def rope(x, pos):  # x (..., s, h, ROPE) with positions pos (s,)
    inv = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, dtype=DT) / ROPE))
    ang = pos[:, None].to(DT) * inv[None]
    c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


P = {"wq": torch.randn(DIM, NH * (NOPE + ROPE), dtype=DT) * 0.2,
     "wkv_a": torch.randn(DIM, RANK + ROPE, dtype=DT) * 0.2,
     "kv_norm": 1 + 0.1 * torch.randn(RANK, dtype=DT),
     "wkv_b": torch.randn(NH, NOPE + VD, RANK, dtype=DT) * 0.3,
     "wo": torch.randn(NH * VD, DIM, dtype=DT) * 0.2}


def project(x, pos):  # x (s, DIM)
    q = (x @ P["wq"]).view(-1, NH, NOPE + ROPE)
    q_nope, q_pe = q[..., :NOPE], rope(q[..., NOPE:], pos)
    kv = x @ P["wkv_a"]
    c_kv, k_pe = rms(kv[:, :RANK], P["kv_norm"]), rope(kv[:, None, RANK:], pos)[:, 0]
    return q_nope, q_pe, c_kv, k_pe


def naive_mla(x):  # one whole sequence, no cache: decompress K, V per head
    pos = torch.arange(x.shape[0])
    q_nope, q_pe, c_kv, k_pe = project(x, pos)
    kv = torch.einsum("tc,hdc->thd", c_kv, P["wkv_b"])
    k = torch.cat([kv[..., :NOPE], k_pe[:, None].expand(-1, NH, -1)], -1)
    q = torch.cat([q_nope, q_pe], -1)
    s = torch.einsum("shd,thd->hst", q, k) * SCALE
    s = s.masked_fill(torch.ones(len(pos), len(pos), dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hst,thd->shd", torch.softmax(s, -1), kv[..., NOPE:])
    return o.reshape(-1, NH * VD) @ P["wo"]


def flash_mla_with_kvcache(q, blocked_k, block_table, cache_seqlens, dv, causal):
    """Reference semantics of the kernel: q (b, s_q, h_q, 576-like), blocked_k (nblk, BLOCK, 1, d)."""
    b, s_q = q.shape[:2]
    k = blocked_k[block_table].flatten(1, 2)[:, :, 0]           # (b, max_blocks*BLOCK, d)
    s = torch.einsum("bqhd,btd->bhqt", q, k) * SCALE
    t = torch.arange(k.shape[1])
    q_pos = cache_seqlens[:, None] - s_q + torch.arange(s_q)[None]  # absolute row positions
    visible = t[None, None, :] < cache_seqlens[:, None, None]
    if causal:
        visible = visible & (t[None, None, :] <= q_pos[:, :, None])
    s = s.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhqt,btc->bqhc", torch.softmax(s, -1), k[..., :dv])


def main():
    S_Q, lens = 2, [9, 14, 5]
    b = len(lens)
    xs = [torch.randn(n, DIM, dtype=DT) for n in lens]
    max_blocks = -(-max(lens) // BLOCK)
    perm = torch.randperm(b * max_blocks + 2)
    block_table = perm[: b * max_blocks].view(b, max_blocks)
    blocked_k = 5 * torch.randn(len(perm), BLOCK, 1, RANK + ROPE, dtype=DT)  # stale contents

    cache_seqlens = torch.tensor(lens)
    q_all = []
    for i, x in enumerate(xs):
        pos = torch.arange(lens[i])
        q_nope, q_pe, c_kv, k_pe = project(x, pos)
        row = torch.cat([c_kv, k_pe], -1)           # written by prefill and by this decode step
        for t in range(lens[i]):
            blocked_k[block_table[i, t // BLOCK], t % BLOCK, 0] = row[t]
        q_lat = torch.einsum("shd,hdc->shc", q_nope[-S_Q:], P["wkv_b"][:, :NOPE])
        q_all.append(torch.cat([q_lat, q_pe[-S_Q:]], -1))
    q = torch.stack(q_all)                            # (b, S_Q, NH, RANK + ROPE)

    o_lat = flash_mla_with_kvcache(q, blocked_k, block_table, cache_seqlens, RANK, causal=True)
    o = torch.einsum("bqhc,hdc->bqhd", o_lat, P["wkv_b"][:, NOPE:]).reshape(b, S_Q, NH * VD) @ P["wo"]

    worst = 0.0
    for i, x in enumerate(xs):
        d = (o[i] - naive_mla(x)[-S_Q:]).abs().max().item()
        worst = max(worst, d)
        print(f"seq {i}: cache_seqlen={lens[i]} blocks={block_table[i].tolist()} max|absorbed paged-naive|={d:.2e}")
    assert worst < 1e-12, worst
    print("ok")


if __name__ == "__main__":
    main()
