# Perceiver-VL (zinengtang/Perceiver_VL#2): CrossAttention fills padded context keys with -inf and then
# applies torch.tanh to the scores, turning -inf into -1 so padded tokens get non-zero attention weight.
import sys
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class CrossAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_scale=None, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = qk_scale or head_dim ** -0.5
        self.q = nn.Linear(dim, dim, bias=True)
        self.k = nn.Linear(dim, dim, bias=True)
        self.v = nn.Linear(dim, dim, bias=True)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, context=None, mask=None):
        skip_x = x
        B, N, C = x.shape
        q = self.q(x).reshape(B, x.size(1), self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        k = self.k(context).reshape(B, context.size(1), self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        v = self.v(context).reshape(B, context.size(1), self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)

        attn = (q @ k.transpose(-2, -1)) * self.scale
        if mask is not None:
            mask = mask.bool()
            attn = attn.masked_fill(~mask[:, None, None, :], float("-inf"))
            if not FIXED:
                attn = torch.tanh(attn)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)

        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x, skip_x, attn


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CrossAttention(dim, num_heads=num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x, context=None, mask=None):
        _x, x, attn = self.attn(self.norm1(x), context=context, mask=mask)
        x = x + _x
        x = x + self.mlp(self.norm2(x))
        return x, attn


dim, heads, n_latents = 32, 4, 6
block = Block(dim, heads).eval()
latents = torch.randn(n_latents, dim)

# two text/video token sequences of lengths 12 and 7, right-padded to 12
lengths = [12, 7]
T = max(lengths)
context = torch.randn(len(lengths), T, dim)
mask = torch.zeros(len(lengths), T, dtype=torch.long)
for b, L in enumerate(lengths):
    mask[b, :L] = 1
    context[b, L:] = 5.0 * torch.randn(T - L, dim)  # padding content

with torch.no_grad():
    x = latents.unsqueeze(0).repeat(len(lengths), 1, 1)
    out, attn = block(x, context=context, mask=mask)
    # reference: each sample alone, unpadded, through the same cross-attention with an all-ones mask
    diffs = []
    for b, L in enumerate(lengths):
        ref, _ = block(latents.unsqueeze(0), context=context[b:b + 1, :L], mask=mask[b:b + 1, :L])
        diffs.append((out[b] - ref[0]).abs().max().item())
    pad_weight = attn[1, :, :, lengths[1]:].sum(-1).max().item()

print(f"attention mass on padded keys (sample 1): {pad_weight:.6f}")
print(f"max |padded batch - unpadded per-sample| : {max(diffs):.6f}")
