"""USP (Ulysses x ring) causal attention from yunchang, all ranks simulated in one process.

Citation: feifeibear/long-context-attention @56118e0d8fe377d43441226dd8bdd07135c92c22
  yunchang/globals.py          set_seq_parallel_pg (use_ulysses_low=True: ulysses groups are
                               consecutive ranks, ring groups are strided by the ulysses degree)
  yunchang/comm/extract_local.py basic_extract_local (contiguous sequence shard per global rank)
  yunchang/comm/all_to_all.py  all_to_all_4D / SeqAllToAll4D (scatter heads, gather sequence and back)
  yunchang/hybrid/attn_layer.py LongContextAttention.forward (ring_impl_type="basic_pytorch")
  yunchang/ring/ring_pytorch_attn.py RingAttentionFunc.forward (step 0: causal block on the rank's own
                               K/V; later steps: unmasked block while step <= rank, later blocks skipped)
  yunchang/ring/utils.py       update_out_and_lse (log-sum-exp merge of the partial outputs)
  yunchang/kernels/attention.py pytorch_attn_forward (op_type="flash")

The collectives are replaced by lock-step loops over the ranks of each group: all_to_all_single
hands chunk j of rank i to rank j, and RingComm.send_recv delivers rank (r - 1)'s K/V to rank r.
On CPU the flash op is aten::_scaled_dot_product_flash_attention_for_cpu, which returns the same
(out, logsumexp) pair. Each configuration (ulysses x ring = 4 ranks) is checked against full
attention over the whole sequence with a causal mask written as a double loop.
"""
import torch
import torch.nn.functional as F

# --- yunchang/kernels/attention.py -------------------------------------------------------------


def pytorch_attn_forward(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, op_type="flash"):
    """
    q shape (bs, seqlen, nhead, hs)
    k shape (bs, seqlen, nhead, hs)
    v shape (bs, seqlen, nhead, hs)
    """
    assert op_type == "flash"
    q = q.transpose(1, 2)
    k = k.transpose(1, 2)
    v = v.transpose(1, 2)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, causal, scale=softmax_scale
    )[:2]
    out = out.transpose(1, 2)
    lse = lse.to(q.dtype)
    return out, lse


# --- yunchang/ring/utils.py --------------------------------------------------------------------


def _update_out_and_lse(out, lse, block_out, block_lse):
    block_out = block_out.to(torch.float32)
    block_lse = block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    out = out - F.sigmoid(block_lse - lse) * (out - block_out)
    lse = lse - F.logsigmoid(lse - block_lse)
    return out, lse


def update_out_and_lse(out, lse, block_out, block_lse):
    if out is None:
        out = block_out.to(torch.float32)
        lse = block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    else:
        out, lse = _update_out_and_lse(out, lse, block_out, block_lse)
    return out, lse


# --- yunchang/ring/ring_pytorch_attn.py, RingAttentionFunc.forward, every ring rank in lock-step ---


def ring_pytorch_attn_func(qs, ks, vs, softmax_scale=None, causal=False):
    """qs[r], ks[r], vs[r]: what ring rank r holds, (bs, seqlen / ring, heads, hs)."""
    world_size = len(qs)
    sm_scale = softmax_scale if softmax_scale is not None else qs[0].shape[-1] ** -0.5
    outs, lses = [None] * world_size, [None] * world_size
    ks, vs = list(ks), list(vs)
    for step in range(world_size):
        if step + 1 != world_size:
            # comm.send_recv(k) / comm.send_recv(v): send to rank + 1, receive from rank - 1
            next_ks = [ks[(rank - 1) % world_size] for rank in range(world_size)]
            next_vs = [vs[(rank - 1) % world_size] for rank in range(world_size)]
        for rank in range(world_size):
            if not causal or step <= rank:
                block_out, block_lse = pytorch_attn_forward(
                    qs[rank], ks[rank], vs[rank], softmax_scale=sm_scale, causal=causal and step == 0
                )
                outs[rank], lses[rank] = update_out_and_lse(outs[rank], lses[rank], block_out, block_lse)
        if step + 1 != world_size:
            ks, vs = next_ks, next_vs
    return [out.to(q.dtype) for out, q in zip(outs, qs)]


# --- yunchang/comm/all_to_all.py, all_to_all_4D over one ulysses group ---------------------------


def all_to_all_single(inputs):
    """dist.all_to_all_single for every rank of a group: chunk j of rank i lands as chunk i on rank j."""
    world = len(inputs)
    return [torch.cat([inputs[i].chunk(world, dim=0)[j] for i in range(world)], dim=0) for j in range(world)]


