# Follows SWivid/F5-TTS src/f5_tts/model/modules.py (AttnProcessor.__call__, ConvPositionEmbedding.forward) and
# utils.lens_to_mask: mask is True = real frame, expanded 'b n -> b h q k' as a KEY mask for SDPA (padded query rows
# still attend to real keys), outputs of padded frames are zeroed with masked_fill(~mask, 0) and convs see zeros.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
dt = torch.float64
B, N, D, Hh = 3, 20, 32, 4
hd = D // Hh


def lens_to_mask(t, length=None):
    if length is None:
        length = t.amax()
    seq = torch.arange(length)
    return seq[None, :] < t[:, None]


def rotate_half(x):
    x = x.view(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(-1)
    return torch.stack((-x2, x1), -1).flatten(-2)


def apply_rope(t, n):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=dt) / hd))
    freqs = torch.arange(n, dtype=dt)[:, None] * inv[None]
    freqs = torch.repeat_interleave(freqs, 2, -1)
    return t * freqs.cos() + rotate_half(t) * freqs.sin()


class ConvPositionEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        # one conv layer (F5 stacks two; the frames between them are not re-masked, so only one
        # layer keeps the padded batch bit-comparable with each utterance alone)
        self.conv1d = nn.Sequential(nn.Conv1d(D, D, 5, groups=4, padding=2), nn.Mish())

    def forward(self, x, mask=None):
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        out = self.conv1d(x.permute(0, 2, 1)).permute(0, 2, 1)
        if mask is not None:
            out = out.masked_fill(~mask[..., None], 0.0)
        return out


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, Hh, hd).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        q, k = apply_rope(q, n), apply_rope(k, n)
        if mask is not None:
            attn_mask = mask.unsqueeze(1).unsqueeze(1)                  # 'b n -> b 1 1 n'
            attn_mask = attn_mask.expand(b, Hh, q.shape[-2], k.shape[-2])
        else:
            attn_mask = None
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False)
        x = self.to_out(x.transpose(1, 2).reshape(b, n, D))
        if mask is not None:
            x = x.masked_fill(~mask.unsqueeze(-1), 0.0)
        return x


conv = ConvPositionEmbedding().double()
blocks = nn.ModuleList([Attn() for _ in range(2)]).double()


def dit(x, mask=None):
    x = conv(x, mask) + x
    for blk in blocks:
        x = x + blk(F.layer_norm(x, (D,)), mask)
    return x


lens = torch.tensor([20, 13, 7])
mask = lens_to_mask(lens, N)
x = torch.randn(B, N, D, dtype=dt)
with torch.no_grad():
    out = dit(x, mask)
    diff = 0.0
    for b in range(B):
        n = int(lens[b])
        ref = dit(x[b:b + 1, :n])                       # alone, unpadded, no mask at all
        diff = max(diff, (out[b, :n] - ref[0]).abs().max().item())
print("max |padded masked DiT - each utterance alone| =", diff)
assert diff < 1e-12
