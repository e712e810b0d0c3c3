# Citation: lucidrains/ring-attention-pytorch commit 57cf3fc
#   ("make sure to subject mask to ring passes if present, within RingFlashAttention").
# Upstream: ring_attention_pytorch/ring_flash_attention.py, RingFlashAttentionFunction.forward
#   (with ring_attention_pytorch/ring.py all_ring_pass / one_ring_pass at the same commit).
# Bug: the key padding mask was split into column tiles once, from the local shard, and that
#   local mask was applied to every (k, v) block received over the ring, so each rank masked
#   the other ranks' keys with its own padding pattern.
# Fix: the mask is ring-passed together with k and v (`ring_pass_fn(k, v, row_mask)`) and
#   split per column tile of the block actually received (`maybe_split`).
#
# Port notes: torch.distributed is replaced by an in-process thread group (one thread per rank,
# isend / recv / barrier through a mailbox) so that OneRingPass's send-right / receive-left runs
# as written; get_rank is per thread (not lru_cached); einx's rearrange of the 2-D mask is
# written with indexing; only the forward pass is ported.  Sizes follow upstream's assumptions
# (every shard the same length; per-machine length = k_bucket_size ** 2, which is what
# maybe_split's `chunk` lines up with; one query tile per rank, since the ring loop rebinds k, v).

import sys
import math
import threading
from functools import wraps
from typing import Optional

import torch
from torch import nn, einsum, Tensor
from torch.autograd.function import Function

FIXED = "--fixed" in sys.argv

# ---------------------------------------------------------------- simulated torch.distributed

class _ThreadGroup:
    def __init__(self, world_size):
        self.world_size = world_size
        self.local = threading.local()
        self.cond = threading.Condition()
        self.mailbox = {}
        self.bar = threading.Barrier(world_size)

_GROUP: Optional[_ThreadGroup] = None

class _Req:
    def wait(self):
        pass

class dist:
    @staticmethod
    def is_initialized():
        return _GROUP is not None

    @staticmethod
    def get_rank():
        return _GROUP.local.rank

    @staticmethod
    def get_world_size():
        return _GROUP.world_size

    @staticmethod
    def isend(x, dst):
        with _GROUP.cond:
            _GROUP.mailbox[(dist.get_rank(), dst)] = x.clone()
            _GROUP.cond.notify_all()
        return _Req()

    @staticmethod
    def recv(buf, src):
        key = (src, dist.get_rank())
        with _GROUP.cond:
            while key not in _GROUP.mailbox:
                _GROUP.cond.wait()
            buf.copy_(_GROUP.mailbox.pop(key))

    @staticmethod
    def barrier():
        _GROUP.bar.wait()

# ---------------------------------------------------------------- ring.py

def exists(v):
    return v is not None

def default(v, d):
    return v if exists(v) else d

def maybe(fn):
    @wraps(fn)
    def inner(t, *args, **kwargs):
        if not exists(t):
            return None
        return fn(t, *args, **kwargs)
    return inner

def get_rank():
    return dist.get_rank() if dist.is_initialized() else 0

def get_world_size():
    return dist.get_world_size() if dist.is_initialized() else 1

def is_distributed():
    return dist.is_initialized() and dist.get_world_size() > 1

def circular_index_left(pos, ring_size):
    return ((pos - 1) + ring_size) % ring_size

def circular_index_right(pos, ring_size):
    return (pos + 1) % ring_size

def circular_rank_left(rank = None, ring_size = None):
    rank = default(rank, get_rank())
    ring_size = default(ring_size, get_world_size())
    return circular_index_left(rank, ring_size)

def circular_rank_right(rank = None, ring_size = None):
    rank = default(rank, get_rank())
    ring_size = default(ring_size, get_world_size())
    return circular_index_right(rank, ring_size)

def send_and_receive_(x, receive_buffer, send_to_rank, receive_from_rank):
    send_request = dist.isend(x, send_to_rank)
    dist.recv(receive_buffer, receive_from_rank)

    send_request.wait()
    dist.barrier()

