"""tt-metal paged SDPA decode: sliding-window mask tile fills the whole first face when the window starts at column 15.

Citation: tenstorrent/tt-metal#30362, "Paged SDPA decode fails PCC check for paged attention at
certain positions" (closed; root cause posted in the thread: fill_tile_partial_sliding_window).
I read the issue thread, which quotes the buggy lines and the one-character fix, not the merged
commit. This is a torch port of the decode op's masking as the thread describes it: K/V read in
32-token chunks through a page table, the first chunk of the window masked by a 32x32 tile made of
four 16x16 faces (faces 0 and 2 hold columns 0-15), the last chunk masked past cur_pos.

Bug: `face_start = (window_start_pos_in_tile < 15) ? 0 : 1`. When the window starts at column 15
of its tile (column 15 is still in the first face), face_start becomes 1 and the whole first face,
column 15 included, is filled with -inf: the oldest key inside the window is masked out. It showed
up as PCC failures at positions where (window start) % 32 == 15.

Fix: `window_start_pos_in_tile < 16`.

Reproduction: sliding_window 64, cur_pos 78 (window keys 15..78, so the window starts at column 15
of chunk 0), page (block) size 32, one decode query with 4 heads. Attention is
F.scaled_dot_product_attention with the additive mask assembled from the chunk tiles.
"""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

TILE = 32
FACE = 16
NEG_INF = float("-inf")


def fill_tile_partial_sliding_window(tile, window_start_pos_in_tile):
    """Mask the columns of a 32x32 tile that lie before the window start (faces: 0 | 1 over 2 | 3)."""
    faces = [tile[:FACE, :FACE], tile[:FACE, FACE:], tile[FACE:, :FACE], tile[FACE:, FACE:]]
    # Determine which faces to fill completely (before the window_start_pos_in_tile)
    if FIXED:
        face_start = 0 if window_start_pos_in_tile < 16 else 1
    else:
        face_start = 0 if window_start_pos_in_tile < 15 else 1
    # Fill complete faces (faces 0, 2 for faces before face_start)
    if face_start == 1:
        for k in range(0, 4, 2):
            faces[k].fill_(NEG_INF)
    # Fill the partial columns of the face holding the window start
    partial_cols = window_start_pos_in_tile - face_start * FACE
    for k in (face_start, face_start + 2):
        faces[k][:, :max(partial_cols, 0)] = NEG_INF
    return tile


def fill_tile_partial_causal(tile, cur_pos_in_tile):
    tile[:, cur_pos_in_tile + 1:] = NEG_INF
    return tile


def sdpa_decode_mask(cur_pos, sliding_window, num_chunks):
    window_start = cur_pos - sliding_window + 1
    start_chunk = window_start // TILE
    end_chunk = cur_pos // TILE
    tiles = []
    for c in range(num_chunks):
        tile = torch.zeros(TILE, TILE)
        if c < start_chunk or c > end_chunk:
            tile.fill_(NEG_INF)
        else:
            if c == start_chunk:
                fill_tile_partial_sliding_window(tile, window_start % TILE)
            if c == end_chunk:
                fill_tile_partial_causal(tile, cur_pos % TILE)
        tiles.append(tile)
    return torch.cat(tiles, dim=1)  # [32 (padded query heads), num_chunks * 32]


def paged_sdpa_decode(q, k_cache, v_cache, page_table, cur_pos, sliding_window, scale):
    num_chunks = cur_pos // TILE + 1
    pages = page_table[:num_chunks]
    k = k_cache[pages].flatten(0, 1)  # [num_chunks * 32, D]
    v = v_cache[pages].flatten(0, 1)
    n_heads = q.shape[0]
    mask = sdpa_decode_mask(cur_pos, sliding_window, num_chunks)[:n_heads, None, :]  # row per q head
    return F.scaled_dot_product_attention(q[:, None, :], k[None], v[None], attn_mask=mask, scale=scale)


def main():
    torch.manual_seed(0)
    n_heads, head_dim, n_pages = 4, 16, 6
    k_cache = torch.randn(n_pages, TILE, head_dim)
    v_cache = torch.randn(n_pages, TILE, head_dim)
    page_table = torch.tensor([4, 1, 5, 0])
    q = torch.randn(n_heads, head_dim)
    out = paged_sdpa_decode(q, k_cache, v_cache, page_table, cur_pos=78, sliding_window=64, scale=head_dim ** -0.5)
    print("decode output norms:", [round(x, 3) for x in out.flatten(1).norm(dim=1).tolist()])


if __name__ == "__main__":
    main()
