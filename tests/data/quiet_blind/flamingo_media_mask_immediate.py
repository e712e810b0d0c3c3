# Follows lucidrains/flamingo-pytorch flamingo_pytorch/flamingo_pytorch.py (MaskedCrossAttention.forward):
# text_time = media_locations.cumsum(-1); text tokens attend only to latents of the most recent media
# (text_time == media_time); tokens before any media see nothing and are zeroed via text_without_media_mask.
import torch
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
B, T, M, n_lat, D = 2, 12, 3, 4, 32     # more text queries (12) than media latents per image
Wq, Wk, Wv = (torch.randn(D, D) / D ** 0.5 for _ in range(3))
x = torch.randn(B, T, D); media = torch.randn(B, M, n_lat, D)
media_locations = torch.zeros(B, T, dtype=torch.bool)
media_locations[0, [2, 6, 9]] = True
media_locations[1, [5]] = True           # second sample has only one image, first 5 tokens see nothing

q = x @ Wq
m = media.reshape(B, M * n_lat, D)
k, v = m @ Wk, m @ Wv
sim = q @ k.transpose(1, 2) / D ** 0.5
text_time = media_locations.cumsum(-1)
media_time = torch.arange(M) + 1
text_to_media_mask = text_time[:, :, None] == media_time.repeat_interleave(n_lat)[None, None, :]
sim = sim.masked_fill(~text_to_media_mask, -torch.finfo(sim.dtype).max)
sim = sim - sim.amax(-1, keepdim=True).detach()
attn = sim.softmax(-1)
text_without_media_mask = text_time == 0
attn = attn.masked_fill(text_without_media_mask[..., None], 0.)
out = attn @ v

ref = torch.zeros_like(out)
for b in range(B):
    cur = 0
    for t in range(T):
        if media_locations[b, t]:
            cur += 1
        if cur == 0:
            continue
        lat = media[b, cur - 1]
        s = (x[b, t] @ Wq) @ (lat @ Wk).T / D ** 0.5
        ref[b, t] = s.softmax(0) @ (lat @ Wv)
diff = (out - ref).abs().max().item()
print("max diff", diff)
assert diff < 1e-12
