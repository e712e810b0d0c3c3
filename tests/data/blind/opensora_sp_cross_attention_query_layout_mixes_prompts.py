"""Open-Sora STDiT3 with sequence parallelism: the text cross-attention lays the video queries out rank by rank
while the block-diagonal text mask expects them sample by sample.

Citation: hpcaitech/Open-Sora#510 (commit 0312a0d), "fix SeqParallelMultiHeadCrossAttention for consistent
results in distributed mode" (opensora/models/layers/blocks.py, ``SeqParallelMultiHeadCrossAttention.forward``).

STDiT3 packs the prompts of a batch into one [1, sum(y_lens), C] sequence (``encode_text``) and runs the
cross-attention as one xformers call over all samples, with
``BlockDiagonalMask.from_seqlens([N] * B, y_lens)``: the first N queries may only see the first y_lens[0]
text tokens, the next N queries the next y_lens[1] text tokens, and so on. Under sequence parallelism each
rank holds x of shape [B, SUB_N, C] (a slice of the spatial tokens) and an all-to-all gathers the sequence
and scatters the heads before the attention call.

The bug: ``q = self.q_linear(x).view(1, -1, heads, head_dim)`` folds the batch into the sequence *before*
the all-to-all, so the gathered queries come out as [rank0: b0, b1][rank1: b0, b1] instead of
[b0: rank0, rank1][b1: rank0, rank1]. The block-diagonal mask then hands half of sample 1's video tokens
sample 0's prompt (and the other way round), and the outputs go back to the wrong sample's tokens. With
batch size 1 nothing changes, so it only showed with B > 1 and SP on.

The fix: ``q = self.q_linear(x).view(B, -1, heads, head_dim)``, so the all-to-all gathers the sequence
per sample and the later ``view(1, -1, ...)`` is sample-major, matching ``[N] * B``.

The program runs two SP ranks on CPU (gloo; rank 0 is this process, rank 1 a spawned process), with the
project's all_to_all / split_forward_gather_backward and STDiT3's encode_text and spatial-token sharding,
toy sizes and random weights (einops' rearrange written as reshape). xformers is not installed here, so ``xformers.ops`` below is a stand-in with
the same call signatures that materializes the block-diagonal bias and calls SDPA on the [B, M, H, K]
layout.
"""

import os
import sys
import tempfile
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---- stand-in for xformers.ops (CPU) ----------------------------------------------------------------------
class _BlockDiagonalMask:
    def __init__(self, q_seqinfo, k_seqinfo):
        self.q_seqinfo = q_seqinfo
        self.k_seqinfo = k_seqinfo

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None):
        if kv_seqlen is None:
            kv_seqlen = q_seqlen
        return cls(list(q_seqlen), list(kv_seqlen))

    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        Mq, Mk = shape[-2], shape[-1]
        bias = torch.full((Mq, Mk), float("-inf"), dtype=dtype, device=device)
        q0 = k0 = 0
        for ql, kl in zip(self.q_seqinfo, self.k_seqinfo):
            bias[q0 : q0 + ql, k0 : k0 + kl] = 0
            q0 += ql
            k0 += kl
        return bias


def _memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None):
    # xformers layout: [B, M, H, K]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    mask = None
    if attn_bias is not None:
        mask = attn_bias.materialize((q.shape[-2], k.shape[-2]), dtype=q.dtype, device=q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=scale)
    return out.transpose(1, 2)


xformers = types.SimpleNamespace(
    ops=types.SimpleNamespace(
        fmha=types.SimpleNamespace(BlockDiagonalMask=_BlockDiagonalMask),
        memory_efficient_attention=_memory_efficient_attention,
    )
)


# ---- opensora/acceleration/parallel_states.py -------------------------------------------------------------
_GLOBAL_PARALLEL_GROUPS = dict()


def set_sequence_parallel_group(group: dist.ProcessGroup):
    _GLOBAL_PARALLEL_GROUPS["sequence"] = group


def get_sequence_parallel_group():
    return _GLOBAL_PARALLEL_GROUPS.get("sequence", None)


# ---- opensora/acceleration/communications.py --------------------------------------------------------------
def _all_to_all(
    input_: torch.Tensor,
    world_size: int,
    group: dist.ProcessGroup,
    scatter_dim: int,
    gather_dim: int,
):
    input_list = [t.contiguous() for t in torch.tensor_split(input_, world_size, scatter_dim)]
    output_list = [torch.empty_like(input_list[0]) for _ in range(world_size)]
    dist.all_to_all(output_list, input_list, group=group)
    return torch.cat(output_list, dim=gather_dim).contiguous()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, process_group, scatter_dim, gather_dim):
        ctx.process_group = process_group
        ctx.scatter_dim = scatter_dim
        ctx.gather_dim = gather_dim
        ctx.world_size = dist.get_world_size(process_group)
        output = _all_to_all(input_, ctx.world_size, process_group, scatter_dim, gather_dim)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grad_output = _all_to_all(grad_output, ctx.world_size, ctx.process_group, ctx.gather_dim, ctx.scatter_dim)
        return (grad_output, None, None, None)


