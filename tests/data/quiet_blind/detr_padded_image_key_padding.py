# DETR models/transformer.py TransformerEncoderLayer: self_attn(q, k, value=src, key_padding_mask=mask) where mask comes from
# util/misc.py nested_tensor_from_tensor_list (True = padded pixel, bottom/right). Padded pixels' rows are garbage, discarded.
import torch, torch.nn as nn
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D = 32
attn = nn.MultiheadAttention(D, 4, dropout=0.0).eval()
imgs = [torch.randn(D, 3, 5), torch.randn(D, 4, 3)]                  # feature maps of different HxW
Hm, Wm = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
tensor = torch.zeros(2, D, Hm, Wm); mask = torch.ones(2, Hm, Wm, dtype=torch.bool)
for b, im in enumerate(imgs):                                          # nested_tensor_from_tensor_list
    tensor[b, :, :im.shape[1], :im.shape[2]] = im; mask[b, :im.shape[1], :im.shape[2]] = False
src = tensor.flatten(2).permute(2, 0, 1)                               # (HW, B, D)
kpm = mask.flatten(1)                                                   # (B, HW)
out, _ = attn(src, src, src, key_padding_mask=kpm)
d = 0.0
for b, im in enumerate(imgs):
    s = im.flatten(1).permute(1, 0)[:, None]                           # unpadded image alone
    ref, _ = attn(s, s, s)
    valid = ~kpm[b]
    d = max(d, (out[valid, b] - ref[:, 0]).abs().max().item())
print("max diff padded batch vs each image alone:", d); assert d < 1e-10
