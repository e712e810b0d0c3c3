"""OpenFlamingo: Perceiver resampler latents, then text cross-attends only to the image right before it.

Follows mlfoundations/open_flamingo open_flamingo/src/helpers.py (PerceiverAttention: latents query the
concatenation of media features and latents; MaskedCrossAttention with media_locations,
only_attend_immediate_media=True: text_time = cumsum(media_locations), mask text_time == media_time,
masked_fill(-finfo.max), and text before the first <image> gets its attention zeroed).
Masks meant: resampler has no mask (num_latents=12 queries over 5 patches + 12 latents); in the LM,
each text token sees exactly the latents of the most recent preceding image and nothing else; text with
no preceding image attends to nothing (output 0, the tanh-gated residual keeps the text stream).
"""
import torch
from torch import einsum, nn


class PerceiverAttention(nn.Module):
    def __init__(self, *, dim, dim_head=8, heads=4):
        super().__init__()
        self.scale, self.heads = dim_head ** -0.5, heads
        inner_dim = dim_head * heads
        self.norm_media, self.norm_latents = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, latents):
        """x: (b, T, n1, D) media features; latents: (b, T, n2, D)."""
        x, latents = self.norm_media(x), self.norm_latents(latents)
        h = self.heads
        q = self.to_q(latents)
        kv_input = torch.cat((x, latents), dim=-2)
        k, v = self.to_kv(kv_input).chunk(2, dim=-1)
        q, k, v = (t.unflatten(-1, (h, -1)).transpose(-3, -2) for t in (q, k, v))   # b T h n d
        sim = einsum("... i d, ... j d -> ... i j", q * self.scale, k)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        out = einsum("... i j, ... j d -> ... i d", attn, v).transpose(-3, -2).flatten(-2)
        return self.to_out(out)


class MaskedCrossAttention(nn.Module):
    def __init__(self, *, dim, dim_visual, dim_head=8, heads=4, only_attend_immediate_media=True):
        super().__init__()
        self.scale, self.heads = dim_head ** -0.5, heads
        inner_dim = dim_head * heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim_visual, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)
        self.only_attend_immediate_media = only_attend_immediate_media

    def forward(self, x, media, media_locations):
        """x: (B, T_txt, D); media: (B, T_img, n, D); media_locations: bool (B, T_txt), True at <image>."""
        _, T_img, n = media.shape[:3]
        h = self.heads
        x = self.norm(x)
        q = self.to_q(x)
        media = media.flatten(1, 2)
        k, v = self.to_kv(media).chunk(2, dim=-1)
        q, k, v = (t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q, k, v))
        sim = einsum("... i d, ... j d -> ... i j", q * self.scale, k)

        text_time = media_locations.cumsum(dim=-1)
        media_time = torch.arange(T_img) + 1
        mask_op = torch.eq if self.only_attend_immediate_media else torch.ge
        text_to_media_mask = mask_op(text_time[:, None, :, None], media_time.repeat_interleave(n)[None, None, None, :])
        sim = sim.masked_fill(~text_to_media_mask, -torch.finfo(sim.dtype).max)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        if self.only_attend_immediate_media:
            # text before the first image has no media to attend to
            text_without_media_mask = text_time == 0
            attn = attn.masked_fill(text_without_media_mask[:, None, :, None], 0.0)
        out = einsum("... i j, ... j d -> ... i d", attn, v).transpose(1, 2).flatten(-2)
        return self.to_out(out)


def main():
    torch.manual_seed(0)
    dim, num_latents = 32, 12
    media_token_id = 7
    vision_x = torch.randn(1, 2, 5, dim)                     # (b, T_img, patches, D) from the vision encoder
    latents = nn.Parameter(torch.randn(num_latents, dim))
    resampler_attn = PerceiverAttention(dim=dim)
    gated_xattn = MaskedCrossAttention(dim=dim, dim_visual=dim)
    attn_gate = nn.Parameter(torch.tensor([0.5]))
    # "a photo: <image> a cat <|endofchunk|> <image> a dog"
    lang_x = torch.tensor([[3, 4, media_token_id, 10, 11, 12, media_token_id, 13, 14]])
    text_embed = nn.Embedding(20, dim)
    with torch.no_grad():
        lat = latents.expand(1, 2, num_latents, dim)
        media = resampler_attn(vision_x, lat) + lat
        x = text_embed(lang_x)
        x = gated_xattn(x, media, media_locations=lang_x == media_token_id) * attn_gate.tanh() + x
    print("text", tuple(x.shape), "media latents", tuple(media.shape))


if __name__ == "__main__":
    main()
