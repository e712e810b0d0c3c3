# Citation: facebookresearch/ToMe tome/patch/timm.py @049a70550eb6fb8a4b7ddd45b7fa4fe8bebe97ca (tome/merge.py bipartite_soft_matching / merge_wavg as released; that file was not in the index)
# Token merging drops r tokens per block: bipartite_soft_matching scores even (a) vs odd (b) tokens by cosine of
# the mean key, sets scores[..., 0, :] = -inf so the class token is never merged away, and merges the top-r a
# tokens into their best b match (size-weighted average). Proportional attention then adds log(size) to every
# query's scores for each key column, so a merged token counts as the tokens it stands for.
import math

import torch
import torch.nn as nn

torch.manual_seed(0)


def do_nothing(x, mode=None):
    return x


def bipartite_soft_matching(metric, r, class_token=False, distill_token=False):
    protected = 0
    if class_token:
        protected += 1
    if distill_token:
        protected += 1
    t = metric.shape[1]
    r = min(r, (t - protected) // 2)
    if r <= 0:
        return do_nothing, do_nothing
    with torch.no_grad():
        metric = metric / metric.norm(dim=-1, keepdim=True)
        a, b = metric[..., ::2, :], metric[..., 1::2, :]
        scores = a @ b.transpose(-1, -2)
        if class_token:
            scores[..., 0, :] = -math.inf
        if distill_token:
            scores[..., :, 0] = -math.inf
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
        unm_idx = edge_idx[..., r:, :]  # Unmerged Tokens
        src_idx = edge_idx[..., :r, :]  # Merged Tokens
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
        if class_token:
            # Sort to ensure the class token is at the start
            unm_idx = unm_idx.sort(dim=1)[0]

    def merge(x, mode="mean"):
        src, dst = x[..., ::2, :], x[..., 1::2, :]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
        src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
        dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)
        if distill_token:
            return torch.cat([unm[:, :1], dst[:, :1], unm[:, 1:], dst[:, 1:]], dim=1)
        else:
            return torch.cat([unm, dst], dim=1)

    def unmerge(x):
        raise NotImplementedError

    return merge, unmerge


def merge_wavg(merge, x, size=None):
    if size is None:
        size = torch.ones_like(x[..., 0, None])
    x = merge(x * size, mode="sum")
    size = merge(size, mode="sum")
    x = x / size
    return x, size


def parse_r(num_layers, r):
    return [r] * num_layers


class ToMeAttention(nn.Module):
    def __init__(self, dim, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x, size=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * self.scale
        # Apply proportional attention
        if size is not None:
            attn = attn + size.log()[:, None, None, :, 0]
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        x = self.proj_drop(self.proj(x))
        return x, k.mean(1)


class ToMeBlock(nn.Module):
    def __init__(self, dim, tome_info):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ToMeAttention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self._tome_info = tome_info

    def forward(self, x):
        attn_size = self._tome_info["size"] if self._tome_info["prop_attn"] else None
        x_attn, metric = self.attn(self.norm1(x), attn_size)
        x = x + x_attn
        r = self._tome_info["r"].pop(0)
        if r > 0:
            merge, _ = bipartite_soft_matching(metric, r, self._tome_info["class_token"],
                                               self._tome_info["distill_token"])
            x, self._tome_info["size"] = merge_wavg(merge, x, self._tome_info["size"])
        x = x + self.mlp(self.norm2(x))
        return x


class ToMeVisionTransformer(nn.Module):
    def __init__(self, img_size=32, patch_size=4, dim=32, depth=4, num_classes=5):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch_size, patch_size)
        n = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.r = 0
        self._tome_info = {"r": self.r, "size": None, "source": None, "trace_source": False, "prop_attn": True,
                           "class_token": self.cls_token is not None, "distill_token": False}
        self.blocks = nn.ModuleList([ToMeBlock(dim, self._tome_info) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, imgs):
        self._tome_info["r"] = parse_r(len(self.blocks), self.r)
        self._tome_info["size"] = None
        self._tome_info["source"] = None
        x = self.patch_embed(imgs).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        return self.head(x[:, 0])  # class token pooling


model = ToMeVisionTransformer().eval()
imgs = torch.randn(2, 3, 32, 32)
with torch.no_grad():
    base = model(imgs)
    model.r = 8
    merged = model(imgs)
size = model._tome_info["size"]
print("tokens left", size.shape[1], "sizes sum", size.sum(1).squeeze(-1).tolist(), "cls size", size[:, 0, 0].tolist())
assert size.shape[1] == 65 - 4 * 8
assert torch.all(size.sum(1) == 65) and torch.all(size[:, 0, 0] == 1)
print("max logit change with r=8:", (merged - base).abs().max().item())
