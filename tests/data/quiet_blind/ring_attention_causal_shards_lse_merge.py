"""Ring attention (zhuzilin/ring-flash-attention) simulated over 4 context-parallel ranks in one process.

Follows ring_flash_attn/ring_flash_attn.py (ring_flash_attn_forward: at step 0 each rank attends its
own K/V block with causal=True; at later steps it receives the previous rank's block and attends it
with causal=False while `step <= rank`, skipping blocks from later ranks) and ring_flash_attn/utils.py
(update_out_and_lse: merge partial outputs through their log-sum-exp). The sequence of 4 * 6 tokens
is split contiguously; the global mask is ordinary causal, but it is realised as a square causal
diagonal block plus unmasked off-diagonal blocks, each an SDPA call on a 6-token shard.
"""
import torch
import torch.nn.functional as F


def _flash_attn_forward(q, k, v, softmax_scale, causal):
    """Local block attention returning (out, lse) like flash_attn's _flash_attn_forward."""
    # q, k, v: (batch, seqlen, nheads, headdim)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=softmax_scale)
    scores = torch.matmul(qt, kt.transpose(-2, -1)) * softmax_scale
    if causal:
        scores = scores.masked_fill(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (batch, nheads, seqlen)
    return out.transpose(1, 2), lse


def _update_out_and_lse(out, lse, block_out, block_lse):
    block_lse = block_lse.transpose(-2, -1).unsqueeze(dim=-1)  # (batch, seqlen, nheads, 1)
    out = out - F.sigmoid(block_lse - lse) * (out - block_out)
    lse = lse - F.logsigmoid(lse - block_lse)
    return out, lse


def update_out_and_lse(out, lse, block_out, block_lse):
    if out is None:
        return block_out.to(torch.float32), block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    return _update_out_and_lse(out, lse, block_out, block_lse)


def ring_flash_attn_forward(rank, world_size, q, kv_shards, softmax_scale, causal=True):
    """One rank's forward; kv_shards[r] stands for what RingComm.send_recv delivers at each step."""
    out, lse = None, None
    k, v = kv_shards[rank]
    for step in range(world_size):
        if not causal or step <= rank:
            block_out, block_lse = _flash_attn_forward(q, k, v, softmax_scale, causal=causal and step == 0)
            out, lse = update_out_and_lse(out, lse, block_out, block_lse)
        if step + 1 != world_size:
            k, v = kv_shards[(rank - step - 1) % world_size]  # next_k, next_v = comm.send_recv(k), comm.send_recv(v)
    return out.to(q.dtype), lse.squeeze(dim=-1).transpose(1, 2)


def main():
    torch.manual_seed(0)
    world_size, batch, seqlen, nheads, d = 4, 2, 24, 4, 16
    q = torch.randn(batch, seqlen, nheads, d)
    k = torch.randn(batch, seqlen, nheads, d)
    v = torch.randn(batch, seqlen, nheads, d)
    local_q = q.chunk(world_size, dim=1)
    kv_shards = list(zip(k.chunk(world_size, dim=1), v.chunk(world_size, dim=1)))
    outs = [ring_flash_attn_forward(r, world_size, local_q[r], kv_shards, d ** -0.5, causal=True)[0] for r in range(world_size)]
    ring_out = torch.cat(outs, dim=1)
    print("ring attention output", tuple(ring_out.shape), f"{ring_out.abs().mean().item():.4f}")


if __name__ == "__main__":
    main()
