"""yunchang (long-context-attention) USP with zigzag ring attention and data parallelism: each
rank cut its zigzag shard with its global rank.

Citation: feifeibear/long-context-attention#57 (commit a389392, "Fix r_rank/u_rank in extract
local to be compatible with DP"), yunchang/comm/extract_local.py ``zigzag_extract_local``.

The bug: ``zigzag_extract_local(value, rank, world_size, rd, ud)`` picked the two zigzag chunks of
a rank with ``r_rank = rank // ud`` and ``u_rank = rank % ud``, from the rank it was handed. A
training script with data parallelism hands it the global rank, so on every DP replica but the
first the shard offsets run past the sequence-parallel group: a rank whose ring rank is 0 gets
chunks (2, 1) of a 4-chunk sequence instead of (0, 3). The zigzag ring attention itself keys its
causal structure on the ring group's rank (step 0 causal on the local pair, ``step <= rank`` the
first half of the incoming keys, else only the second half of the queries), so the queries of
those replicas see the keys of the wrong chunks (a later chunk treated as chunk 0, an earlier one
hidden).

The fix: ``r_rank = dist.get_rank(group=PROCESS_GROUP.RING_PG)`` and
``u_rank = dist.get_rank(group=PROCESS_GROUP.ULYSSES_PG)``.

This program keeps yunchang's pieces: ``set_seq_parallel_pg`` (ulysses-low layout, DP replicas as
offsets), ``EXTRACT_FUNC_DICT["zigzag"]``, ``LongContextAttentionQKVPacked`` (SeqAllToAll5D over
the Ulysses group, the zigzag qkvpacked ring function over the ring group, SeqAllToAll4D back) and
ring-flash-attention's ``zigzag_ring_flash_attn_forward`` / ``update_out_and_lse``. The 8 ranks
(2 DP replicas x ulysses 2 x ring 2) run in one process: ``dist`` below is a stand-in that knows
which simulated rank is running, and collectives take every member's tensor at once.
``_flash_attn_forward`` is a plain-torch stand-in for flash-attn's kernel (same (b, s, h, d)
layout, lse (b, h, s)). A tiny causal LM layer (embedding, packed qkv, RoPE from each shard's
position ids, USP attention, o_proj, LM head) is scored on next-token loss per DP replica.
"""

import math
import sys
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


# --------------------------------------------------------------------------------------------
# torch.distributed stand-in: 8 ranks simulated in one process
# --------------------------------------------------------------------------------------------


class _SimGroup:
    def __init__(self, ranks):
        self.ranks = list(ranks)

    def size(self):
        return len(self.ranks)


class _SimDist:
    def __init__(self, world_size):
        self.world_size = world_size
        self.current_rank = 0

    def get_rank(self, group=None):
        if group is None:
            return self.current_rank
        return group.ranks.index(self.current_rank)

    def get_world_size(self, group=None):
        return self.world_size if group is None else group.size()

    def new_group(self, ranks):
        return _SimGroup(ranks)


dist = _SimDist(world_size=8)


# --------------------------------------------------------------------------------------------
# yunchang/globals.py
# --------------------------------------------------------------------------------------------


class ProcessGroupSingleton:
    def __init__(self):
        self.ULYSSES_PG = None
        self.RING_PG = None


_PER_RANK_PG = {}


class _CurrentRankProcessGroup:
    """Each real process has its own PROCESS_GROUP singleton; here it follows dist.current_rank."""

    @property
    def ULYSSES_PG(self):
        return _PER_RANK_PG[dist.current_rank].ULYSSES_PG

    @property
    def RING_PG(self):
        return _PER_RANK_PG[dist.current_rank].RING_PG


PROCESS_GROUP = _CurrentRankProcessGroup()


