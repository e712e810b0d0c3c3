# huggingface/pytorch-image-models commit 4d9c87bb: "Fix polarity on prefix remove"
# NaFlexVit._pool with a MAP head (global_pool='map') was meant to drop the class/register prefix tokens from the
# keys of the attention pool unless `pool_include_prefix` is set, but the test was inverted
# (`if self.pool_include_prefix: x = x[:, num_prefix_tokens:]`), so with the default pool_include_prefix=False the
# latent query attended to the cls + register tokens as well as the patches. The fix flips it to `if not ...`.
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class NaFlexVitCfg:  # trimmed timm NaFlexVitCfg
    patch_size = 4
    embed_dim = 32
    depth = 2
    num_heads = 4
    mlp_ratio = 2.0
    class_token = True
    reg_tokens = 4
    global_pool = 'map'
    pool_include_prefix = False  # Whether to include class/register prefix tokens in global pooling


def create_attention_mask(patch_valid, num_prefix_tokens=0, symmetric=True, q_len=None, dtype=torch.float32):
    if patch_valid is None:
        return None
    patch_valid = patch_valid.bool()
    B, N = patch_valid.shape
    kv_len = N
    if num_prefix_tokens > 0:
        prefix_valid = patch_valid.new_ones((B, num_prefix_tokens), dtype=torch.bool)
        patch_valid = torch.cat([prefix_valid, patch_valid], dim=1)
        kv_len += num_prefix_tokens
    if symmetric:
        mask_bool = (patch_valid.unsqueeze(-1) & patch_valid.unsqueeze(1)).unsqueeze(1)
    else:
        q_len = q_len or kv_len
        mask_bool = patch_valid[:, None, None, :].expand(B, 1, q_len, kv_len)
    mask_float = torch.zeros_like(mask_bool, dtype=dtype)
    mask_float.masked_fill_(~mask_bool, torch.finfo(dtype).min)
    return mask_float


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, attn_mask: Optional[torch.Tensor] = None):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, num_heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x, attn_mask: Optional[torch.Tensor] = None):
        x = x + self.attn(self.norm1(x), attn_mask=attn_mask)
        return x + self.mlp(self.norm2(x))


class AttentionPoolLatent(nn.Module):
    """timm.layers.AttentionPoolLatent (MAP head), non-fused path."""
    def __init__(self, in_features, num_heads=8, mlp_ratio=4.0, latent_len=1, pool_type='token'):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = in_features // num_heads
        self.scale = self.head_dim ** -0.5
        self.pool = pool_type
        self.latent_len = latent_len
        self.latent = nn.Parameter(torch.randn(1, latent_len, in_features) * in_features ** -0.5)
        self.q = nn.Linear(in_features, in_features)
        self.kv = nn.Linear(in_features, in_features * 2)
        self.proj = nn.Linear(in_features, in_features)
        self.norm = nn.LayerNorm(in_features)
        self.mlp = Mlp(in_features, int(in_features * mlp_ratio))

    def forward(self, x, attn_mask: Optional[torch.Tensor] = None):
        B, N, C = x.shape
        q_latent = self.latent.expand(B, -1, -1)
        q = self.q(q_latent).reshape(B, self.latent_len, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        if attn_mask is not None:
            attn = attn + attn_mask
        attn = attn.softmax(dim=-1)
        self.last_attn = attn.detach()
        x = attn @ v
        x = x.transpose(1, 2).reshape(B, self.latent_len, C)
        x = self.proj(x)
        x = x + self.mlp(self.norm(x))
        return x[:, 0] if self.pool == 'token' else x.mean(1)


class NaFlexVit(nn.Module):
    def __init__(self, cfg, in_chans=3, num_classes=10):
        super().__init__()
        self.num_prefix_tokens = int(cfg.class_token) + cfg.reg_tokens
        self.pool_include_prefix = cfg.pool_include_prefix
        self.patch_size = cfg.patch_size
        self.proj = nn.Linear(in_chans * cfg.patch_size ** 2, cfg.embed_dim)
        self.pos_embed = nn.Parameter(torch.randn(1, 64, cfg.embed_dim) * .02)
        self.cls_token = nn.Parameter(torch.randn(1, 1, cfg.embed_dim) * .02) if cfg.class_token else None
        self.reg_token = nn.Parameter(torch.randn(1, cfg.reg_tokens, cfg.embed_dim) * .02) if cfg.reg_tokens else None
        self.blocks = nn.Sequential(*[Block(cfg.embed_dim, cfg.num_heads, cfg.mlp_ratio) for _ in range(cfg.depth)])
        self.norm = nn.LayerNorm(cfg.embed_dim)
        self.attn_pool = AttentionPoolLatent(cfg.embed_dim, num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_ratio) \
            if cfg.global_pool == 'map' else None
        self.fc_norm = nn.Identity()
        self.head = nn.Linear(cfg.embed_dim, num_classes)

    def embeds(self, x):
        B, C, H, W = x.shape
        p = self.patch_size
        x = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, (H // p) * (W // p), -1)
        x = self.proj(x) + self.pos_embed[:, :x.shape[1]]
        to_cat = []
        if self.cls_token is not None:
            to_cat.append(self.cls_token.expand(B, -1, -1))
        if self.reg_token is not None:
            to_cat.append(self.reg_token.expand(B, -1, -1))
        if to_cat:
            x = torch.cat(to_cat + [x], dim=1)
        return x

    def forward_features(self, x, patch_valid=None):
        attn_mask = create_attention_mask(patch_valid, num_prefix_tokens=self.num_prefix_tokens, dtype=x.dtype)
        x = self.embeds(x)
        for blk in self.blocks:
            x = blk(x, attn_mask=attn_mask)
        return self.norm(x)

    def _pool(self, x, pool_type=None, patch_valid=None):
        if self.attn_pool is not None:
            attn_mask = create_attention_mask(
                patch_valid,
                num_prefix_tokens=self.num_prefix_tokens if self.pool_include_prefix else 0,
                symmetric=False,
                q_len=1,
                dtype=x.dtype,
            )
            if FIXED:
                if not self.pool_include_prefix:
                    x = x[:, self.num_prefix_tokens:]
            else:
                if self.pool_include_prefix:
                    x = x[:, self.num_prefix_tokens:]
            x = self.attn_pool(x, attn_mask=attn_mask)
            return x
        raise NotImplementedError

    def forward_head(self, x, pre_logits=False, patch_valid=None):
        x = self._pool(x, patch_valid=patch_valid)
        x = self.fc_norm(x)
        return x if pre_logits else self.head(x)

    def forward(self, x, patch_valid=None):
        x = self.forward_features(x, patch_valid=patch_valid)
        return self.forward_head(x, patch_valid=patch_valid)


cfg = NaFlexVitCfg()
model = NaFlexVit(cfg)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

# a training step on a plain fixed-size image batch (no NaFlex padding: patch_valid is None)
imgs = torch.randn(2, 3, 16, 16)
labels = torch.tensor([3, 5])
logits = model(imgs)
loss = F.cross_entropy(logits, labels)
loss.backward()
opt.step()

attn = model.attn_pool.last_attn  # [B, heads, 1, keys]
n_keys = attn.shape[-1]
prefix_weight = attn[..., :n_keys - 16].sum(-1).mean().item() if n_keys > 16 else 0.0
print("fixed" if FIXED else "buggy", "loss %.6f" % loss.item(), "MAP pool keys:", n_keys,
      "mean weight on cls/reg tokens %.4f" % prefix_weight)
