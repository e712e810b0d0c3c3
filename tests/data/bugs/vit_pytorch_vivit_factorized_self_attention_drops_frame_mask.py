# vit-pytorch (lucidrains/vit-pytorch commit 4c89017, "fix up vivit", after PR #356 added frame masks to ViViT):
# with variant='factorized_self_attention', ViT.forward accepted `mask` but never passed it to FactorizedTransformer,
# so the temporal attention of every patch still attends to the padded frames of a variable-length clip.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def pair(t):
    return t if isinstance(t, tuple) else (t, t)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, dropout=0.):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(dim),
            nn.Linear(dim, hidden_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, dim),
            nn.Dropout(dropout)
        )

    def forward(self, x):
        return self.net(x)


class Attention(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64, dropout=0., use_flash_attn=True):
        super().__init__()
        self.use_flash_attn = use_flash_attn
        self.dropout_p = dropout
        inner_dim = dim_head * heads
        project_out = not (heads == 1 and dim_head == dim)

        self.heads = heads
        self.scale = dim_head ** -0.5

        self.norm = nn.LayerNorm(dim)
        self.attend = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)

        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)

        self.to_out = nn.Sequential(
            nn.Linear(inner_dim, dim),
            nn.Dropout(dropout)
        ) if project_out else nn.Identity()

    def flash_attn(self, q, k, v, mask=None):
        out = F.scaled_dot_product_attention(q, k, v,
                                             attn_mask=mask,
                                             dropout_p=self.dropout_p,
                                             is_causal=False,
                                             scale=self.scale)
        return out

    def forward(self, x, mask=None):
        B, N, _ = x.size()
        x = self.norm(x)
        qkv = self.to_qkv(x).chunk(3, dim=-1)
        # rearrange(t, 'b n (h d) -> b h n d', h = self.heads)
        q, k, v = map(lambda t: t.reshape(B, N, self.heads, -1).transpose(1, 2), qkv)

        if FIXED and exists(mask):
            # fix: mask = rearrange(mask, 'b j -> b 1 1 j')
            mask = mask[:, None, None, :]

        if self.use_flash_attn:
            out = self.flash_attn(q, k, v, mask=mask)
        else:
            dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale
            if exists(mask):
                if FIXED:
                    dots = dots.masked_fill(~mask, -torch.finfo(dots.dtype).max)
                else:
                    dots = dots.masked_fill(mask.view(B, 1, 1, N) == 0, float('-inf'))
            attn = self.attend(dots)
            attn = self.dropout(attn)
            out = torch.matmul(attn, v)

        # rearrange(out, 'b h n d -> b n (h d)')
        out = out.transpose(1, 2).reshape(B, N, -1)
        return self.to_out(out)


class FactorizedTransformer(nn.Module):
    def __init__(self, dim, depth, heads, dim_head, mlp_dim, dropout=0., use_flash_attn=True):
        super().__init__()
        self.use_flash_attn = use_flash_attn
        self.norm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Attention(dim, heads=heads, dim_head=dim_head, dropout=dropout, use_flash_attn=use_flash_attn),
                Attention(dim, heads=heads, dim_head=dim_head, dropout=dropout, use_flash_attn=use_flash_attn),
                FeedForward(dim, mlp_dim, dropout=dropout)
            ]))

    def forward(self, x, mask=None):
        b, f, n, d = x.shape

        if FIXED and exists(mask):
            # fix: mask = repeat(mask, 'b ... -> (b space) ...', space = x.shape[2])
            mask = mask.repeat_interleave(n, dim=0)

        for spatial_attn, temporal_attn, ff in self.layers:
            x = x.reshape(b * f, n, d)                                  # 'b f n d -> (b f) n d'
            x = spatial_attn(x) + x
            x = x.reshape(b, f, n, d).transpose(1, 2).reshape(b * n, f, d)   # '(b f) n d -> (b n) f d'
            if FIXED:
                x = temporal_attn(x, mask=mask) + x
            else:
                x = temporal_attn(x) + x
            x = ff(x) + x
            x = x.reshape(b, n, f, d).transpose(1, 2)                   # '(b n) f d -> b f n d'

        return self.norm(x)


