"""FastVideo Video Sparse Attention (VSA): the number of key tiles each query tile keeps was counted
from the unpadded token count, so videos whose latent grid is not a multiple of the tile keep too few.

Citation: hao-ai-lab/FastVideo#1517 (commit 00ec3e738, "[bugfix]: compute VSA topk from padded blocks"),
fastvideo/attention/backends/video_sparse_attn.py (``VideoSparseAttentionImpl.forward``) and
fastvideo-kernel/python/fastvideo_kernel/ops.py (``video_sparse_attn``).

VSA cuts the (T, H, W) latent grid of a video DiT into (4, 4, 4) tiles (64 tokens; the last tile
along a dimension may be partial and is zero-padded to 64, ``variable_block_sizes`` holds the real
token count of every tile). A coarse branch attends between tile means, and each query tile then
keeps its ``topk`` best key tiles for the fine block-sparse branch (``fused_topk_mask`` on the coarse
scores, handed to ``block_sparse_attn`` as its block mask).

The bug: ``cur_topk = ceil((1 - VSA_sparsity) * (total_seq_length / 64))``: the unpadded token count
over 64 is smaller than the number of tiles whenever a tile is partial, so every query tile keeps
fewer key tiles than the sparsity asks for.

The fix: ``cur_topk = ceil((1 - VSA_sparsity) * variable_block_sizes.numel())`` (the number of padded
tiles), clamped to [1, num_kv_blocks].

This program keeps the metadata builder (tile partition, variable block sizes, non-pad index), the
impl's tile / forward / untile, and ``video_sparse_attn`` with its compress branch and topk mask
written as the project's torch form (view/sum/div by vbs; topk -> zeros -> scatter_) and the sparse
branch as a masked softmax over the tiles kept (the kernels' CPU reference), inside one Wan-style
self-attention layer with a ``to_gate_compress`` projection, random weights, a (5, 6, 6) latent grid
and VSA_sparsity 0.75.
"""

import functools
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

VSA_TILE_SIZE = (4, 4, 4)


# --- fastvideo/attention/backends/video_sparse_attn.py -------------------------------------------

@functools.lru_cache(maxsize=10)
def get_tile_partition_indices(dit_seq_shape, tile_size, device):
    T, H, W = dit_seq_shape
    ts, hs, ws = tile_size
    indices = torch.arange(T * H * W, device=device, dtype=torch.long).reshape(T, H, W)
    ls = []
    for t in range(math.ceil(T / ts)):
        for h in range(math.ceil(H / hs)):
            for w in range(math.ceil(W / ws)):
                ls.append(indices[t * ts:min(t * ts + ts, T), h * hs:min(h * hs + hs, H),
                                  w * ws:min(w * ws + ws, W)].flatten())
    index = torch.cat(ls, dim=0)
    return index


@functools.lru_cache(maxsize=10)
def get_reverse_tile_partition_indices(dit_seq_shape, tile_size, device):
    return torch.argsort(get_tile_partition_indices(dit_seq_shape, tile_size, device))


@functools.lru_cache(maxsize=10)
def construct_variable_block_sizes(dit_seq_shape, num_tiles, device):
    t, h, w = dit_seq_shape
    ts_t, ts_h, ts_w = VSA_TILE_SIZE
    n_t, n_h, n_w = num_tiles

    def _sizes(dim_len, tile, n_tiles):
        sizes = torch.full((n_tiles, ), tile, dtype=torch.int, device=device)
        remainder = dim_len - (n_tiles - 1) * tile
        sizes[-1] = remainder if remainder > 0 else tile
        return sizes

    t_sizes = _sizes(t, ts_t, n_t)
    h_sizes = _sizes(h, ts_h, n_h)
    w_sizes = _sizes(w, ts_w, n_w)

    block_sizes = (t_sizes[:, None, None] * h_sizes[None, :, None] * w_sizes[None, None, :]).reshape(-1)
    return block_sizes


@functools.lru_cache(maxsize=10)
def get_non_pad_index(variable_block_sizes, max_block_size):
    n_win = variable_block_sizes.shape[0]
    device = variable_block_sizes.device
    starts_pad = torch.arange(n_win, device=device) * max_block_size
    index_pad = starts_pad[:, None] + torch.arange(max_block_size, device=device)[None, :]
    index_mask = torch.arange(max_block_size, device=device)[None, :] < variable_block_sizes[:, None]
    return index_pad[index_mask]


@dataclass
class VideoSparseAttentionMetadata:
    current_timestep: int
    dit_seq_shape: list
    VSA_sparsity: float
    num_tiles: list
    total_seq_length: int
    tile_partition_indices: torch.LongTensor
    reverse_tile_partition_indices: torch.LongTensor
    variable_block_sizes: torch.LongTensor
    non_pad_index: torch.LongTensor
    untile_combined_index: torch.LongTensor
    tile_buf: torch.Tensor = None
    cache_tile_buf: bool = True