def set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size, use_ulysses_low=True):
    """
    sp_ulysses_degree x sp_ring_degree = seq_parallel_degree
    (ulysses_degree, dp_degree)
    """
    sp_degree = sp_ring_degree * sp_ulysses_degree
    dp_degree = world_size // sp_degree

    assert world_size % sp_degree == 0, f"world_size {world_size} % sp_degree {sp_ulysses_degree} == 0"

    num_ulysses_pgs = sp_ring_degree  # world_size // sp_ulysses_degree
    num_ring_pgs = sp_ulysses_degree  # world_size // sp_ring_degree

    if use_ulysses_low:
        for dp_rank in range(dp_degree):
            offset = dp_rank * sp_degree
            for i in range(num_ulysses_pgs):
                ulysses_ranks = list(range(i * sp_ulysses_degree + offset, (i + 1) * sp_ulysses_degree + offset))
                group = dist.new_group(ulysses_ranks)
                if rank in ulysses_ranks:
                    ulyssess_pg = group

            for i in range(num_ring_pgs):
                ring_ranks = list(range(i + offset, sp_degree + offset, num_ring_pgs))
                group = dist.new_group(ring_ranks)
                if rank in ring_ranks:
                    ring_pg = group
    else:
        for dp_rank in range(dp_degree):
            offset = dp_rank * sp_degree
            for i in range(num_ring_pgs):
                ring_ranks = list(range(i * sp_ring_degree + offset, (i + 1) * sp_ring_degree + offset))
                group = dist.new_group(ring_ranks)
                if rank in ring_ranks:
                    ring_pg = group

            for i in range(num_ulysses_pgs):
                ulysses_ranks = list(range(i + offset, sp_degree + offset, num_ulysses_pgs))
                group = dist.new_group(ulysses_ranks)
                if rank in ulysses_ranks:
                    ulyssess_pg = group

    pg = ProcessGroupSingleton()
    pg.ULYSSES_PG = ulyssess_pg
    pg.RING_PG = ring_pg
    _PER_RANK_PG[rank] = pg


# --------------------------------------------------------------------------------------------
# yunchang/comm/extract_local.py
# --------------------------------------------------------------------------------------------


def basic_extract_local(value, rank, world_size, *args, **kwargs):
    return value.chunk(world_size, dim=1)[rank].detach().clone()