class ViT(nn.Module):
    """ViViT, variant = 'factorized_self_attention' (spatial then temporal attention inside every block)."""

    def __init__(self, *, image_size, image_patch_size, frames, frame_patch_size, num_classes, dim,
                 spatial_depth, temporal_depth, heads, mlp_dim, pool='cls', channels=3, dim_head=64,
                 dropout=0., emb_dropout=0., use_flash_attn=True):
        super().__init__()
        image_height, image_width = pair(image_size)
        patch_height, patch_width = pair(image_patch_size)
        self.ph, self.pw, self.pf = patch_height, patch_width, frame_patch_size

        num_image_patches = (image_height // patch_height) * (image_width // patch_width)
        num_frame_patches = (frames // frame_patch_size)
        patch_dim = channels * patch_height * patch_width * frame_patch_size

        self.frame_patch_size = frame_patch_size
        self.global_average_pool = pool == 'mean'

        self.patch_norm = nn.LayerNorm(patch_dim)
        self.patch_linear = nn.Linear(patch_dim, dim)
        self.patch_norm2 = nn.LayerNorm(dim)

        self.pos_embedding = nn.Parameter(torch.randn(1, num_frame_patches, num_image_patches, dim))
        self.dropout = nn.Dropout(emb_dropout)

        self.spatial_cls_token = nn.Parameter(torch.randn(1, 1, dim)) if not self.global_average_pool else None
        assert spatial_depth == temporal_depth, 'Spatial and temporal depth must be the same for factorized self-attention'
        self.factorized_transformer = FactorizedTransformer(dim, spatial_depth, heads, dim_head, mlp_dim, dropout, use_flash_attn)

        self.to_latent = nn.Identity()
        self.mlp_head = nn.Linear(dim, num_classes)

    def to_patch_embedding(self, video):
        # Rearrange('b c (f pf) (h p1) (w p2) -> b f (h w) (pf p1 p2 c)')
        b, c, T, H, W = video.shape
        pf, p1, p2 = self.pf, self.ph, self.pw
        x = video.reshape(b, c, T // pf, pf, H // p1, p1, W // p2, p2)
        x = x.permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(b, T // pf, (H // p1) * (W // p2), pf * p1 * p2 * c)
        return self.patch_norm2(self.patch_linear(self.patch_norm(x)))

    def forward(self, video, mask=None):
        x = self.to_patch_embedding(video)
        b, f, n, _ = x.shape

        x = x + self.pos_embedding[:, :f, :n]

        if exists(self.spatial_cls_token):
            spatial_cls_tokens = self.spatial_cls_token.expand(b, f, 1, -1)
            x = torch.cat((spatial_cls_tokens, x), dim=2)

        x = self.dropout(x)

        if FIXED:
            # fix: temporal_mask = reduce(mask, 'b (f patch) -> b f', 'all', patch = self.frame_patch_size)
            temporal_mask = None
            if exists(mask):
                temporal_mask = mask.reshape(b, -1, self.frame_patch_size).all(dim=-1)
            x = self.factorized_transformer(x, mask=temporal_mask)
        else:
            x = self.factorized_transformer(x)

        x = x[:, 0, 0] if not self.global_average_pool else x.mean(dim=(1, 2))

        x = self.to_latent(x)
        return self.mlp_head(x)


model = ViT(image_size=8, image_patch_size=4, frames=4, frame_patch_size=1, num_classes=5, dim=32,
            spatial_depth=2, temporal_depth=2, heads=2, dim_head=16, mlp_dim=64).eval()

# two clips padded to 4 frames; clip 1 has only 2 real frames
video = torch.randn(2, 3, 4, 8, 8)
video[1, :, 2:] = 0.
mask = torch.tensor([[True, True, True, True], [True, True, False, False]])

with torch.no_grad():
    batched = model(video, mask=mask)
    # reference: clip 1 with only its real frames (no padding at all)
    short = model(video[1:2, :, :2], mask=mask[1:2, :2])
    video2 = video.clone()
    video2[1, :, 2:] = torch.randn(3, 2, 8, 8) * 3  # different content in the padded frames
    batched2 = model(video2, mask=mask)

print("max |padded clip logits - unpadded clip logits|:", (batched[1] - short[0]).abs().max().item())
print("max |logits change when padded frames change|:", (batched[1] - batched2[1]).abs().max().item())
