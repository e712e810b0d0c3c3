# Citation: lucidrains/TimeSformer-pytorch timesformer_pytorch/timesformer_pytorch.py @9a20466 (TimeSformer.forward, attn)
# Masking: videos with an uneven number of frames are padded; mask (b, f) bool keep. Time attention gets
#   frame_mask = pad(mask, cls=True) repeated over (b h n) so no patch attends padded frames; the cls token gets
#   cls_attn_mask over all (f n) patches of real frames. Spatial attention within a frame is unmasked (the frame's
#   own patches), and padded frames never reach the cls output. einops rearranges written with torch ops.
import torch
from torch import nn, einsum
import torch.nn.functional as F

torch.manual_seed(0)


def exists(val):
    return val is not None


class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, *args, **kwargs):
        x = self.norm(x)
        return self.fn(x, *args, **kwargs)


class GEGLU(nn.Module):
    def forward(self, x):
        x, gates = x.chunk(2, dim=-1)
        return x * F.gelu(gates)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4, dropout=0.):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult * 2), GEGLU(), nn.Dropout(dropout), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


def attn(q, k, v, mask=None):
    sim = einsum('b i d, b j d -> b i j', q, k)

    if exists(mask):
        max_neg_value = -torch.finfo(sim.dtype).max
        sim.masked_fill_(~mask, max_neg_value)

    attn = sim.softmax(dim=-1)
    out = einsum('b i j, b j d -> b i d', attn, v)
    return out


def to_time(t, n):   # '(b) (f n) d -> (b n) f d'
    B, FN, d = t.shape
    return t.reshape(B, FN // n, n, d).transpose(1, 2).reshape(B * n, FN // n, d)


def from_time(t, n):  # '(b n) f d -> b (f n) d'
    Bn, f, d = t.shape
    return t.reshape(Bn // n, n, f, d).transpose(1, 2).reshape(Bn // n, f * n, d)


def to_space(t, f):  # 'b (f n) d -> (b f) n d'
    B, FN, d = t.shape
    return t.reshape(B * f, FN // f, d)


def from_space(t, f):  # '(b f) n d -> b (f n) d'
    Bf, n, d = t.shape
    return t.reshape(Bf // f, f * n, d)


class Attention(nn.Module):
    def __init__(self, dim, dim_head=64, heads=8, dropout=0.):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        inner_dim = dim_head * heads
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim), nn.Dropout(dropout))

    def forward(self, x, mode, mask=None, cls_mask=None, **dims):
        h = self.heads
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        b, N, _ = q.shape
        # 'b n (h d) -> (b h) n d'
        q, k, v = map(lambda t: t.reshape(b, N, h, -1).transpose(1, 2).reshape(b * h, N, -1), (q, k, v))

        q = q * self.scale

        (cls_q, q_), (cls_k, k_), (cls_v, v_) = map(lambda t: (t[:, :1], t[:, 1:]), (q, k, v))

        # let classification token attend to key / values of all patches across time and space
        cls_out = attn(cls_q, k, v, mask=cls_mask)

        fwd, bwd = (to_time, from_time) if mode == 'time' else (to_space, from_space)
        arg = dims['n'] if mode == 'time' else dims['f']
        q_, k_, v_ = map(lambda t: fwd(t, arg), (q_, k_, v_))

        r = q_.shape[0] // cls_k.shape[0]
        cls_k, cls_v = map(lambda t: t.repeat_interleave(r, dim=0), (cls_k, cls_v))

        k_ = torch.cat((cls_k, k_), dim=1)
        v_ = torch.cat((cls_v, v_), dim=1)

        out = attn(q_, k_, v_, mask=mask)
        out = bwd(out, arg)
        out = torch.cat((cls_out, out), dim=1)
        # '(b h) n d -> b n (h d)'
        out = out.reshape(b, h, N, -1).transpose(1, 2).reshape(b, N, -1)
        return self.to_out(out)


class TimeSformer(nn.Module):
    def __init__(self, *, dim, num_frames, num_classes, image_size=224, patch_size=16, channels=3, depth=12,
                 heads=8, dim_head=64, attn_dropout=0., ff_dropout=0.):
        super().__init__()
        num_patches = (image_size // patch_size) ** 2
        num_positions = num_frames * num_patches
        patch_dim = channels * patch_size ** 2
        self.heads = heads
        self.patch_size = patch_size
        self.to_patch_embedding = nn.Linear(patch_dim, dim)
        self.cls_token = nn.Parameter(torch.randn(1, dim))
        self.pos_emb = nn.Embedding(num_positions + 1, dim)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                PreNorm(dim, Attention(dim, dim_head=dim_head, heads=heads, dropout=attn_dropout)),
                PreNorm(dim, Attention(dim, dim_head=dim_head, heads=heads, dropout=attn_dropout)),
                PreNorm(dim, FeedForward(dim, dropout=ff_dropout)),
            ]))
        self.to_out = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_classes))

    def forward(self, video, mask=None):
        b, f, c, H, W = video.shape
        p = self.patch_size
        hp, wp = (H // p), (W // p)
        n = hp * wp

        # 'b f c (h p1) (w p2) -> b (f h w) (p1 p2 c)'
        video = video.reshape(b, f, c, hp, p, wp, p).permute(0, 1, 3, 5, 4, 6, 2).reshape(b, f * n, p * p * c)
        tokens = self.to_patch_embedding(video)

        cls_token = self.cls_token.unsqueeze(0).expand(b, -1, -1)
        x = torch.cat((cls_token, tokens), dim=1)
        x = x + self.pos_emb(torch.arange(x.shape[1]))

        # calculate masking for uneven number of frames
        frame_mask = None
        cls_attn_mask = None
        if exists(mask):
            mask_with_cls = F.pad(mask, (1, 0), value=True)
            # 'b f -> (b h n) () f'
            frame_mask = mask_with_cls[:, None, None, None, :].expand(b, self.heads, n, 1, f + 1).reshape(b * self.heads * n, 1, f + 1)
            # 'b f -> (b h) () (f n)'
            cls_attn_mask = mask[:, None, None, :, None].expand(b, self.heads, 1, f, n).reshape(b * self.heads, 1, f * n)
            cls_attn_mask = F.pad(cls_attn_mask, (1, 0), value=True)

        for (time_attn, spatial_attn, ff) in self.layers:
            x = time_attn(x, 'time', n=n, mask=frame_mask, cls_mask=cls_attn_mask) + x
            x = spatial_attn(x, 'space', f=f, cls_mask=cls_attn_mask) + x
            x = ff(x) + x

        cls_token = x[:, 0]
        return self.to_out(cls_token)


model = TimeSformer(dim=64, image_size=32, patch_size=8, num_frames=6, num_classes=5, depth=2, heads=4, dim_head=16)
video = torch.randn(3, 6, 3, 32, 32)
mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
video = video * mask[:, :, None, None, None]
labels = torch.tensor([0, 3, 4])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
logits = model(video, mask=mask)
loss = F.cross_entropy(logits, labels)
loss.backward()
opt.step()
print(f"loss {loss.item():.4f}")