class VideoSparseAttentionMetadataBuilder:

    def build(self, current_timestep, raw_latent_shape, patch_size, VSA_sparsity, device, cache_tile_buf=True):
        dit_seq_shape = (raw_latent_shape[0] // patch_size[0], raw_latent_shape[1] // patch_size[1],
                         raw_latent_shape[2] // patch_size[2])

        num_tiles = (math.ceil(dit_seq_shape[0] / VSA_TILE_SIZE[0]), math.ceil(dit_seq_shape[1] / VSA_TILE_SIZE[1]),
                     math.ceil(dit_seq_shape[2] / VSA_TILE_SIZE[2]))
        total_seq_length = math.prod(dit_seq_shape)

        tile_partition_indices = get_tile_partition_indices(dit_seq_shape, VSA_TILE_SIZE, device)
        reverse_tile_partition_indices = get_reverse_tile_partition_indices(dit_seq_shape, VSA_TILE_SIZE, device)
        variable_block_sizes = construct_variable_block_sizes(dit_seq_shape, num_tiles, device)
        non_pad_index = get_non_pad_index(variable_block_sizes, math.prod(VSA_TILE_SIZE))
        untile_combined_index = non_pad_index[reverse_tile_partition_indices]

        return VideoSparseAttentionMetadata(
            current_timestep=current_timestep,
            dit_seq_shape=dit_seq_shape,
            VSA_sparsity=VSA_sparsity,
            num_tiles=num_tiles,
            total_seq_length=total_seq_length,
            tile_partition_indices=tile_partition_indices,
            reverse_tile_partition_indices=reverse_tile_partition_indices,
            variable_block_sizes=variable_block_sizes,
            non_pad_index=non_pad_index,
            untile_combined_index=untile_combined_index,
            cache_tile_buf=cache_tile_buf)


def _compute_cur_topk(attn_metadata):
    num_kv_blocks = attn_metadata.variable_block_sizes.numel()
    cur_topk = math.ceil((1 - attn_metadata.VSA_sparsity) * num_kv_blocks)
    return max(1, min(cur_topk, num_kv_blocks))


# --- fastvideo-kernel: video_sparse_attn (torch forms) ---------------------------------------------

def block_mean(x, variable_block_sizes, block_elements):
    # original compress: .view() -> .float() -> .sum(dim=3) -> / vbs
    b, h, s, d = x.shape
    nb = s // block_elements
    out = x.view(b, h, nb, block_elements, d).float().sum(dim=3) / variable_block_sizes.view(1, 1, nb, 1)
    return out.to(x.dtype)


def topk_mask(scores, topk):
    # original topk: torch.topk() -> zeros() -> scatter_()
    topk_idx = torch.topk(scores, topk, dim=-1).indices
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask.scatter_(-1, topk_idx, True)
    return mask


def block_sparse_attn(q, k, v, block_mask, variable_block_sizes):
    # CPU reference of the block-sparse kernel: a query tile reads only the key tiles set in
    # block_mask, and only the real (non-padded) tokens of each key tile.
    b, h, s, d = q.shape
    block_elements = math.prod(VSA_TILE_SIZE)
    nb = s // block_elements
    token_valid = (torch.arange(block_elements)[None, :] < variable_block_sizes[:, None]).reshape(-1)
    full_mask = block_mask.repeat_interleave(block_elements, dim=-2).repeat_interleave(block_elements, dim=-1)
    full_mask = full_mask & token_valid.view(1, 1, 1, nb * block_elements)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)
    scores = scores.masked_fill(~full_mask, float("-inf"))
    attn = torch.softmax(scores, dim=-1)
    return torch.matmul(attn, v), None


def video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size=64,
                      compress_attn_weight=None):
    if isinstance(block_size, int):
        block_size = (block_size, block_size, block_size)
    block_elements = block_size[0] * block_size[1] * block_size[2]

    batch, heads, q_seq_len, dim = q.shape
    q_num_blocks = q_seq_len // block_elements

    q_c = block_mean(q, q_variable_block_sizes, block_elements)
    k_c = block_mean(k, variable_block_sizes, block_elements)
    v_c = block_mean(v, variable_block_sizes, block_elements)

    scores = torch.matmul(q_c, k_c.transpose(-2, -1)) / (dim ** 0.5)
    attn = torch.softmax(scores, dim=-1)
    out_c = torch.matmul(attn, v_c)
    out_c = out_c.view(batch, heads, q_num_blocks, 1, dim)
    out_c = out_c.repeat(1, 1, 1, block_elements, 1).view(batch, heads, q_seq_len, dim)

    mask = topk_mask(scores, topk)

    out_s = block_sparse_attn(q, k, v, mask, variable_block_sizes)[0]

    if compress_attn_weight is not None:
        return out_c * compress_attn_weight + out_s
    return out_c + out_s


