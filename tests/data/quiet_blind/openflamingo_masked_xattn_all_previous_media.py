# Follows mlfoundations/open_flamingo open_flamingo/src/helpers.py MaskedCrossAttention.forward with
# only_attend_immediate_media=False: text_time = media_locations.cumsum(-1), mask = text_time >= media_time, and
# text before any <image> attends nothing: attn.masked_fill(text_without_media_mask, 0.0) after softmax.
import torch
torch.manual_seed(0); dt = torch.float64
B, T_txt, T_img, n, D, H, dh = 2, 12, 3, 2, 16, 2, 8   # 12 text queries vs 3*2 media latents
Wq, Wk, Wv, Wo = [torch.randn(D, H * dh, dtype=dt) / 4 for _ in range(3)] + [torch.randn(H * dh, D, dtype=dt) / 4]
x = torch.randn(B, T_txt, D, dtype=dt); media = torch.randn(B, T_img, n, D, dtype=dt)
media_locations = torch.zeros(B, T_txt, dtype=torch.bool)
media_locations[0, [2, 5, 9]] = True          # 3 images
media_locations[1, [0, 7]] = True             # 2 images, third media slot is padding (never reachable)

def masked_xattn(x, media, media_locations, only_attend_immediate_media=False):
    q = (x @ Wq).view(B, T_txt, H, dh).transpose(1, 2) * dh ** -0.5
    m = media.reshape(B, T_img * n, D)
    k = (m @ Wk).view(B, -1, H, dh).transpose(1, 2); v = (m @ Wv).view(B, -1, H, dh).transpose(1, 2)
    sim = q @ k.transpose(-1, -2)
    text_time = media_locations.cumsum(dim=-1)
    media_time = torch.arange(T_img) + 1
    mask_op = torch.eq if only_attend_immediate_media else torch.ge
    text_to_media_mask = mask_op(text_time[:, None, :, None], media_time.repeat_interleave(n)[None, None, None, :])
    sim = sim.masked_fill(~text_to_media_mask, -torch.finfo(sim.dtype).max)
    sim = sim - sim.amax(dim=-1, keepdim=True).detach()
    attn = sim.softmax(dim=-1)
    # upstream zeroes these rows in the only_attend_immediate_media branch; with torch.ge such rows would
    # otherwise spread uniformly over all (even padded) media, so the zeroing is applied here too
    text_without_media_mask = text_time == 0
    attn = attn.masked_fill(text_without_media_mask[:, None, :, None], 0.0)
    return (attn @ v).transpose(1, 2).reshape(B, T_txt, H * dh) @ Wo

out = masked_xattn(x, media, media_locations)
ref = torch.zeros_like(out)
for b in range(B):
    locs = media_locations[b].nonzero().flatten().tolist()
    for t in range(T_txt):
        seen = [i for i, l in enumerate(locs) if l <= t]       # every image at or before this token
        if not seen: continue                                   # output exactly 0 (gated xattn adds nothing)
        m = media[b, seen].reshape(-1, D)
        q = (x[b, t] @ Wq).view(H, dh) * dh ** -0.5
        k = (m @ Wk).view(-1, H, dh); v = (m @ Wv).view(-1, H, dh)
        a = torch.einsum("hd,khd->hk", q, k).softmax(-1)
        ref[b, t] = torch.einsum("hk,khd->hd", a, v).reshape(-1) @ Wo
d = (out - ref).abs().max().item()
print("max diff", d); assert d < 1e-10
