# Follows facebookresearch/Mask2Former mask2former/modeling/transformer_decoder/mask2former_transformer_decoder.py
# forward_prediction_heads (attn_mask = sigmoid(interpolated mask) < 0.5, True = not allowed, repeated per head) and
# forward (attn_mask[where(attn_mask.sum(-1) == attn_mask.shape[-1])] = False: a query whose mask is empty sees everything).
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
D, H, Q, B = 32, 4, 6, 2
cross = nn.MultiheadAttention(D, H).double()
mask_embed = nn.Linear(D, D).double()

queries = torch.randn(Q, B, D, dtype=torch.float64)
mask_features = torch.randn(B, D, 8, 8, dtype=torch.float64)  # high-res per-pixel embeddings
memory = torch.randn(16, B, D, dtype=torch.float64)  # a 4x4 level of the pixel decoder, flattened
attn_size = (4, 4)

with torch.no_grad():
    me = mask_embed(queries.transpose(0, 1))
    me[0, 2] = -50.0 * mask_features[0].mean((1, 2))  # makes query 2 of image 0 predict an empty mask
    me[1, 4] = 50.0 * mask_features[1].mean((1, 2))
    outputs_mask = torch.einsum("bqc,bchw->bqhw", me, mask_features)
    attn_mask = F.interpolate(outputs_mask, size=attn_size, mode="bilinear", align_corners=False)
    attn_mask = (attn_mask.sigmoid().flatten(2).unsqueeze(1).repeat(1, H, 1, 1).flatten(0, 1) < 0.5).bool()
    empty_rows = int((attn_mask.sum(-1) == attn_mask.shape[-1]).sum())
    attn_mask[torch.where(attn_mask.sum(-1) == attn_mask.shape[-1])] = False
    out = cross(queries, memory, memory, attn_mask=attn_mask)[0]

    # reference: per (image, query) loop that picks keys where the predicted mask is on, or all keys if none are
    prob = F.interpolate(outputs_mask, size=attn_size, mode="bilinear", align_corners=False).sigmoid().flatten(2)
    diff = 0.0
    for b in range(B):
        for i in range(Q):
            keep = prob[b, i] >= 0.5
            if not keep.any():
                keep = torch.ones_like(keep)
            mem = memory[keep, b:b + 1]
            ref = cross(queries[i:i + 1, b:b + 1], mem, mem)[0]
            diff = max(diff, (out[i, b] - ref[0, 0]).abs().max().item())
print("empty rows (over heads):", empty_rows)
assert empty_rows > 0
print("max |masked attention - per-query loop with empty fallback| =", diff)
assert diff < 1e-12