def zigzag_extract_local(value, rank, world_size, rd, ud, dim=1, *args, **kwargs):
    input_dim = value.dim()
    if input_dim == 5:
        batch_size, seqlen, _, nheads, d = value.shape
    elif input_dim == 4:
        batch_size, seqlen, nheads, d = value.shape
    else:
        raise ValueError("value dim should be 4 or 5")

    value_chunks = value.chunk(2 * rd, dim=dim)

    # TODO assert ulyssess on low dim
    if FIXED:
        r_rank = dist.get_rank(group=PROCESS_GROUP.RING_PG)
        u_rank = dist.get_rank(group=PROCESS_GROUP.ULYSSES_PG)
    else:
        r_rank = rank // ud
        u_rank = rank % ud

    local_value = torch.cat([value_chunks[r_rank], value_chunks[2 * rd - r_rank - 1]], dim=dim).chunk(ud, dim=dim)[
        u_rank
    ]

    if input_dim == 5:
        local_value = local_value.reshape(batch_size, seqlen // world_size, 3, nheads, d)
    elif input_dim == 4:
        local_value = local_value.reshape(batch_size, seqlen // world_size, nheads, d)

    return local_value.contiguous()


EXTRACT_FUNC_DICT = {
    "basic": basic_extract_local,
    "zigzag": zigzag_extract_local,
}


# --------------------------------------------------------------------------------------------
# yunchang/comm/all_to_all.py (every member's tensor at once)
# --------------------------------------------------------------------------------------------


class SeqAllToAll5D:
    @staticmethod
    def apply(group, inputs_by_rank, scatter_idx=3, gather_idx=1):
        # (bs, seqlen/P, 3, hc, hs) -> (bs, seqlen, 3, hc/P, hs)
        assert scatter_idx == 3 and gather_idx == 1
        P = group.size()
        outputs = {}
        for u, dst in enumerate(group.ranks):
            parts = []
            for src in group.ranks:
                x = inputs_by_rank[src]
                hc = x.shape[3] // P
                parts.append(x[:, :, :, u * hc : (u + 1) * hc])
            outputs[dst] = torch.cat(parts, dim=1).contiguous()
        return outputs


class SeqAllToAll4D:
    @staticmethod
    def apply(group, inputs_by_rank, scatter_idx=2, gather_idx=1):
        P = group.size()
        outputs = {}
        if scatter_idx == 1 and gather_idx == 2:
            # (bs, seqlen, hc/P, hs) -> (bs, seqlen/P, hc, hs)
            for u, dst in enumerate(group.ranks):
                parts = []
                for src in group.ranks:
                    x = inputs_by_rank[src]
                    s = x.shape[1] // P
                    parts.append(x[:, u * s : (u + 1) * s])
                outputs[dst] = torch.cat(parts, dim=2).contiguous()
            return outputs
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# ring-flash-attention (vendored in yunchang/ring): utils.update_out_and_lse, zigzag forward
# --------------------------------------------------------------------------------------------


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    """Plain-torch stand-in for flash_attn's _flash_attn_forward: q, k, v (b, s, h, d), lse (b, h, s)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * softmax_scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(q.dtype)
    return out, q, k, v, out, lse, None, None


def _update_out_and_lse(out, lse, block_out, block_lse):
    block_out = block_out.to(torch.float32)
    block_lse = block_lse.transpose(-2, -1).unsqueeze(dim=-1)

    new_lse = lse + torch.log(1 + torch.exp(block_lse - lse))

    out = torch.exp(lse - new_lse) * out + torch.exp(block_lse - new_lse) * block_out

    lse = new_lse
    return out, lse


def update_out_and_lse(
    out: Optional[torch.Tensor],
    lse: Optional[torch.Tensor],
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    slice_=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        if slice_ is not None:
            raise RuntimeError("first update_out_and_lse should not pass slice_ args")
        out = block_out.to(torch.float32)
        lse = block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    elif slice_ is not None:
        slice_out, slice_lse = out[slice_], lse[slice_]
        slice_out, slice_lse = _update_out_and_lse(slice_out, slice_lse, block_out, block_lse)
        out[slice_], lse[slice_] = slice_out, slice_lse
    else:
        out, lse = _update_out_and_lse(out, lse, block_out, block_lse)
    return out, lse


def zigzag_ring_flash_attn_forward(
    process_group,
    q_by_rank,
    k_by_rank,
    v_by_rank,
    softmax_scale,
    dropout_p=0,
    causal=True,
    window_size=(-1, -1),
    alibi_slopes=None,
    deterministic=False,
):
    assert causal == True, "zigzag ring is meaningless for causal=False"
    world_size = process_group.size()
    outs = {}
    for rank, me in enumerate(process_group.ranks):
        q = q_by_rank[me]
        block_seq_len = q.shape[1] // 2
        q1 = q[:, block_seq_len:]

        out = None
        lse = None

        def forward(q, k, v, causal):
            block_out, _, _, _, _, block_lse, _, _ = _flash_attn_forward(
                q,
                k,
                v,
                dropout_p,
                softmax_scale,
                causal=causal,
                window_size=window_size,
                alibi_slopes=alibi_slopes,
                return_softmax=True and dropout_p > 0,
            )
            return block_out, block_lse

        for step in range(world_size):
            # RingComm.send_recv: at step s this rank holds the k, v of ring rank (rank - s)
            src = process_group.ranks[(rank - step) % world_size]
            k, v = k_by_rank[src], v_by_rank[src]
            if step == 0:
                block_out, block_lse = forward(q, k, v, causal=True)
                out, lse = update_out_and_lse(out, lse, block_out, block_lse)
            elif step <= rank:
                k0 = k[:, :block_seq_len]
                v0 = v[:, :block_seq_len]
                block_out, block_lse = forward(q, k0, v0, causal=False)
                out, lse = update_out_and_lse(out, lse, block_out, block_lse)
            else:
                block_out, block_lse = forward(q1, k, v, causal=False)
                out, lse = update_out_and_lse(
                    out,
                    lse,
                    block_out,
                    block_lse,
                    slice_=(slice(None), slice(block_seq_len, None)),
                )

        out = out.to(q.dtype)
        lse = lse.squeeze(dim=-1).transpose(1, 2)
        outs[me] = (out, lse)
    return outs


def zigzag_ring_flash_attn_qkvpacked_func(
    qkv_by_rank,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    group=None,
):
    any_qkv = next(iter(qkv_by_rank.values()))
    if softmax_scale is None:
        softmax_scale = any_qkv.shape[-1] ** (-0.5)
    q_by_rank = {r: x[:, :, 0] for r, x in qkv_by_rank.items()}
    k_by_rank = {r: x[:, :, 1] for r, x in qkv_by_rank.items()}
    v_by_rank = {r: x[:, :, 2] for r, x in qkv_by_rank.items()}
    outs = zigzag_ring_flash_attn_forward(
        group, q_by_rank, k_by_rank, v_by_rank, softmax_scale, dropout_p=dropout_p, causal=causal
    )
    return {r: o for r, (o, _) in outs.items()}


RING_IMPL_QKVPACKED_DICT = {"zigzag": zigzag_ring_flash_attn_qkvpacked_func}


# --------------------------------------------------------------------------------------------
# yunchang/hybrid/attn_layer.py LongContextAttentionQKVPacked
# --------------------------------------------------------------------------------------------


class LongContextAttentionQKVPacked(nn.Module):
    def __init__(self, scatter_idx: int = 3, gather_idx: int = 1, ring_impl_type: str = "basic") -> None:
        super().__init__()
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.ring_attn_fn = RING_IMPL_QKVPACKED_DICT[ring_impl_type]

    def forward(self, qkv_by_rank, dropout_p=0.0, softmax_scale=None, causal=False):
        # scatter 3, gather 1, once per Ulysses group
        ulysses_groups, ring_groups = {}, {}
        for r in qkv_by_rank:
            dist.current_rank = r
            ulysses_groups[tuple(PROCESS_GROUP.ULYSSES_PG.ranks)] = PROCESS_GROUP.ULYSSES_PG
            ring_groups[tuple(PROCESS_GROUP.RING_PG.ranks)] = PROCESS_GROUP.RING_PG

        gathered = {}
        for pg in ulysses_groups.values():
            if pg.size() > 1:
                gathered.update(SeqAllToAll5D.apply(pg, qkv_by_rank, self.scatter_idx, self.gather_idx))
            else:
                gathered.update({r: qkv_by_rank[r] for r in pg.ranks})

        out = {}
        for pg in ring_groups.values():
            out.update(
                self.ring_attn_fn(
                    {r: gathered[r] for r in pg.ranks},
                    dropout_p=dropout_p,
                    softmax_scale=softmax_scale,
                    causal=causal,
                    group=pg,
                )
            )

        # (bs, seq_len, head_cnt/N, head_size) -> (bs, seq_len/N, head_cnt, head_size)
        # scatter 1, gather 2
        result = {}
        for pg in ulysses_groups.values():
            if pg.size() > 1:
                result.update(SeqAllToAll4D.apply(pg, out, self.gather_idx, self.scatter_idx - 1))
            else:
                result.update({r: out[r] for r in pg.ranks})
        return result


# --------------------------------------------------------------------------------------------
# a tiny causal LM layer trained with USP + DP
# --------------------------------------------------------------------------------------------


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, position_ids, head_dim, theta=10000.0):
    # x (b, s, h, d); position_ids (b, s)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, :, None, :], emb.sin()[:, :, None, :]
    return x * cos + rotate_half(x) * sin


class TinyUSPLayer(nn.Module):
    def __init__(self, vocab_size=48, hidden=32, nheads=4, ring_impl_type="zigzag"):
        super().__init__()
        self.nheads, self.head_dim = nheads, hidden // nheads
        self.embed = nn.Embedding(vocab_size, hidden)
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)
        self.ring_impl_type = ring_impl_type
        self.attn = LongContextAttentionQKVPacked(ring_impl_type=ring_impl_type)


def train_step_loss(model, input_ids, labels, dp_rank, sp_ulysses_degree, sp_ring_degree):
    """One DP replica: every SP rank of the replica cuts its shard, then USP attention runs."""
    sp_degree = sp_ulysses_degree * sp_ring_degree
    extract = EXTRACT_FUNC_DICT[model.ring_impl_type]
    bsz, seqlen = input_ids.shape

    x = model.embed(input_ids)
    qkv = model.qkv_proj(x).view(bsz, seqlen, 3, model.nheads, model.head_dim)
    position_ids = torch.arange(seqlen).unsqueeze(0).expand(bsz, -1)

    local_qkv, local_pos, local_labels = {}, {}, {}
    for sp_local in range(sp_degree):
        rank = dp_rank * sp_degree + sp_local  # the global rank, as dist.get_rank() returns it
        dist.current_rank = rank
        local_qkv[rank] = extract(qkv, rank, world_size=sp_degree, rd=sp_ring_degree, ud=sp_ulysses_degree)
        local_pos[rank] = extract(
            position_ids[:, :, None, None], rank, world_size=sp_degree, rd=sp_ring_degree, ud=sp_ulysses_degree
        )[:, :, 0, 0]
        local_labels[rank] = extract(
            labels[:, :, None, None], rank, world_size=sp_degree, rd=sp_ring_degree, ud=sp_ulysses_degree
        )[:, :, 0, 0]

    for rank, t in local_qkv.items():
        q, k, v = t.unbind(dim=2)
        q = apply_rope(q, local_pos[rank], model.head_dim)
        k = apply_rope(k, local_pos[rank], model.head_dim)
        local_qkv[rank] = torch.stack([q, k, v], dim=2)

    local_out = model.attn(local_qkv, causal=True)

    loss_sum, n_tokens = 0.0, 0
    for rank, o in local_out.items():
        h = model.o_proj(o.reshape(bsz, -1, model.nheads * model.head_dim))
        logits = model.lm_head(h)
        lbl = local_labels[rank]
        loss_sum = loss_sum + F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), lbl.reshape(-1), ignore_index=-100, reduction="sum"
        )
        n_tokens += int((lbl != -100).sum())
    return loss_sum / n_tokens


def main():
    torch.manual_seed(0)
    world_size = dist.world_size
    sp_ulysses_degree, sp_ring_degree = 2, 2
    dp_degree = world_size // (sp_ulysses_degree * sp_ring_degree)

    for rank in range(world_size):
        set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size)

    model = TinyUSPLayer()
    bsz, seqlen, vocab = 2, 16, 48

    losses = []
    with torch.no_grad():
        for dp_rank in range(dp_degree):
            g = torch.Generator().manual_seed(100 + dp_rank)
            input_ids = torch.randint(0, vocab, (bsz, seqlen), generator=g)
            labels = torch.full_like(input_ids, -100)
            labels[:, :-1] = input_ids[:, 1:]
            loss = train_step_loss(model, input_ids, labels, dp_rank, sp_ulysses_degree, sp_ring_degree)
            losses.append(loss)
            print(f"dp replica {dp_rank}: loss {loss.item():.6f}")
    print(f"mean loss over DP replicas: {torch.stack(losses).mean().item():.6f}")


if __name__ == "__main__":
    main()
