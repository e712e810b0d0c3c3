# hpcaitech/Open-Sora#609 (commit 06ffc8e): MultiHeadCrossAttention flattens the whole batch into one
# sequence and relies on a BlockDiagonalMask from the text lengths; with mask=None no bias was built, so
# every video's latent tokens attended to every prompt in the batch. Fix: mask = [Nc] * B when None.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class BlockDiagonalMask:
    """Minimal stand-in for xformers.ops.fmha.BlockDiagonalMask (q block i attends kv block i only)."""

    def __init__(self, q_seqlen, kv_seqlen):
        self.q_seqlen, self.kv_seqlen = q_seqlen, kv_seqlen

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None):
        return cls(list(q_seqlen), list(kv_seqlen if kv_seqlen is not None else q_seqlen))

    def materialize(self, shape, dtype=torch.float32):
        bias = torch.full(shape, float("-inf"), dtype=dtype)
        qs = ks = 0
        for ql, kl in zip(self.q_seqlen, self.kv_seqlen):
            bias[..., qs:qs + ql, ks:ks + kl] = 0
            qs, ks = qs + ql, ks + kl
        return bias


def memory_efficient_attention(q, k, v, p=0.0, attn_bias=None):
    """Stand-in for xformers.ops.memory_efficient_attention, layout (1, M, H, D)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    mask = None
    if attn_bias is not None:
        mask = attn_bias.materialize((q.shape[-2], k.shape[-2]), dtype=q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
    return out.transpose(1, 2)


class MultiHeadCrossAttention(nn.Module):
    def __init__(self, d_model, num_heads, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.q_linear = nn.Linear(d_model, d_model)
        self.kv_linear = nn.Linear(d_model, d_model * 2)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(d_model, d_model)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, cond, mask=None):
        # query/value: img tokens; key: condition; mask: if padding tokens
        B, N, C = x.shape
        if FIXED and mask is None:
            Bc, Nc, _ = cond.shape
            assert Bc == B
            mask = [Nc] * B

        q = self.q_linear(x).view(1, -1, self.num_heads, self.head_dim)
        kv = self.kv_linear(cond).view(1, -1, 2, self.num_heads, self.head_dim)
        k, v = kv.unbind(2)

        attn_bias = None
        if mask is not None:
            attn_bias = BlockDiagonalMask.from_seqlens([N] * B, mask)
        x = memory_efficient_attention(q, k, v, p=self.attn_drop.p, attn_bias=attn_bias)

        x = x.view(B, -1, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class STDiTBlock(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size)
        self.attn = nn.MultiheadAttention(hidden_size, num_heads, batch_first=True)
        self.cross_attn = MultiHeadCrossAttention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size))

    def forward(self, x, y, mask=None):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.cross_attn(x, y, mask)
        return x + self.mlp(self.norm2(x))


class STDiT(nn.Module):
    def __init__(self, in_channels=4, hidden_size=32, num_heads=4, depth=2, caption_channels=24):
        super().__init__()
        self.x_embedder = nn.Linear(in_channels, hidden_size)
        self.y_embedder = nn.Linear(caption_channels, hidden_size)
        self.blocks = nn.ModuleList([STDiTBlock(hidden_size, num_heads) for _ in range(depth)])
        self.final_layer = nn.Linear(hidden_size, in_channels)

    def forward(self, x, y, mask=None):
        # x: [B, T*H*W, C_in] patchified latents, y: [B, N_token, caption_channels] text encoder output
        x = self.x_embedder(x)
        y = self.y_embedder(y)  # all prompts full length here -> caller passes mask=None
        for block in self.blocks:
            x = block(x, y, mask)
        return self.final_layer(x)


model = STDiT().eval()
latents = torch.randn(2, 2 * 4 * 4, 4)  # 2 videos, T=2, H=W=4 latent tokens
prompts = torch.randn(2, 6, 24)  # 2 different prompts (T5 features), no padding
with torch.no_grad():
    out_batch = model(latents, prompts)
    out_alone = model(latents[:1], prompts[:1])
diff = (out_batch[0] - out_alone[0]).abs().max().item()
print(f"fixed={FIXED} max |video 0 in batch - video 0 alone| = {diff:.3e}")
