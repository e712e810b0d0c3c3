# Follows facebookresearch/detr models/transformer.py (Transformer.forward, src_key_padding_mask / memory_key_padding_mask,
# True = padded pixel) with util/misc.py NestedTensor and models/position_encoding.py PositionEmbeddingSine. Images are
# padded bottom-right; 10 object queries cross-attend to as few as 6 unpadded feature pixels.
import math
import torch
from torch import nn

torch.manual_seed(0)
D, H, NQ = 32, 4, 10


def sine_pos(mask):  # PositionEmbeddingSine(normalize=True), mask True = pad
    not_mask = ~mask
    y = not_mask.cumsum(1, dtype=torch.float64)
    x = not_mask.cumsum(2, dtype=torch.float64)
    eps, scale = 1e-6, 2 * math.pi
    y = y / (y[:, -1:, :] + eps) * scale
    x = x / (x[:, :, -1:] + eps) * scale
    npf = D // 2
    dim_t = torch.arange(npf, dtype=torch.float64)
    dim_t = 10000 ** (2 * (dim_t // 2) / npf)
    px, py = x[..., None] / dim_t, y[..., None] / dim_t
    px = torch.stack((px[..., 0::2].sin(), px[..., 1::2].cos()), 4).flatten(3)
    py = torch.stack((py[..., 0::2].sin(), py[..., 1::2].cos()), 4).flatten(3)
    return torch.cat((py, px), 3).permute(0, 3, 1, 2)


enc_attn = nn.MultiheadAttention(D, H).double()
dec_self = nn.MultiheadAttention(D, H).double()
dec_cross = nn.MultiheadAttention(D, H).double()
norm1, norm2, norm3 = (nn.LayerNorm(D).double() for _ in range(3))
query_embed = nn.Embedding(NQ, D).double()


def transformer(src, mask, pos):
    bs, c, h, w = src.shape
    src = src.flatten(2).permute(2, 0, 1)
    pos = pos.flatten(2).permute(2, 0, 1)
    mask = mask.flatten(1)
    qpos = query_embed.weight.unsqueeze(1).repeat(1, bs, 1)
    q = k = src + pos
    memory = norm1(src + enc_attn(q, k, src, key_padding_mask=mask)[0])
    tgt = torch.zeros_like(qpos)
    q = k = tgt + qpos
    tgt = norm2(tgt + dec_self(q, k, tgt)[0])
    tgt = norm3(tgt + dec_cross(tgt + qpos, memory + pos, memory, key_padding_mask=mask)[0])
    return tgt.transpose(0, 1)


sizes = [(4, 5), (2, 3), (3, 5)]
Hm, Wm = max(s[0] for s in sizes), max(s[1] for s in sizes)
feats = [torch.randn(D, h, w, dtype=torch.float64) for h, w in sizes]
src = torch.zeros(len(sizes), D, Hm, Wm, dtype=torch.float64)
mask = torch.ones(len(sizes), Hm, Wm, dtype=torch.bool)
for i, f in enumerate(feats):
    src[i, :, :f.shape[1], :f.shape[2]] = f
    mask[i, :f.shape[1], :f.shape[2]] = False
with torch.no_grad():
    hs = transformer(src, mask, sine_pos(mask))
    diff = 0.0
    for i, f in enumerate(feats):
        m = torch.zeros(1, f.shape[1], f.shape[2], dtype=torch.bool)
        ref = transformer(f[None], m, sine_pos(m))
        diff = max(diff, (hs[i] - ref[0]).abs().max().item())
print("max |padded NestedTensor batch - each image unpadded| =", diff)
assert diff < 1e-12
