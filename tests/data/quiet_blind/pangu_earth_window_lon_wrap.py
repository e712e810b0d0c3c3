# Follows 198808xc/Pangu-Weather pseudocode.py EarthSpecificBlock (roll3D by half a window, gen_mask: mask pixels that
# are not adjacent) as implemented in lizhuoq/WeatherLearn get_shift_window_mask, reduced to 2D (lat x lon): longitude
# is periodic, so only latitude bands get labels; date-line wrap pairs attend, pole-to-pole wraps get -inf.
import torch
torch.manual_seed(1)
torch.set_default_dtype(torch.float64)
LAT, LON = 8, 12; wl, wo = 4, 4; sl, so = 2, 2; C = 16

def part(x):  # (B, LAT, LON, C) -> (B*nW, wl*wo, C)
    B = x.shape[0]
    x = x.view(B, LAT // wl, wl, LON // wo, wo, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, wl * wo, C)

def unpart(w, B):
    x = w.view(B, LAT // wl, LON // wo, wl, wo, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, LAT, LON, C)

# gen_mask: label latitude bands only (no slicing over longitude, which wraps around the globe)
img = torch.zeros(1, LAT, LON, 1)
for n, h in enumerate((slice(0, -wl), slice(-wl, -sl), slice(-sl, None))):
    img[:, h, :, :] = n
mw = part(img.expand(1, LAT, LON, C))[..., 0]                # (nW, wl*wo)
bias = torch.zeros(mw.shape[0], wl * wo, wl * wo)
bias = bias.masked_fill(mw[:, None, :] != mw[:, :, None], float("-inf"))

Wq, Wk, Wv = (torch.randn(C, C) / C ** 0.5 for _ in range(3))
B = 2
x = torch.randn(B, LAT, LON, C)
xs = torch.roll(x, shifts=(-sl, -so), dims=(1, 2))
xw = part(xs)
s = (xw @ Wq) @ (xw @ Wk).transpose(-1, -2) * C ** -0.5
s = s.view(B, -1, wl * wo, wl * wo) + bias
out = (s.softmax(-1).view(-1, wl * wo, wl * wo) @ (xw @ Wv))
out = torch.roll(unpart(out, B), shifts=(sl, so), dims=(1, 2))

# reference: latitude blocks without wrap; longitude windows [so+k*wo, so+(k+1)*wo) taken modulo LON
lat_blk = lambda i: 0 if i < sl else 1 + (i - sl) // wl
lon_blk = lambda j: ((j - so) % LON) // wo
ref = torch.zeros_like(x)
for b in range(B):
    for i in range(LAT):
        for j in range(LON):
            kv = torch.stack([x[b, a, c] for a in range(LAT) for c in range(LON)
                              if lat_blk(a) == lat_blk(i) and lon_blk(c) == lon_blk(j)])
            p = ((kv @ Wk) @ (x[b, i, j] @ Wq) * C ** -0.5).softmax(-1)
            ref[b, i, j] = p @ (kv @ Wv)
d = (out - ref).abs().max().item()
print("max diff pangu lat-only shifted mask vs periodic-longitude loop:", d)
assert d < 1e-12
