# dhansmair/flamingo-mini, fixed in commit 196c64b ("a bug and an update from lucidrains: any text without a preceding
# media needs to have attention zeroed out"). Bug: a token with text_time == 0 (before the first <image>) has every visual
# key masked with -max, so softmax turns into a uniform average over all visual tokens and the token still sees the image.
import sys
import torch
from torch import nn, einsum, tanh

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * mult, bias=False), nn.GELU(),
                                 nn.Linear(dim * mult, dim, bias=False))

    def forward(self, x):
        return self.net(x)


class MaskedCrossAttention(nn.Module):
    def __init__(self, *, dim, dim_visual, dim_head=8, heads=4, n_visual=4):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.n_visual = n_visual
        inner_dim = dim_head * heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim_visual, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, y, visual_features=None, media_locations=None, previous_kv=None, output_kv=False):
        n_batch, n_media = visual_features.shape[:2]
        n_batch_y, n_token, d_token = y.shape
        h = self.heads
        y = self.norm(y)
        q = self.to_q(y)
        q = q * self.scale
        if previous_kv is None:
            visual_features = visual_features.reshape(n_batch, -1, visual_features.shape[-1])  # 'b t n d -> b (t n) d'
            k, v = self.to_kv(visual_features).chunk(2, dim=-1)
            q, k, v = [t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v)]
        else:
            k, v = previous_kv
            q = q.reshape(n_batch_y, n_token, h, -1).transpose(1, 2)

        sim = einsum('... i d, ... j d -> ... i j', q, k)

        if media_locations is not None:
            text_time = media_locations.cumsum(dim=-1)  # at each boolean of True, increment the time counter
            if previous_kv is not None:
                text_time = text_time[:, -n_token:]
            media_time = torch.arange(n_media, device=y.device) + 1
            text_to_media_mask = text_time[:, None, :, None] == media_time.repeat_interleave(self.n_visual)[None, None, None, :]
            sim = sim.masked_fill(~text_to_media_mask, -torch.finfo(sim.dtype).max)

        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        alphas = sim.softmax(dim=-1)

        if FIXED:
            # any text without a preceding media needs to have attention zeroed out
            text_without_media_mask = text_time == 0
            text_without_media_mask = text_without_media_mask[:, None, :, None]
            alphas = alphas.masked_fill(text_without_media_mask, 0.)

        out = einsum('... i j, ... j d -> ... i d', alphas, v)
        out = out.transpose(1, 2).reshape(n_batch_y, n_token, -1)
        conditioned_tokens = self.to_out(out)
        return conditioned_tokens, ((k, v) if output_kv else None)


class GatedCrossAttentionBlock(nn.Module):
    def __init__(self, *, dim, dim_visual, n_visual=4):
        super().__init__()
        self.attn = MaskedCrossAttention(dim=dim, dim_visual=dim_visual, n_visual=n_visual)
        self.alpha_attn = nn.Parameter(torch.tensor([0.8]))  # trained value (initialised at 0.)
        self.ffw = FeedForward(dim)
        self.alpha_ffw = nn.Parameter(torch.tensor([0.8]))

    def forward(self, y, visual_features, media_locations=None, previous_kv=None, output_kv=False):
        attn_out, kv = self.attn(y, visual_features, media_locations=media_locations, previous_kv=previous_kv,
                                 output_kv=output_kv)
        y = y + tanh(self.alpha_attn) * attn_out
        y = y + tanh(self.alpha_ffw) * self.ffw(y)
        return y, kv


dim, dim_visual, n_visual = 32, 16, 4
block = GatedCrossAttentionBlock(dim=dim, dim_visual=dim_visual, n_visual=n_visual).eval()
embed = nn.Embedding(50, dim)
IMG = 3  # id of '<' of "<image>"

# "Question: <image> what is in it?" -- several tokens come before the first image
input_ids = torch.tensor([[10, 11, 12, IMG, 20, 21, 22, 23], [15, IMG, 24, 25, 26, 27, 28, 29]])
media_locations = input_ids == IMG
y = embed(input_ids)
img_a = torch.randn(2, 1, n_visual, dim_visual)  # perceiver-resampled visual features
img_b = torch.randn(2, 1, n_visual, dim_visual)

with torch.no_grad():
    out_a, _ = block(y, img_a, media_locations=media_locations)
    out_b, _ = block(y, img_b, media_locations=media_locations)

before_first_image = media_locations.cumsum(-1) == 0
diff = (out_a - out_b).abs().amax(-1)[before_first_image].max().item()
print(f"max change of text tokens before the first <image> when the image is swapped: {diff:.3e}")
