# lucidrains/vit-pytorch commit 96f66d2 (issue lucidrains/vit-pytorch#306): NaViT builds the packed-sequence
# key_pad_mask as `lengths <= arange` (True on padding), so after `& attn_mask` real patches are masked out and the
# padded tail is attended (and a full-length group has every key masked); fixed to `arange < lengths`.
import sys
from functools import partial
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence as orig_pad_sequence

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


class LayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.register_buffer('beta', torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.beta)


class RMSNorm(nn.Module):
    def __init__(self, heads, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(heads, 1, dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.gamma


def FeedForward(dim, hidden_dim):
    return nn.Sequential(LayerNorm(dim), nn.Linear(dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, dim))


class Attention(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.norm = LayerNorm(dim)
        self.q_norm = RMSNorm(heads, dim_head)
        self.k_norm = RMSNorm(heads, dim_head)
        self.attend = nn.Softmax(dim=-1)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, context=None, mask=None, attn_mask=None):
        x = self.norm(x)
        kv_input = default(context, x)
        qkv = (self.to_q(x), *self.to_kv(kv_input).chunk(2, dim=-1))
        # rearrange 'b n (h d) -> b h n d'
        q, k, v = map(lambda t: t.reshape(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2), qkv)
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
        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
        return self.to_out(out)


class Transformer(nn.Module):
    def __init__(self, dim, depth, heads, dim_head, mlp_dim):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleList([Attention(dim, heads=heads, dim_head=dim_head),
                                                    FeedForward(dim, mlp_dim)]) for _ in range(depth)])
        self.norm = LayerNorm(dim)

    def forward(self, x, mask=None, attn_mask=None):
        for attn, ff in self.layers:
            x = attn(x, mask=mask, attn_mask=attn_mask) + x
            x = ff(x) + x
        return self.norm(x)


class NaViT(nn.Module):
    def __init__(self, *, image_size, patch_size, num_classes, dim, depth, heads, mlp_dim, channels=3, dim_head=16):
        super().__init__()
        patch_height_dim = patch_width_dim = image_size // patch_size
        patch_dim = channels * (patch_size ** 2)
        self.channels = channels
        self.patch_size = patch_size
        self.to_patch_embedding = nn.Sequential(LayerNorm(patch_dim), nn.Linear(patch_dim, dim), LayerNorm(dim))
        self.pos_embed_height = nn.Parameter(torch.randn(patch_height_dim, dim))
        self.pos_embed_width = nn.Parameter(torch.randn(patch_width_dim, dim))
        self.transformer = Transformer(dim, depth, heads, dim_head, mlp_dim)
        self.attn_pool_queries = nn.Parameter(torch.randn(dim))
        self.attn_pool = Attention(dim=dim, dim_head=dim_head, heads=heads)
        self.mlp_head = nn.Sequential(LayerNorm(dim), nn.Linear(dim, num_classes, bias=False))

    def patchify(self, image):
        p = self.patch_size
        c, H, W = image.shape
        ph, pw = H // p, W // p
        pos = torch.stack(torch.meshgrid((torch.arange(ph), torch.arange(pw)), indexing='ij'), dim=-1).reshape(-1, 2)
        # rearrange 'c (h p1) (w p2) -> (h w) (c p1 p2)'
        seq = image.reshape(c, ph, p, pw, p).permute(1, 3, 0, 2, 4).reshape(ph * pw, c * p * p)
        return seq, pos

    def forward(self, batched_images):
        arange = torch.arange
        pad_sequence = partial(orig_pad_sequence, batch_first=True)
        num_images, batched_sequences, batched_positions, batched_image_ids = [], [], [], []
        for images in batched_images:
            num_images.append(len(images))
            sequences, positions = [], []
            image_ids = torch.empty((0,), dtype=torch.long)
            for image_id, image in enumerate(images):
                seq, pos = self.patchify(image)
                image_ids = F.pad(image_ids, (0, seq.shape[-2]), value=image_id)
                sequences.append(seq)
                positions.append(pos)
            batched_image_ids.append(image_ids)
            batched_sequences.append(torch.cat(sequences, dim=0))
            batched_positions.append(torch.cat(positions, dim=0))

        # derive key padding mask
        lengths = torch.tensor([seq.shape[-2] for seq in batched_sequences], dtype=torch.long)
        if FIXED:
            seq_arange = arange(lengths.amax().item())
            key_pad_mask = seq_arange[None, :] < lengths[:, None]
        else:
            max_length = arange(lengths.amax().item())
            key_pad_mask = lengths[:, None] <= max_length[None, :]

        # derive attention mask, and combine with key padding mask from above
        batched_image_ids = pad_sequence(batched_image_ids)
        attn_mask = batched_image_ids[:, None, :, None] == batched_image_ids[:, None, None, :]
        attn_mask = attn_mask & key_pad_mask[:, None, None, :]

        patches = pad_sequence(batched_sequences)
        patch_positions = pad_sequence(batched_positions)
        num_images = torch.tensor(num_images, dtype=torch.long)
        x = self.to_patch_embedding(patches)
        h_indices, w_indices = patch_positions.unbind(dim=-1)
        x = x + self.pos_embed_height[h_indices] + self.pos_embed_width[w_indices]
        x = self.transformer(x, attn_mask=attn_mask)

        max_queries = num_images.amax().item()
        queries = self.attn_pool_queries.expand(x.shape[0], max_queries, -1)
        image_id_arange = arange(max_queries)
        attn_pool_mask = image_id_arange[:, None] == batched_image_ids[:, None, :]
        attn_pool_mask = attn_pool_mask & key_pad_mask[:, None, :]
        attn_pool_mask = attn_pool_mask[:, None]
        x = self.attn_pool(queries, context=x, attn_mask=attn_pool_mask) + queries
        x = x.reshape(-1, x.shape[-1])
        is_images = (image_id_arange[None, :] < num_images[:, None]).reshape(-1)
        x = x[is_images]
        return self.mlp_head(x)

    def forward_single_unmasked(self, image):
        # reference: one image, its own sequence, no padding and no mask needed
        seq, pos = self.patchify(image)
        x = self.to_patch_embedding(seq[None])
        x = x + self.pos_embed_height[pos[None, :, 0]] + self.pos_embed_width[pos[None, :, 1]]
        x = self.transformer(x)
        q = self.attn_pool_queries.expand(1, 1, -1)
        x = self.attn_pool(q, context=x) + q
        return self.mlp_head(x[:, 0])


model = NaViT(image_size=16, patch_size=4, num_classes=10, dim=32, depth=2, heads=2, mlp_dim=64).eval()
batched = [
    [torch.randn(3, 16, 16), torch.randn(3, 8, 16)],   # 16 + 8 = 24 patches (longest group)
    [torch.randn(3, 16, 8), torch.randn(3, 8, 8)],     # 8 + 4 = 12 patches, padded to 24
]
with torch.no_grad():
    logits = model(batched)
    ref = torch.cat([model.forward_single_unmasked(img) for group in batched for img in group])
print("max |packed logits - per-image logits| = %.6f" % (logits - ref).abs().max().item())