def all_to_all(input_: torch.Tensor, process_group: dist.ProcessGroup, scatter_dim: int = 2, gather_dim: int = 1):
    return _AllToAll.apply(input_, process_group, scatter_dim, gather_dim)


def _split(input_, pg: dist.ProcessGroup, dim=-1):
    world_size = dist.get_world_size(pg)
    rank = dist.get_rank(pg)
    if world_size == 1:
        return input_
    dim_size = input_.size(dim)
    assert dim_size % world_size == 0
    tensor_list = torch.split(input_, dim_size // world_size, dim=dim)
    output = tensor_list[rank].contiguous()
    return output


class _SplitForwardGatherBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, process_group, dim, grad_scale):
        ctx.mode = process_group
        ctx.dim = dim
        ctx.grad_scale = grad_scale
        return _split(input_, process_group, dim)


def split_forward_gather_backward(input_, process_group, dim, grad_scale=1.0):
    return _SplitForwardGatherBackward.apply(input_, process_group, dim, grad_scale)


# ---- opensora/models/layers/blocks.py ---------------------------------------------------------------------
class MultiHeadCrossAttention(nn.Module):
    def __init__(self, d_model, num_heads, attn_drop=0.0, proj_drop=0.0):
        super(MultiHeadCrossAttention, self).__init__()
        assert d_model % num_heads == 0, "d_model must be divisible by num_heads"

        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads

        self.q_linear = nn.Linear(d_model, d_model)
        self.kv_linear = nn.Linear(d_model, d_model * 2)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(d_model, d_model)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, cond, mask=None):
        # query/value: img tokens; key: condition; mask: if padding tokens
        B, N, C = x.shape

        q = self.q_linear(x).view(1, -1, self.num_heads, self.head_dim)
        kv = self.kv_linear(cond).view(1, -1, 2, self.num_heads, self.head_dim)
        k, v = kv.unbind(2)

        attn_bias = None
        if mask is not None:
            attn_bias = xformers.ops.fmha.BlockDiagonalMask.from_seqlens([N] * B, mask)
        x = xformers.ops.memory_efficient_attention(q, k, v, p=self.attn_drop.p, attn_bias=attn_bias)

        x = x.view(B, -1, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class SeqParallelMultiHeadCrossAttention(MultiHeadCrossAttention):
    def __init__(self, d_model, num_heads, attn_drop=0.0, proj_drop=0.0):
        super().__init__(d_model=d_model, num_heads=num_heads, attn_drop=attn_drop, proj_drop=proj_drop)

    def forward(self, x, cond, mask=None):
        # query/value: img tokens; key: condition; mask: if padding tokens
        sp_group = get_sequence_parallel_group()
        sp_size = dist.get_world_size(sp_group)
        B, SUB_N, C = x.shape  # [B, TS/p, C]
        N = SUB_N * sp_size

        # shape:
        # q, k, v: [B, SUB_N, NUM_HEADS, HEAD_DIM]
        if FIXED:
            q = self.q_linear(x).view(B, -1, self.num_heads, self.head_dim)
        else:
            q = self.q_linear(x).view(1, -1, self.num_heads, self.head_dim)
        kv = self.kv_linear(cond).view(1, -1, 2, self.num_heads, self.head_dim)
        kv = split_forward_gather_backward(kv, get_sequence_parallel_group(), dim=3, grad_scale="down")
        k, v = kv.unbind(2)

        # apply all_to_all to gather sequence and split attention heads
        q = all_to_all(q, sp_group, scatter_dim=2, gather_dim=1)

        q = q.view(1, -1, self.num_heads // sp_size, self.head_dim)
        k = k.view(1, -1, self.num_heads // sp_size, self.head_dim)
        v = v.view(1, -1, self.num_heads // sp_size, self.head_dim)

        # compute attention
        attn_bias = None
        if mask is not None:
            attn_bias = xformers.ops.fmha.BlockDiagonalMask.from_seqlens([N] * B, mask)
        x = xformers.ops.memory_efficient_attention(q, k, v, p=self.attn_drop.p, attn_bias=attn_bias)

        # apply all to all to gather back attention heads and scatter sequence
        x = x.view(B, -1, self.num_heads // sp_size, self.head_dim)
        x = all_to_all(x, sp_group, scatter_dim=1, gather_dim=2)

        # apply output projection
        x = x.view(B, -1, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class CaptionEmbedder(nn.Module):
    """Embeds class labels into vector representations (timm Mlp y_proj, eval mode: no caption dropout)."""

    def __init__(self, in_channels, hidden_size, token_num=120):
        super().__init__()
        self.y_proj = nn.Sequential(
            nn.Linear(in_channels, hidden_size), nn.GELU(approximate="tanh"), nn.Linear(hidden_size, hidden_size)
        )
        self.register_buffer("y_embedding", torch.randn(token_num, in_channels) / in_channels**0.5)

    def forward(self, caption, train):
        return self.y_proj(caption)


# ---- opensora/models/stdit/stdit3.py (trimmed: text encoding, spatial sharding, spatial cross-attention) ----
class STDiT3Config:
    def __init__(self, hidden_size=32, num_heads=4, caption_channels=24, model_max_length=8, depth=2,
                 enable_sequence_parallelism=True):
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.caption_channels = caption_channels
        self.model_max_length = model_max_length
        self.depth = depth
        self.enable_sequence_parallelism = enable_sequence_parallelism


class STDiT3Block(nn.Module):
    def __init__(self, hidden_size, num_heads, temporal=False, enable_sequence_parallelism=False):
        super().__init__()
        self.temporal = temporal
        self.enable_sequence_parallelism = enable_sequence_parallelism
        if self.enable_sequence_parallelism and not temporal:
            mha_cls = SeqParallelMultiHeadCrossAttention
        else:
            mha_cls = MultiHeadCrossAttention
        self.cross_attn = mha_cls(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, eps=1e-6, elementwise_affine=False)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, 2 * hidden_size), nn.GELU(approximate="tanh"), nn.Linear(2 * hidden_size, hidden_size)
        )

    def forward(self, x, y, mask=None, T=None, S=None):
        # cross attention
        x = x + self.cross_attn(x, y, mask)
        x = x + self.mlp(self.norm2(x))
        return x


class STDiT3(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.enable_sequence_parallelism = config.enable_sequence_parallelism
        self.y_embedder = CaptionEmbedder(config.caption_channels, config.hidden_size, config.model_max_length)
        self.spatial_blocks = nn.ModuleList(
            [
                STDiT3Block(config.hidden_size, config.num_heads,
                            enable_sequence_parallelism=config.enable_sequence_parallelism)
                for _ in range(config.depth)
            ]
        )

    def encode_text(self, y, mask=None):
        y = self.y_embedder(y, self.training)  # [B, 1, N_token, C]
        if mask is not None:
            if mask.shape[0] != y.shape[0]:
                mask = mask.repeat(y.shape[0] // mask.shape[0], 1)
            mask = mask.squeeze(1).squeeze(1)
            y = y.squeeze(1).masked_select(mask.unsqueeze(-1) != 0).view(1, -1, self.hidden_size)
            y_lens = mask.sum(dim=1).tolist()
        else:
            y_lens = [y.shape[2]] * y.shape[0]
            y = y.squeeze(1).view(1, -1, self.hidden_size)
        return y, y_lens

    def forward(self, x, y, mask=None):
        # x: already patch-embedded video tokens [B, T, S, C]
        B, T, S, C = x.shape
        y, y_lens = self.encode_text(y, mask)

        # shard over the sequence dim if sp is enabled
        if self.enable_sequence_parallelism:
            x = split_forward_gather_backward(x, get_sequence_parallel_group(), dim=2, grad_scale="down")
            S = S // dist.get_world_size(get_sequence_parallel_group())

        x = x.reshape(B, T * S, C)  # rearrange(x, "B T S C -> B (T S) C")
        for spatial_block in self.spatial_blocks:
            x = spatial_block(x, y, y_lens, T, S)
        x = x.reshape(B, T, S, C)  # rearrange(x, "B (T S) C -> B T S C")
        return x


# ---- driver: one sampling step of two prompts on 2 SP ranks ----------------------------------------------
def run(rank, world_size, init_file, fixed):
    global FIXED
    FIXED = fixed
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    set_sequence_parallel_group(dist.group.WORLD)

    torch.manual_seed(0)
    config = STDiT3Config()
    model = STDiT3(config).eval()

    B, T, S = 2, 2, 8
    x = torch.randn(B, T, S, config.hidden_size)  # patch-embedded latents of 2 videos
    y = 4.0 * torch.randn(B, 1, config.model_max_length, config.caption_channels)  # T5 features, padded to 8 tokens
    mask = torch.zeros(B, config.model_max_length, dtype=torch.long)
    mask[0, :3] = 1  # "a cat"
    mask[1, :7] = 1  # a longer prompt

    with torch.no_grad():
        out = model(x, y, mask)  # [B, T, S/sp, C] on this rank
        parts = [torch.empty_like(out) for _ in range(world_size)]
        dist.all_gather(parts, out.contiguous())
        out = torch.cat(parts, dim=2)  # [B, T, S, C]

    if rank == 0:
        for b in range(B):
            print(f"video {b}: mean {out[b].mean().item():+.6f}  |out| {out[b].norm().item():.6f}")
            print(f"  frame0 token0 {[round(v, 4) for v in out[b, 0, 0, :4].tolist()]}")
    dist.barrier()
    dist.destroy_process_group()


def _peer(rank, world_size, init_file, fixed):
    run(rank, world_size, init_file, fixed)
    sys.stdout.flush()
    os._exit(0)


def main():
    world_size = 2
    fd, init_file = tempfile.mkstemp(prefix="opensora_sp_")
    os.close(fd)
    os.remove(init_file)
    ctx = mp.get_context("spawn")
    peer = ctx.Process(target=_peer, args=(1, world_size, init_file, FIXED))
    peer.start()
    try:
        run(0, world_size, init_file, FIXED)
    finally:
        peer.join()
        if os.path.exists(init_file):
            os.remove(init_file)
    if peer.exitcode != 0:
        sys.exit(peer.exitcode)


if __name__ == "__main__":
    main()
