"""Qwen2.5-VL vision tower: window attention from cu_window_seqlens, full attention per image.

Follows huggingface/transformers src/transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py:
Qwen2_5_VisionTransformerPretrainedModel.get_window_index (merged-patch grid padded to a multiple
of the window, -100 fillers dropped, cu_window_seqlens = cumsum(window sizes) * spatial_merge_unit),
forward (tokens regrouped by window_index, layers in fullatt_block_indexes use cu_seqlens of the
images, the others cu_window_seqlens, torch.unique_consecutive on cu_window_seqlens, output put back
with argsort(window_index)) and the SDPA attention path, which turns cu_seqlens into a block-diagonal
boolean mask. Two images of different sizes (one not a multiple of the window). Reference: tokens in
raster order, a mask from geometry alone (same image, and same window on windowed layers).
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, HD = 32, 2, 16
MERGE, PATCH, WINDOW = 2, 2, 8           # spatial_merge_size, patch_size, window_size (pixels)
WS = WINDOW // MERGE // PATCH            # vit_merger_window_size = 2 merged patches
UNIT = MERGE * MERGE                     # spatial_merge_unit
FULLATT = {1, 3}
NL = 4
grid_thw = torch.tensor([[1, 6, 4], [1, 4, 8]])  # (t, h, w) in patches


def get_window_index(grid_thw):
    window_index, cu_window_seqlens, offset = [], [0], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // MERGE, w // MERGE
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = (WS - gh % WS) % WS, (WS - gw % WS) % WS
        nh, nw = (gh + ph) // WS, (gw + pw) // WS
        index_padded = F.pad(index, (0, pw, 0, ph), "constant", -100)
        index_padded = index_padded.reshape(t, nh, WS, nw, WS).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, WS, WS)
        seqlens = (index_padded != -100).sum([2, 3]).reshape(-1)
        index_padded = index_padded.reshape(-1)
        index_new = index_padded[index_padded != -100]
        window_index.append(index_new + offset)
        cu_window_seqlens.extend((seqlens.cumsum(0) * UNIT + cu_window_seqlens[-1]).tolist())
        offset += t * gh * gw
    return torch.cat(window_index), cu_window_seqlens


def mask_from_cu(cu, n):
    m = torch.zeros(n, n, dtype=torch.bool)
    for a, b in zip(cu[:-1], cu[1:]):
        m[a:b, a:b] = True
    return m


# patch tokens in Qwen's order: for each image, merged 2x2 groups in raster order of merged cells
N = int((grid_thw.prod(-1)).sum())
x = torch.randn(N, D, dtype=torch.float64)
layers = [(torch.nn.Linear(D, 3 * H * HD).double(), torch.nn.Linear(H * HD, D).double()) for _ in range(NL)]


def attn_layer(h, ly, mask):
    qkv, o = ly
    q, k, v = qkv(h).view(-1, 3, H, HD).permute(1, 2, 0, 3)
    a = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
    return h + o(a.transpose(0, 1).reshape(-1, H * HD))


with torch.no_grad():
    window_index, cu_window_seqlens = get_window_index(grid_thw)
    cu_window_seqlens = torch.unique_consecutive(torch.tensor(cu_window_seqlens)).tolist()
    cu_seqlens = F.pad((grid_thw[:, 1] * grid_thw[:, 2]).repeat_interleave(grid_thw[:, 0]).cumsum(0), (1, 0)).tolist()
    h = x.reshape(N // UNIT, UNIT, D)[window_index].reshape(N, D)
    for i, ly in enumerate(layers):
        h = attn_layer(h, ly, mask_from_cu(cu_seqlens if i in FULLATT else cu_window_seqlens, N))
    h = h.reshape(N // UNIT, UNIT, D)[torch.argsort(window_index)].reshape(N, D)

    # reference: raster order, image id and window id of every token from its merged-cell coordinates
    img_id, win_id = [], []
    for k_img, (t, hh, ww) in enumerate(grid_thw.tolist()):
        gh, gw = hh // MERGE, ww // MERGE
        for r in range(gh):
            for c in range(gw):
                for _ in range(UNIT):
                    img_id.append(k_img); win_id.append((k_img, r // WS, c // WS))
    img_id = torch.tensor(img_id)
    same_img = img_id[:, None] == img_id[None, :]
    same_win = torch.tensor([[a == b for b in win_id] for a in win_id])
    r = x
    for i, ly in enumerate(layers):
        r = attn_layer(r, ly, same_img if i in FULLATT else same_win)
print("cu_window_seqlens", cu_window_seqlens, "cu_seqlens", cu_seqlens)
d = (h - r).abs().max().item()
print("max |windowed tower - geometric reference| =", d)
assert d < 1e-10
