# Follows wenet/transformer/subsampling.py Conv2dSubsampling4.forward (x_mask[:, :, 2::2][:, :, 2::2])
# and wenet/utils/mask.py make_pad_mask: frame padding mask (True = pad) reduced after subsampling, then
# inverted to True = keep for SDPA. Batched padded utterances vs each utterance alone.
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, H, IDIM = 32, 4, 8
def make_pad_mask(lengths, max_len):
    return torch.arange(max_len)[None] >= lengths[:, None]
conv = nn.Sequential(nn.Conv2d(1, 4, 3, 2), nn.ReLU(), nn.Conv2d(4, 4, 3, 2), nn.ReLU())
lin = nn.Linear(4 * (((IDIM - 1) // 2 - 1) // 2), D)
mha = nn.MultiheadAttention(D, H, batch_first=True)
def encode(x, lens):
    masks = ~make_pad_mask(lens, x.shape[1]).unsqueeze(1)  # (B,1,T) True = keep
    h = conv(x.unsqueeze(1)); b, c, t, f = h.shape
    h = lin(h.transpose(1, 2).reshape(b, t, c * f))
    masks = masks[:, :, 2::2][:, :, 2::2]
    o, _ = mha(h, h, h, key_padding_mask=~masks[:, 0])  # nn.MHA wants True = ignore
    return o, masks
lens = torch.tensor([31, 19, 12]); T = 31
x = torch.randn(3, T, IDIM)
with torch.no_grad():
    out, m = encode(x, lens)
    diff = 0.0
    for b in range(3):
        o1, m1 = encode(x[b:b+1, :lens[b]], lens[b:b+1])
        n = o1.shape[1]; assert int(m[b].sum()) == n
        diff = max(diff, (o1[0] - out[b, :n]).abs().max().item())
print("max diff", diff); assert diff < 1e-10