def all_to_all_4D(inputs, scatter_idx=2, gather_idx=1):
    seq_world_size = len(inputs)
    if scatter_idx == 2 and gather_idx == 1:
        # (bs, seqlen/P, hc, hs) -> (bs, seqlen, hc/P, hs)
        bs, shard_seqlen, hc, hs = inputs[0].shape
        seqlen = shard_seqlen * seq_world_size
        shard_hc = hc // seq_world_size
        input_ts = [
            x.reshape(bs, shard_seqlen, seq_world_size, shard_hc, hs).transpose(0, 2).contiguous()
            for x in inputs
        ]
        outputs = all_to_all_single(input_ts) if seq_world_size > 1 else input_ts
        return [
            o.reshape(seqlen, bs, shard_hc, hs).transpose(0, 1).contiguous().reshape(bs, seqlen, shard_hc, hs)
            for o in outputs
        ]
    elif scatter_idx == 1 and gather_idx == 2:
        # (bs, seqlen, hc/P, hs) -> (bs, seqlen/P, hc, hs)
        bs, seqlen, shard_hc, hs = inputs[0].shape
        hc = shard_hc * seq_world_size
        shard_seqlen = seqlen // seq_world_size
        input_ts = [
            x.reshape(bs, seq_world_size, shard_seqlen, shard_hc, hs)
            .transpose(0, 3)
            .transpose(0, 1)
            .contiguous()
            .reshape(seq_world_size, shard_hc, shard_seqlen, bs, hs)
            for x in inputs
        ]
        outputs = all_to_all_single(input_ts) if seq_world_size > 1 else input_ts
        return [
            o.reshape(hc, shard_seqlen, bs, hs).transpose(0, 2).contiguous().reshape(bs, shard_seqlen, hc, hs)
            for o in outputs
        ]
    raise RuntimeError("scatter_idx must be 1 or 2 and gather_idx must be 1 or 2")


# --- yunchang/globals.py set_seq_parallel_pg, yunchang/comm/extract_local.py ----------------------


def set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, world_size, use_ulysses_low=True):
    sp_degree = sp_ring_degree * sp_ulysses_degree
    assert world_size == sp_degree and use_ulysses_low
    ulysses_groups = [
        list(range(i * sp_ulysses_degree, (i + 1) * sp_ulysses_degree)) for i in range(sp_ring_degree)
    ]
    ring_groups = [list(range(i, sp_degree, sp_ulysses_degree)) for i in range(sp_ulysses_degree)]
    return ulysses_groups, ring_groups


def basic_extract_local(value, rank, world_size, *args, **kwargs):
    return value.chunk(world_size, dim=1)[rank].detach().clone()


# --- yunchang/hybrid/attn_layer.py, LongContextAttention.forward ---------------------------------


class LongContextAttention(torch.nn.Module):
    def __init__(self, ulysses_groups, ring_groups, scatter_idx=2, gather_idx=1):
        super().__init__()
        self.ulysses_groups = ulysses_groups
        self.ring_groups = ring_groups
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.ring_attn_fn = ring_pytorch_attn_func  # RING_IMPL_DICT["basic_pytorch"]

    def _ulysses(self, per_rank, scatter_idx, gather_idx):
        out = [None] * len(per_rank)
        for group in self.ulysses_groups:
            for rank, t in zip(group, all_to_all_4D([per_rank[r] for r in group], scatter_idx, gather_idx)):
                out[rank] = t
        return out

    def forward(self, query, key, value, softmax_scale=None, causal=False):
        """query[g], key[g], value[g]: global rank g's (bs, seq_len/N, head_cnt, head_size)."""
        # scatter 2, gather 1
        query_layer = self._ulysses(query, self.scatter_idx, self.gather_idx)
        key_layer = self._ulysses(key, self.scatter_idx, self.gather_idx)
        value_layer = self._ulysses(value, self.scatter_idx, self.gather_idx)

        context_layer = [None] * len(query)
        for group in self.ring_groups:
            outs = self.ring_attn_fn(
                [query_layer[g] for g in group],
                [key_layer[g] for g in group],
                [value_layer[g] for g in group],
                softmax_scale=softmax_scale,
                causal=causal,
            )
            for g, o in zip(group, outs):
                context_layer[g] = o

        # scatter 1, gather 2
        return self._ulysses(context_layer, self.gather_idx, self.scatter_idx)


# --- reference ---------------------------------------------------------------------------------


def reference_attention(q, k, v, causal):
    """Full attention over the whole sequence, the causal mask written as a double loop."""
    bs, seqlen, nheads, hs = q.shape
    allowed = torch.zeros(seqlen, seqlen, dtype=torch.bool)
    for i in range(seqlen):
        for j in range(seqlen):
            allowed[i, j] = (j <= i) if causal else True
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * hs ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), v)


def main():
    torch.manual_seed(0)
    world_size, batch_size, seqlen, nheads, d = 4, 2, 24, 4, 16
    hidden = nheads * d
    x = torch.randn(batch_size, seqlen, hidden)
    qkv_proj = torch.nn.Linear(hidden, 3 * hidden)
    with torch.no_grad():
        q, k, v = qkv_proj(x).view(batch_size, seqlen, 3, nheads, d).unbind(dim=2)

    for sp_ulysses_degree, sp_ring_degree in [(2, 2), (1, 4), (4, 1)]:
        ulysses_groups, ring_groups = set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, world_size)
        attn = LongContextAttention(ulysses_groups, ring_groups)
        local_q = [basic_extract_local(q, r, world_size) for r in range(world_size)]
        local_k = [basic_extract_local(k, r, world_size) for r in range(world_size)]
        local_v = [basic_extract_local(v, r, world_size) for r in range(world_size)]
        for causal in (True, False):
            with torch.no_grad():
                local_out = attn(local_q, local_k, local_v, causal=causal)
            out = torch.cat(local_out, dim=1)
            ref = reference_attention(q, k, v, causal)
            err = (out - ref).abs().max().item()
            print(f"ulysses={sp_ulysses_degree} ring={sp_ring_degree} causal={causal}: max |usp - full| = {err:.2e}")
            assert out.shape == ref.shape
            assert err < 1e-5, err
    print("ok")


if __name__ == "__main__":
    main()
