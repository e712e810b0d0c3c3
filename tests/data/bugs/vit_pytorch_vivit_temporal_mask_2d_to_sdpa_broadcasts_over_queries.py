# vit-pytorch (lucidrains/vit-pytorch commit 4c89017, "fix up vivit", after PR #356 added frame masks to ViViT):
# the factorized-encoder temporal mask (b, f+1) was handed to F.scaled_dot_product_attention as a 2-D mask, which
# SDPA broadcasts as (query, key): with batch == f+1, query i of every clip uses clip i's frame mask.
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


class Transformer(nn.Module):
    def __init__(self, dim, depth, heads, dim_head, mlp_dim, dropout=0., use_flash_attn=True):
        super().__init__()
        self.use_flash_attn = use_flash_attn
        self.norm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Attention(dim, heads=heads, dim_head=dim_head, dropout=dropout),
                FeedForward(dim, mlp_dim, dropout=dropout)
            ]))

    def forward(self, x, mask=None):
        for attn, ff in self.layers:
            x = attn(x, mask=mask) + x
            x = ff(x) + x
        return self.norm(x)


class ViT(nn.Module):
    """ViViT, variant = 'factorized_encoder' (spatial transformer per frame, then temporal transformer)."""

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
        self.temporal_cls_token = nn.Parameter(torch.randn(1, 1, dim)) if not self.global_average_pool else None
        self.spatial_transformer = Transformer(dim, spatial_depth, heads, dim_head, mlp_dim, dropout, use_flash_attn)
        self.temporal_transformer = Transformer(dim, temporal_depth, heads, dim_head, mlp_dim, dropout, use_flash_attn)

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

        # attend across space
        x = x.reshape(b * f, -1, x.shape[-1])
        x = self.spatial_transformer(x)
        x = x.reshape(b, f, -1, x.shape[-1])

        # excise out the spatial cls tokens or average pool for temporal attention
        x = x[:, :, 0] if not self.global_average_pool else x.mean(dim=2)

        # append temporal CLS tokens
        if exists(self.temporal_cls_token):
            temporal_cls_tokens = self.temporal_cls_token.expand(b, 1, -1)
            x = torch.cat((temporal_cls_tokens, x), dim=1)
            if FIXED and exists(temporal_mask):
                temporal_mask = F.pad(temporal_mask, (1, 0), value=True)

        if not FIXED:
            if mask is not None:
                temporal_mask = torch.ones((b, f + 1), device=x.device, dtype=torch.bool)
                temporal_mask[:, 1:] = mask
            else:
                temporal_mask = None

        # attend across time
        x = self.temporal_transformer(x, mask=temporal_mask)

        # excise out temporal cls token or average pool
        x = x[:, 0] if not self.global_average_pool else x.mean(dim=1)

        x = self.to_latent(x)
        return self.mlp_head(x)


model = ViT(image_size=8, image_patch_size=4, frames=2, frame_patch_size=1, num_classes=5, dim=32,
            spatial_depth=1, temporal_depth=2, heads=2, dim_head=16, mlp_dim=64).eval()

# batch of 3 clips of 2 frames (batch == frames + 1, the case where SDPA's broadcast does not raise);
# clip 1 has its second frame padded
video = torch.randn(3, 3, 2, 8, 8)
mask = torch.tensor([[True, True], [True, False], [True, True]])

with torch.no_grad():
    batched = model(video, mask=mask)
    # reference: each clip alone (batch of 1, the mask then broadcasts over queries harmlessly)
    alone = torch.cat([model(video[i:i + 1], mask=mask[i:i + 1]) for i in range(3)])
    # and the padded frame's content must not matter
    video2 = video.clone()
    video2[1, :, 1] = torch.randn(3, 8, 8) * 5
    batched2 = model(video2, mask=mask)

print("max |batched - per-clip| logits:", (batched - alone).abs().max().item())
print("max |logits change when padded frame content changes|:", (batched - batched2).abs().max().item())
