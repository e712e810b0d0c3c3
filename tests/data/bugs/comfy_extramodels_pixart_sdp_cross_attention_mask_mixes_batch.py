# city96/ComfyUI_ExtraModels#36 (commit 0f88894): PixArt's MultiHeadCrossAttention flattens the batch into one
# sequence for xformers' BlockDiagonalMask; the torch SDP fallback built a float mask of zeros (with +1 entries)
# instead, so each image's tokens attended to the captions of every other sample in the batch (e.g. cond/uncond).
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

HIDDEN, HEADS, PATCH, IN_CH = 32, 4, 2, 4


def t2i_modulate(x, shift, scale):
    return x * (1 + scale) + shift


class MultiHeadCrossAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.q_linear = nn.Linear(d_model, d_model)
        self.kv_linear = nn.Linear(d_model, d_model * 2)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, cond, mask=None):
        # query/value: img tokens; key: condition; mask: if padding tokens
        B, N, C = x.shape
        q = self.q_linear(x).view(1, -1, self.num_heads, self.head_dim)
        kv = self.kv_linear(cond).view(1, -1, 2, self.num_heads, self.head_dim)
        k, v = kv.unbind(2)
        q, k, v = map(lambda t: t.permute(0, 2, 1, 3), (q, k, v))
        attn_mask = None
        if mask is not None and len(mask) > 1:
            if not FIXED:
                # This is most definitely wrong, especially for B>1
                attn_mask = torch.zeros([1, q.shape[1], q.shape[2], v.shape[2]], dtype=q.dtype)
                attn_mask[:, :, (q.shape[2] // 2):, mask[0]:] = True
                attn_mask[:, :, :(q.shape[2] // 2), :mask[1]] = True
            else:
                # Create equivalent of xformer diagonal block mask
                attn_mask_template = torch.ones([q.shape[2] // B, mask[0]], dtype=torch.bool)
                attn_mask = torch.block_diag(attn_mask_template)
                for n in range(B - 1):
                    attn_mask = torch.block_diag(attn_mask, attn_mask_template)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).permute(0, 2, 1, 3).contiguous()
        return self.proj(x.view(B, -1, C))


class PixArtBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(HIDDEN, elementwise_affine=False, eps=1e-6)
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.cross_attn = MultiHeadCrossAttention(HIDDEN, HEADS)
        self.norm2 = nn.LayerNorm(HIDDEN, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(approximate="tanh"), nn.Linear(4 * HIDDEN, HIDDEN))
        self.scale_shift_table = nn.Parameter(torch.randn(6, HIDDEN) / HIDDEN ** 0.5)

    def forward(self, x, y, t, mask=None):
        B, N, C = x.shape
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            self.scale_shift_table[None] + t.reshape(B, 6, -1)).chunk(6, dim=1)
        h = t2i_modulate(self.norm1(x), shift_msa, scale_msa)
        x = x + gate_msa * self.attn(h, h, h, need_weights=False)[0]
        x = x + self.cross_attn(x, y, mask)
        return x + gate_mlp * self.mlp(t2i_modulate(self.norm2(x), shift_mlp, scale_mlp))


class PixArt(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.x_embedder = nn.Linear(IN_CH * PATCH * PATCH, HIDDEN)
        self.t_embedder = nn.Sequential(nn.Linear(1, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, HIDDEN))
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(HIDDEN, 6 * HIDDEN))
        self.y_embedder = nn.Linear(24, HIDDEN)
        self.blocks = nn.ModuleList(PixArtBlock() for _ in range(depth))
        self.final_layer = nn.Linear(HIDDEN, IN_CH * PATCH * PATCH)

    def forward_raw(self, x, t, y, mask=None):
        # x: (N, T, C*p*p) patchified latents; y: (N, 1, L, C_text)
        x = self.x_embedder(x)
        t0 = self.t_block(self.t_embedder(t[:, None]))
        y = self.y_embedder(y)
        if mask is not None:
            mask = mask.squeeze(1).squeeze(1)
            y = y.squeeze(1).masked_select(mask.unsqueeze(-1) != 0).view(1, -1, x.shape[-1])
            y_lens = mask.sum(dim=1).tolist()
        else:
            y_lens = [y.shape[2]] * y.shape[0]
            y = y.squeeze(1).view(1, -1, x.shape[-1])
        for block in self.blocks:
            x = block(x, y, t0, y_lens)
        return self.final_layer(x)


def main():
    model = PixArt().eval()
    x = torch.randn(2, 16, IN_CH * PATCH * PATCH)  # 4x4 patches, cond and uncond halves of a CFG batch
    t = torch.tensor([500.0, 500.0]) / 1000
    context = torch.randn(2, 1, 6, 24)  # positive and negative prompt embeddings (same padded length)
    with torch.no_grad():
        out = model.forward_raw(x, t, context)
        alone = torch.cat([model.forward_raw(x[i:i + 1], t[i:i + 1], context[i:i + 1]) for i in range(2)])
    print(f"{'fixed' if FIXED else 'buggy'}: max |batched - one sample at a time| = {(out - alone).abs().max().item():.4e}")


if __name__ == "__main__":
    main()
