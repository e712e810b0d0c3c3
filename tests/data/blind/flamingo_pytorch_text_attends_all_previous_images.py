# lucidrains/flamingo-pytorch#6: MaskedCrossAttention let each text token attend to the media of *all* preceding
# images (text_time >= media_time); Flamingo attends only to the immediately preceding image (==).
import sys

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def FeedForward(dim, mult=4):
    inner_dim = int(dim * mult)
    return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, inner_dim, bias=False), nn.GELU(),
                         nn.Linear(inner_dim, dim, bias=False))


class MaskedCrossAttention(nn.Module):
    def __init__(self, *, dim, dim_head=8, heads=4):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        inner_dim = dim_head * heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, media, media_locations=None):
        b, t, m = media.shape[:3]
        h = self.heads
        x = self.norm(x)
        q = self.to_q(x)
        media = media.reshape(b, t * m, -1)  # 'b t n d -> b (t n) d'
        k, v = self.to_kv(media).chunk(2, dim=-1)
        q, k, v = (z.view(b, z.shape[1], h, -1).transpose(1, 2) for z in (q, k, v))
        q = q * self.scale
        sim = einsum('... i d, ... j d -> ... i j', q, k)

        if exists(media_locations):
            # at each boolean of True, increment the time counter (relative to media time)
            text_time = media_locations.cumsum(dim=-1)
            media_time = torch.arange(t, device=x.device) + 1
            text_t = text_time[:, None, :, None]                       # 'b i -> b 1 i 1'
            media_t = media_time.repeat_interleave(m)[None, None, None]  # 'j -> 1 1 1 (j m)'
            if FIXED:
                text_to_media_mask = text_t == media_t
            else:
                text_to_media_mask = text_t >= media_t
            sim = sim.masked_fill(~text_to_media_mask, -torch.finfo(sim.dtype).max)

        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        out = einsum('... i j, ... j d -> ... i d', attn, v)
        out = out.transpose(1, 2).reshape(b, -1, h * out.shape[-1])
        return self.to_out(out)


class GatedCrossAttentionBlock(nn.Module):
    def __init__(self, *, dim, dim_head=8, heads=4, ff_mult=4):
        super().__init__()
        self.attn = MaskedCrossAttention(dim=dim, dim_head=dim_head, heads=heads)
        self.attn_gate = nn.Parameter(torch.tensor([0.]))
        self.ff = FeedForward(dim, mult=ff_mult)
        self.ff_gate = nn.Parameter(torch.tensor([0.]))

    def forward(self, x, media, media_locations=None):
        x = self.attn(x, media, media_locations=media_locations) * self.attn_gate.tanh() + x
        x = self.ff(x) * self.ff_gate.tanh() + x
        return x


dim, num_tokens = 32, 100
token_emb = nn.Embedding(num_tokens, dim)
block = GatedCrossAttentionBlock(dim=dim)
with torch.no_grad():
    block.attn_gate.fill_(1.0)  # as after training; initialised at 0
    block.ff_gate.fill_(1.0)

# two images per sample, each resampled to 4 latents by the perceiver: (batch, time, latents, dim)
media = torch.randn(2, 2, 4, dim)
text = torch.randint(0, num_tokens, (2, 12))
IMAGE_TOKEN = 3
text[text == IMAGE_TOKEN] = 4
text[:, 0] = IMAGE_TOKEN   # <image> caption one
text[:, 6] = IMAGE_TOKEN   # <image> caption two
media_locations = text == IMAGE_TOKEN

with torch.no_grad():
    out = block(token_emb(text), media, media_locations=media_locations)
    media2 = media.clone()
    media2[:, 0] = torch.randn(2, 4, dim)  # change only the first image
    out2 = block(token_emb(text), media2, media_locations=media_locations)

print("mode:", "fixed" if FIXED else "buggy")
print("change in second caption's tokens after changing only the first image: %.4f"
      % (out2[:, 6:] - out[:, 6:]).abs().max())
