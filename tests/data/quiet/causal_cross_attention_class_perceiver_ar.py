"""A correct Perceiver AR-style layer: `CausalCrossAttention` attends the last N positions of a sequence (the latents)
to the whole sequence, causally (latent i, at position P + i, sees positions 0..P + i), as its class name says. With
no prefix beyond the latents (P = 0) its mask is the plain triangle over as many keys as queries, meant; with a prefix
it is the bottom-right triangle. A block named only `CrossAttention` beside it attends text to image features with no
mask at all. No finding."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalCrossAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.q, self.kv, self.out = heads, nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def forward(self, latents, inputs):
        b, n, d = latents.shape
        m = inputs.shape[1]
        q = self.q(latents).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, m, self.heads, -1).transpose(1, 2) for t in self.kv(inputs).chunk(2, -1))
        keep = torch.ones(n, m, dtype=torch.bool).tril(m - n)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, n, d))


class CrossAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, text, image):
        return self.attn(text, image, image, need_weights=False)[0]


torch.manual_seed(0)
layer, cross = CausalCrossAttention().eval(), CrossAttention().eval()
with torch.no_grad():
    seq = torch.randn(2, 6, 16)
    out = layer(seq, seq)  # every position a latent
    longer = torch.randn(2, 10, 16)
    out2 = layer(longer[:, -4:], longer)  # 4 latents over a 6-token prefix
    out3 = cross(torch.randn(2, 5, 16), torch.randn(2, 5, 16))
print(tuple(out.shape), tuple(out2.shape), tuple(out3.shape))
