# Follows F5-TTS: src/f5_tts/model/utils.py lens_to_mask and src/f5_tts/model/modules.py AttnProcessor.__call__
# (bool key mask b 1 1 n expanded, non-causal SDPA, then x.masked_fill(~mask, 0) zeroes padded query frames).
# Padded mel frames are never attended to; their own outputs are zeroed and dropped.
import torch
import torch.nn.functional as F
torch.manual_seed(3)
dt = torch.float64
Dm, Hh, N = 32, 4, 18
lens = torch.tensor([18, 11, 6])

def lens_to_mask(t, length=None):
    if length is None:
        length = t.amax()
    seq = torch.arange(length)
    return seq[None, :] < t[:, None]

class Attn(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.q, s.k, s.v, s.o = (torch.nn.Linear(Dm, Dm, dtype=dt) for _ in range(4))
    def forward(s, x, mask=None):
        b, n, _ = x.shape
        sh = lambda t: t.view(b, n, Hh, -1).transpose(1, 2)
        q, k, v = sh(s.q(x)), sh(s.k(x)), sh(s.v(x))
        if mask is not None:
            attn_mask = mask.unsqueeze(1).unsqueeze(1).expand(b, Hh, n, n)
        else:
            attn_mask = None
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False)
        x = s.o(x.transpose(1, 2).reshape(b, n, Dm))
        if mask is not None:
            x = x.masked_fill(~mask.unsqueeze(-1), 0.0)
        return x

class Block(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.attn = Attn(); s.ff = torch.nn.Sequential(torch.nn.Linear(Dm, 64, dtype=dt), torch.nn.GELU(), torch.nn.Linear(64, Dm, dtype=dt))
        s.n1 = torch.nn.LayerNorm(Dm, dtype=dt); s.n2 = torch.nn.LayerNorm(Dm, dtype=dt)
    def forward(s, x, mask=None):
        x = x + s.attn(s.n1(x), mask)
        return x + s.ff(s.n2(x))

blocks = torch.nn.ModuleList([Block() for _ in range(2)])
x = torch.randn(len(lens), N, Dm, dtype=dt)
mask = lens_to_mask(lens, N)
x = x.masked_fill(~mask.unsqueeze(-1), 0.0)   # padded frames of the noisy mel / cond are zero
h = x
for blk in blocks:
    h = blk(h, mask)

diff = 0.0
for i, L in enumerate(lens.tolist()):
    r = x[i:i+1, :L]
    for blk in blocks:
        r = blk(r, None)                      # alone, unpadded, no mask
    diff = max(diff, (h[i, :L] - r[0]).abs().max().item())
print("max diff", diff)
assert diff < 1e-12