class VideoSparseAttentionImpl:

    def tile(self, x, attn_metadata):
        num_tiles = attn_metadata.num_tiles
        t_padded_size = num_tiles[0] * VSA_TILE_SIZE[0]
        h_padded_size = num_tiles[1] * VSA_TILE_SIZE[1]
        w_padded_size = num_tiles[2] * VSA_TILE_SIZE[2]
        target_shape = (x.shape[0], t_padded_size * h_padded_size * w_padded_size, x.shape[-2], x.shape[-1])

        if not attn_metadata.cache_tile_buf:
            buf = torch.zeros(target_shape, device=x.device, dtype=x.dtype)
            buf[:, attn_metadata.non_pad_index] = x[:, attn_metadata.tile_partition_indices]
            return buf

        buf = attn_metadata.tile_buf
        if (buf is None or buf.shape != target_shape or buf.dtype != x.dtype or buf.device != x.device):
            buf = torch.zeros(target_shape, device=x.device, dtype=x.dtype)
            attn_metadata.tile_buf = buf

        buf[:, attn_metadata.non_pad_index] = x[:, attn_metadata.tile_partition_indices]
        return buf

    def untile(self, x, untile_combined_index):
        return x[:, untile_combined_index]

    def preprocess_qkv(self, qkv, attn_metadata):
        return self.tile(qkv, attn_metadata)

    def postprocess_output(self, output, attn_metadata):
        return self.untile(output, attn_metadata.untile_combined_index)

    def forward(self, query, key, value, gate_compress, attn_metadata):
        block_elements = math.prod(VSA_TILE_SIZE)
        if FIXED:
            cur_topk = _compute_cur_topk(attn_metadata)
        else:
            VSA_sparsity = attn_metadata.VSA_sparsity
            cur_topk = math.ceil((1 - VSA_sparsity) * (attn_metadata.total_seq_length / block_elements))

        query = query.transpose(1, 2).contiguous()
        key = key.transpose(1, 2).contiguous()
        value = value.transpose(1, 2).contiguous()
        gate_compress = gate_compress.transpose(1, 2).contiguous()
        return video_sparse_attn(query,
                                 key,
                                 value,
                                 attn_metadata.variable_block_sizes,
                                 attn_metadata.variable_block_sizes,
                                 cur_topk,
                                 block_size=VSA_TILE_SIZE,
                                 compress_attn_weight=gate_compress).transpose(1, 2)


# --- a Wan self-attention layer on the VSA backend (WanTransformerBlock_VSA's attn1) ---------------

class WanVSASelfAttention(nn.Module):

    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_gate_compress = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.impl = VideoSparseAttentionImpl()

    def forward(self, x, attn_metadata):
        b, s, _ = x.shape
        n, d = self.num_heads, self.head_dim
        q = self.to_q(x).view(b, s, n, d)
        k = self.to_k(x).view(b, s, n, d)
        v = self.to_v(x).view(b, s, n, d)
        g = self.to_gate_compress(x).view(b, s, n, d)

        qkvg = torch.cat([q, k, v, g], dim=0)
        qkvg = self.impl.preprocess_qkv(qkvg, attn_metadata)
        q, k, v, g = qkvg.chunk(4, dim=0)
        out = self.impl.forward(q, k, v, g, attn_metadata)
        out = self.impl.postprocess_output(out, attn_metadata)
        return self.to_out(out.reshape(b, s, n * d))


def main():
    torch.manual_seed(0)
    dim, heads = 32, 2
    raw_latent_shape = (5, 6, 6)  # latent frames, height, width (patch size 1)
    attn_metadata = VideoSparseAttentionMetadataBuilder().build(
        current_timestep=0,
        raw_latent_shape=raw_latent_shape,
        patch_size=(1, 1, 1),
        VSA_sparsity=0.75,
        device=torch.device("cpu"),
        cache_tile_buf=True,
    )
    layer = WanVSASelfAttention(dim, heads).eval()
    seq_len = math.prod(raw_latent_shape)
    hidden_states = torch.randn(1, seq_len, dim)
    with torch.no_grad():
        out = layer(hidden_states, attn_metadata)

    print("tiles:", attn_metadata.variable_block_sizes.numel(),
          "tokens per tile:", attn_metadata.variable_block_sizes.tolist())
    print("output shape:", tuple(out.shape))
    print("first-frame token 0:", [round(v, 5) for v in out[0, 0, :6].tolist()])
    print("last token:", [round(v, 5) for v in out[0, -1, :6].tolist()])
    print("output sum: %.6f" % out.sum().item())


if __name__ == "__main__":
    main()
