"""Point Transformer V3's serialized patch attention over a batch of point clouds of different sizes,
as Pointcept/PointTransformerV3 writes it: model.py SerializedAttention.get_padding_and_inverse
(bincount rounded up to a multiple of patch_size only when bincount > patch_size; the missing slots of
each cloud's last patch are filled by COPYING indices from the previous patch,
`pad[_offset_pad[i+1] - P + (bincount % P): _offset_pad[i+1]] = pad[_offset_pad[i+1] - 2P + ...]`;
`unpad` maps every real point back to its own slot; cu_seqlens every P slots), SerializedAttention.forward
(enable_flash branch: qkv gathered with `order = point.serialized_order[...][pad]`,
flash_attn_varlen_qkvpacked_func over cu_seqlens, then `feat[inverse]` with
`inverse = unpad[point.serialized_inverse[...]]`), and serialization by a z-order (Morton) code of grid
coordinates with the batch index in the high bits. Varlen flash attention is replaced by a loop of SDPA
calls over the cu_seqlens segments (same result, CPU).

Intent: there is no mask and no padding token. Every patch holds P distinct REAL points of one cloud;
a cloud's last patch is its last P points in serialized order (it overlaps the previous patch), and
the copied slots' outputs are discarded by the inverse map. A cloud with <= P points is one patch.

Checks: (1) each point's output equals attention over its patch as defined on serialized positions
(s // P, or the last P positions for the tail); (2) each cloud alone gives the same outputs.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
C, H, P = 32, 4, 8


def morton(grid):  # (N,3) int -> z-order code, 6 bits per axis
    code = torch.zeros(grid.shape[0], dtype=torch.long)
    for bit in range(6):
        for ax in range(3):
            code |= ((grid[:, ax] >> bit) & 1) << (3 * bit + ax)
    return code


def serialize(coord, batch):
    code = (batch << 48) | morton((coord / 0.05).floor().long())
    order = torch.argsort(code)
    inverse = torch.zeros_like(order).scatter_(0, order, torch.arange(len(order)))
    return order, inverse


def get_padding_and_inverse(offset, patch_size):
    bincount = torch.diff(offset, prepend=torch.zeros(1, dtype=torch.long))
    bincount_pad = torch.div(bincount + patch_size - 1, patch_size, rounding_mode="trunc") * patch_size
    mask_pad = bincount > patch_size
    bincount_pad = ~mask_pad * bincount + mask_pad * bincount_pad
    _offset = F.pad(offset, (1, 0))
    _offset_pad = F.pad(torch.cumsum(bincount_pad, dim=0), (1, 0))
    pad = torch.arange(_offset_pad[-1])
    unpad = torch.arange(_offset[-1])
    cu_seqlens = []
    for i in range(len(offset)):
        unpad[_offset[i]: _offset[i + 1]] += _offset_pad[i] - _offset[i]
        if bincount[i] != bincount_pad[i]:
            pad[_offset_pad[i + 1] - patch_size + (bincount[i] % patch_size): _offset_pad[i + 1]] = \
                pad[_offset_pad[i + 1] - 2 * patch_size + (bincount[i] % patch_size): _offset_pad[i + 1] - patch_size]
        pad[_offset_pad[i]: _offset_pad[i + 1]] -= _offset_pad[i] - _offset[i]
        cu_seqlens.append(torch.arange(_offset_pad[i], _offset_pad[i + 1], step=patch_size))
    return pad, unpad, F.pad(torch.cat(cu_seqlens), (0, 1), value=int(_offset_pad[-1]))


qkv_proj, proj = nn.Linear(C, 3 * C), nn.Linear(C, C)


def serialized_attention(feat, coord, batch, offset):
    order_s, inverse_s = serialize(coord, batch)
    pad, unpad, cu_seqlens = get_padding_and_inverse(offset, P)
    order = order_s[pad]
    inverse = unpad[inverse_s]
    qkv = qkv_proj(feat)[order].view(-1, 3, H, C // H)
    out = torch.empty(qkv.shape[0], H, C // H)
    for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):   # varlen, one patch each
        q, k, v = qkv[s:e].permute(1, 2, 0, 3)
        out[s:e] = F.scaled_dot_product_attention(q, k, v).permute(1, 0, 2)
    return proj(out.reshape(-1, C)[inverse])


sizes = [37, 21, 6]
coord = torch.cat([torch.rand(n, 3) for n in sizes])
feat = torch.randn(sum(sizes), C)
batch = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
offset = torch.cumsum(torch.tensor(sizes), 0)

with torch.no_grad():
    out = serialized_attention(feat, coord, batch, offset)
    order_s, _ = serialize(coord, batch)
    qkv = qkv_proj(feat).view(-1, 3, H, C // H)
    d1, d2, start = 0.0, 0.0, 0
    for i, n in enumerate(sizes):
        ser = order_s[start:start + n]                    # this cloud's points in serialized order
        full_end = (n // P) * P
        for s in range(n):
            if n <= P:
                members = ser
            elif s < full_end:
                members = ser[(s // P) * P: (s // P + 1) * P]
            else:
                members = ser[n - P:]                     # tail: the last P points, overlapping
            q, k, v = qkv[ser[s], 0], qkv[members, 1], qkv[members, 2]
            w = torch.einsum('hd,khd->hk', q, k).div((C // H) ** 0.5).softmax(-1)
            ref = proj(torch.einsum('hk,khd->hd', w, v).reshape(C))
            d1 = max(d1, (ref - out[ser[s]]).abs().max().item())
        sl = slice(start, start + n)
        alone = serialized_attention(feat[sl], coord[sl], torch.zeros(n, dtype=torch.long), torch.tensor([n]))
        d2 = max(d2, (alone - out[sl]).abs().max().item())
        start += n

print(f"patch attention vs per-point loop over its serialized patch: max diff = {d1:.3e}")
print(f"batch of clouds (37/21/6 points, P={P}) vs each cloud alone: max diff = {d2:.3e}")
assert d1 < 1e-12 and d2 < 1e-12
