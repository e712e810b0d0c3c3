# Citation: lucidrains/vit-pytorch vit_pytorch/na_vit.py (NaViT.forward, Attention) - einops rearranges written as
#   plain torch ops so the program needs only torch.
# Patch n' Pack: images of different sizes are packed into sequences; image_ids (0-based per row, pad_sequence pads 0)
# give the bool keep mask image_ids[:, None, :, None] == image_ids[:, None, None, :] ANDed with key_pad_mask, so patches
# attend only within their image and never to padding. Attention pooling uses one query per image slot; a slot beyond
# a row's image count has no keys (a fully masked row, filled with -finfo.max so softmax stays finite) and is dropped
# on purpose by the is_images selection before the head.
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence as orig_pad_sequence

torch.manual_seed(0)


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def pad_sequence(*args, **kw):
    return orig_pad_sequence(*args, batch_first=True, **kw)


class RMSNorm(nn.Module):
    def __init__(self, heads, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(heads, 1, dim))

    def forward(self, x):
        normed = F.normalize(x, dim=-1)
        return normed * self.scale * self.gamma


class Attention(nn.Module):
    def __init__(self, dim, heads=4, dim_head=16):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.q_norm = RMSNorm(heads, dim_head)
        self.k_norm = RMSNorm(heads, dim_head)
        self.attend = nn.Softmax(dim=-1)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim, bias=False))

    def forward(self, x, context=None, mask=None, attn_mask=None):
        x = self.norm(x)
        kv_input = default(context, x)
        qkv = (self.to_q(x), *self.to_kv(kv_input).chunk(2, dim=-1))
        q, k, v = map(lambda t: t.view(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2), qkv)  # b n (h d) -> b h n d
        q = self.q_norm(q)
        k = self.k_norm(k)
        dots = torch.matmul(q, k.transpose(-1, -2))
        if exists(mask):
            mask = mask[:, None, None, :]
            dots = dots.masked_fill(~mask, -torch.finfo(dots.dtype).max)
        if exists(attn_mask):
            dots = dots.masked_fill(~attn_mask, -torch.finfo(dots.dtype).max)
        attn = self.attend(dots)
        out = torch.matmul(attn, v)
        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)  # b h n d -> b n (h d)
        return self.to_out(out)


class Transformer(nn.Module):
    def __init__(self, dim, depth, heads, dim_head, mlp_dim):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleList([
            Attention(dim, heads, dim_head),
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim))])
            for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, mask=None, attn_mask=None):
        for attn, ff in self.layers:
            x = attn(x, mask=mask, attn_mask=attn_mask) + x
            x = ff(x) + x
        return self.norm(x)


class NaViT(nn.Module):
    def __init__(self, *, image_size, patch_size, num_classes, dim, depth, heads, mlp_dim, channels=3, dim_head=16):
        super().__init__()
        self.patch_size = patch_size
        patch_dim = channels * patch_size ** 2
        self.to_patch_embedding = nn.Sequential(nn.LayerNorm(patch_dim), nn.Linear(patch_dim, dim), nn.LayerNorm(dim))
        n = image_size // patch_size
        self.pos_embed_height = nn.Parameter(torch.randn(n, dim))
        self.pos_embed_width = nn.Parameter(torch.randn(n, dim))
        self.transformer = Transformer(dim, depth, heads, dim_head, mlp_dim)
        self.attn_pool_queries = nn.Parameter(torch.randn(dim))
        self.attn_pool = Attention(dim=dim, dim_head=dim_head, heads=heads)
        self.mlp_head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_classes, bias=False))

    def forward(self, batched_images):
        p, c = self.patch_size, 3
        num_images = []
        batched_sequences, batched_positions, batched_image_ids = [], [], []
        for images in batched_images:
            num_images.append(len(images))
            sequences, positions = [], []
            image_ids = torch.empty((0,), dtype=torch.long)
            for image_id, image in enumerate(images):
                ph, pw = image.shape[-2] // p, image.shape[-1] // p
                pos = torch.stack(torch.meshgrid(torch.arange(ph), torch.arange(pw), indexing='ij'), dim=-1)
                pos = pos.reshape(-1, 2)
                seq = image.reshape(c, ph, p, pw, p).permute(1, 3, 2, 4, 0).reshape(ph * pw, p * p * c)
                image_ids = F.pad(image_ids, (0, seq.shape[-2]), value=image_id)
                sequences.append(seq)
                positions.append(pos)
            batched_image_ids.append(image_ids)
            batched_sequences.append(torch.cat(sequences, dim=0))
            batched_positions.append(torch.cat(positions, dim=0))
        num_images = torch.tensor(num_images)
        lengths = torch.tensor([seq.shape[-2] for seq in batched_sequences])
        seq_arange = torch.arange(int(lengths.amax()))
        key_pad_mask = seq_arange[None, :] < lengths[:, None]            # True = real patch (keep)
        image_ids = pad_sequence(batched_image_ids)
        attn_mask = image_ids[:, None, :, None] == image_ids[:, None, None, :]
        attn_mask = attn_mask & key_pad_mask[:, None, None, :]
        patches = pad_sequence(batched_sequences)
        patch_positions = pad_sequence(batched_positions)
        x = self.to_patch_embedding(patches)
        h_indices, w_indices = patch_positions.unbind(dim=-1)
        x = x + self.pos_embed_height[h_indices] + self.pos_embed_width[w_indices]
        x = self.transformer(x, attn_mask=attn_mask)
        max_queries = int(num_images.amax())
        queries = self.attn_pool_queries.expand(x.shape[0], max_queries, -1)
        image_id_arange = torch.arange(max_queries)
        attn_pool_mask = image_id_arange[:, None] == image_ids[:, None, :]
        attn_pool_mask = attn_pool_mask & key_pad_mask[:, None, :]
        attn_pool_mask = attn_pool_mask[:, None]
        x = self.attn_pool(queries, context=x, attn_mask=attn_pool_mask) + queries
        x = x.reshape(-1, x.shape[-1])
        is_images = image_id_arange < num_images[:, None]
        is_images = is_images.reshape(-1)
        x = x[is_images]
        return self.mlp_head(x)


v = NaViT(image_size=64, patch_size=16, num_classes=5, dim=32, depth=2, heads=4, mlp_dim=64)
images = [
    [torch.randn(3, 64, 32), torch.randn(3, 32, 48)],
    [torch.randn(3, 48, 64)],
    [torch.randn(3, 32, 32), torch.randn(3, 16, 64), torch.randn(3, 16, 16)],
]
preds = v(images)
loss = F.cross_entropy(preds, torch.randint(0, 5, (preds.shape[0],)))
loss.backward()
print("images", preds.shape[0], "loss %.4f" % loss.item())