class OneRingPass(Function):
    """ one ring pass to the right - assume tensor is all same shape for now """

    @staticmethod
    def forward(ctx, x):
        receive_buffer = torch.zeros_like(x)
        send_and_receive_(x, receive_buffer, circular_rank_right(), circular_rank_left())
        return receive_buffer

    @staticmethod
    def backward(ctx, grads):
        receive_buffer = torch.zeros_like(grads)
        send_and_receive_(grads, receive_buffer, circular_rank_left(), circular_rank_right())
        return receive_buffer

one_ring_pass = OneRingPass.apply

def null_ring_pass(*tensors):
    yield 0, tuple(tensors)

def all_ring_pass(*tensors):
    num_passes = 0
    curr_rank = get_rank()
    world_size = get_world_size()

    while num_passes < world_size:

        curr_rank = (curr_rank + num_passes) % world_size

        yield curr_rank, tuple(tensors)

        num_passes += 1

        if num_passes >= world_size:
            continue

        tensors = tuple(map(maybe(one_ring_pass), tensors))

# ---------------------------------------------------------------- ring_flash_attention.py

EPSILON = 1e-10

def none_iterator():
    while True:
        yield None

def maybe_split(t, size, dim = -2):
    if not exists(t):
        return none_iterator()

    return t.chunk(size, dim = dim)

def rearrange_b_n_to_b_1_1_n(mask):
    # einx: rearrange('b n -> b 1 1 n', mask)
    return mask[:, None, None, :]

class RingFlashAttentionFunction(Function):

    @staticmethod
    @torch.no_grad()
    def forward(
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Optional[Tensor],
        causal: bool,
        q_bucket_size: int,
        k_bucket_size: int,
        ring_reduce_col: bool
    ):
        """ Algorithm 1 in the v2 paper """

        orig_k, orig_v, device = k, v, q.device

        per_machine_col_size = k.shape[-2]
        ring_pass_fn = all_ring_pass if ring_reduce_col else null_ring_pass

        max_neg_value = -torch.finfo(q.dtype).max
        qk_len_diff = max(k.shape[-2] - q.shape[-2], 0)

        o = torch.zeros_like(q)
        all_row_sums = torch.zeros((*q.shape[:-1], 1), device = device)
        all_row_maxes = torch.full((*q.shape[:-1], 1), max_neg_value, device = device)

        scale = (q.shape[-1] ** -0.5)

        num_row_tiles = math.ceil(q.shape[-2] / q_bucket_size)
        num_col_tiles = math.ceil(k.shape[-2] / k_bucket_size)

        if not FIXED:
            if exists(mask) and mask.ndim == 2:
                mask = rearrange_b_n_to_b_1_1_n(mask)

            if not exists(mask):
                col_masks = (None,) * num_col_tiles
                mask = (col_masks,) * num_row_tiles
            else:
                mask = ((mask,) * num_row_tiles) if mask.shape[-2] == 1 else mask.split(q_bucket_size, dim = -2)
                mask = tuple(((row_mask,) * num_col_tiles) if row_mask.shape[-1] == 1 else row_mask.split(k_bucket_size, dim = -1) for row_mask in mask)
        else:
            if exists(mask):
                if mask.ndim == 2:
                    mask = rearrange_b_n_to_b_1_1_n(mask)

                mask = ((mask,) * num_row_tiles) if mask.shape[-2] == 1 else mask.split(q_bucket_size, dim = -2)
            else:
                mask = (None,) * num_row_tiles

        row_splits = zip(
            q.split(q_bucket_size, dim = -2),
            o.split(q_bucket_size, dim = -2),
            mask,
            all_row_sums.split(q_bucket_size, dim = -2),
            all_row_maxes.split(q_bucket_size, dim = -2),
        )

        for ind, (qc, oc, row_mask, row_sums, row_maxes) in enumerate(row_splits):
            q_start_index = ind * q_bucket_size - qk_len_diff

            if not FIXED:
                ring_iter = ((ring_rank, (k, v, row_mask)) for ring_rank, (k, v) in ring_pass_fn(k, v))
            else:
                ring_iter = ring_pass_fn(k, v, row_mask)

            for ring_rank, (k, v, ring_row_mask) in ring_iter:

                per_machine_col_offset = ring_rank * per_machine_col_size

                col_splits = zip(
                    k.split(k_bucket_size, dim = -2),
                    v.split(k_bucket_size, dim = -2),
                    ring_row_mask if not FIXED else maybe_split(ring_row_mask, k_bucket_size, dim = -1)
                )

                for k_ind, (kc, vc, col_mask) in enumerate(col_splits):
                    k_start_index = k_ind * k_bucket_size + per_machine_col_offset

                    attn_weights = einsum('... i d, ... j d -> ... i j', qc, kc) * scale

                    if exists(col_mask):
                        attn_weights.masked_fill_(~col_mask, max_neg_value)

                    if causal and q_start_index < (k_start_index + k_bucket_size - 1):
                        causal_mask = torch.ones((qc.shape[-2], kc.shape[-2]), dtype = torch.bool, device = device).triu(q_start_index - k_start_index + 1)
                        attn_weights.masked_fill_(causal_mask, max_neg_value)

                    block_row_maxes = attn_weights.amax(dim = -1, keepdims = True)
                    new_row_maxes = torch.maximum(block_row_maxes, row_maxes)

                    exp_weights = torch.exp(attn_weights - new_row_maxes)

                    if exists(col_mask):
                        exp_weights.masked_fill_(~col_mask, 0.)

                    block_row_sums = exp_weights.sum(dim = -1, keepdims = True).clamp(min = EPSILON)

                    exp_values = einsum('... i j, ... j d -> ... i d', exp_weights, vc)

                    exp_row_max_diff = torch.exp(row_maxes - new_row_maxes)

                    new_row_sums = exp_row_max_diff * row_sums + block_row_sums

                    oc.mul_(exp_row_max_diff).add_(exp_values)

                    row_maxes.copy_(new_row_maxes)
                    row_sums.copy_(new_row_sums)

            oc.div_(row_sums)

        lse = all_row_sums.log() + all_row_maxes

        ctx.save_for_backward(q, orig_k, orig_v, o, lse)

        return o

ring_flash_attn = RingFlashAttentionFunction.apply

# ---------------------------------------------------------------- a tiny encoder layer run over the ring

class RingFlashSelfAttention(nn.Module):
    def __init__(self, dim, dim_head = 8, heads = 2, q_bucket_size = 4, k_bucket_size = 2):
        super().__init__()
        self.heads = heads
        self.q_bucket_size = q_bucket_size
        self.k_bucket_size = k_bucket_size
        dim_inner = dim_head * heads
        self.to_qkv = nn.Linear(dim, dim_inner * 3, bias = False)
        self.to_out = nn.Linear(dim_inner, dim, bias = False)

    def forward(self, x, mask = None):
        b, n, _ = x.shape
        qkv = self.to_qkv(x)
        q, k, v = qkv.reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = ring_flash_attn(q, k, v, mask, False, self.q_bucket_size, self.k_bucket_size, is_distributed())
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


def main():
    global _GROUP
    torch.manual_seed(0)
    torch.set_num_threads(1)

    world_size, per_rank, dim = 4, 4, 16
    seq_len = world_size * per_rank
    lengths = torch.tensor([16, 10, 7])
    batch = len(lengths)

    layer = RingFlashSelfAttention(dim)
    head = nn.Linear(dim, 3)
    x = torch.randn(batch, seq_len, dim)
    mask = torch.arange(seq_len)[None, :] < lengths[:, None]      # right-padded key padding mask
    x = x.masked_fill(~mask[..., None], 0.)
    labels = torch.tensor([0, 2, 1])

    _GROUP = _ThreadGroup(world_size)
    outs = [None] * world_size

    def run(rank):
        _GROUP.local.rank = rank
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        outs[rank] = layer(x[:, sl], mask = mask[:, sl])

    threads = [threading.Thread(target = run, args = (r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _GROUP = None

    out = torch.cat(outs, dim = 1)                                  # gather the shards
    m = mask[..., None].float()
    pooled = (out * m).sum(1) / m.sum(1)
    logits = head(pooled)
    loss = nn.functional.cross_entropy(logits, labels)

    print("mode:", "fixed" if FIXED else "buggy")
    print("pooled[:, :4]:", [[round(v, 4) for v in row] for row in pooled[:, :4].tolist()])
    print("out norm per row:", [round(v, 4) for v in out.norm(dim = (1, 2)).tolist()])
    print("loss:", round(loss.item(), 6))


if __name__ == "__main__":
    main()
