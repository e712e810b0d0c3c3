# lucidrains/soundstorm-pytorch commit e7e7dc4 ("fix key padding mask for non-flash attention"): Attend's
# non-flash path (the one used with the T5 relative position bias) ignored the key padding mask it was given.
import math
import sys

import torch
from torch import nn, einsum
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


class Attend(nn.Module):
    def __init__(self, causal=False, dropout=0.0, flash=False):
        super().__init__()
        self.dropout = dropout
        self.attn_dropout = nn.Dropout(dropout)
        self.causal = causal
        self.flash = flash

    def get_mask(self, i, j, device):
        return torch.ones((i, j), device=device, dtype=torch.bool).triu(j - i + 1)

    def flash_attn(self, q, k, v, mask=None):
        heads, q_len = q.shape[1], q.shape[-2]
        if exists(mask) and mask.ndim != 4:
            mask = mask[:, None, None, :].expand(-1, heads, q_len, -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=self.causal)

    def forward(self, q, k, v, mask=None, attn_bias=None):
        q_len, k_len, device = q.shape[-2], k.shape[-2], q.device
        scale = q.shape[-1] ** -0.5

        if self.flash:
            assert not exists(attn_bias)
            return self.flash_attn(q, k, v, mask=mask)

        sim = einsum("b h i d, b h j d -> b h i j", q, k) * scale

        if exists(attn_bias):
            sim = sim + attn_bias

        if self.causal:
            causal_mask = self.get_mask(q_len, k_len, device)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)

        if FIXED:
            # key padding mask
            if exists(mask):
                if mask.ndim != 4:
                    mask = mask[:, None, None, :]  # b j -> b 1 1 j
                sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)

        attn = sim.softmax(dim=-1)
        attn = self.attn_dropout(attn)
        return einsum("b h i j, b h j d -> b h i d", attn, v)


class T5RelativePositionBias(nn.Module):
    def __init__(self, scale=1.0, num_buckets=32, max_distance=128, heads=8):
        super().__init__()
        self.scale, self.num_buckets, self.max_distance = scale, num_buckets, max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)

    @staticmethod
    def _relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
        ret = 0
        n = -relative_position
        num_buckets //= 2
        ret += (n < 0).long() * num_buckets
        n = torch.abs(n)
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)).long()
        val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
        return ret + torch.where(is_small, n, val_if_large)

    def forward(self, n):
        pos = torch.arange(n).long()
        rel_pos = pos[None, :] - pos[:, None]
        rp_bucket = self._relative_position_bucket(rel_pos, num_buckets=self.num_buckets, max_distance=self.max_distance)
        values = self.relative_attention_bias(rp_bucket)
        return values.permute(2, 0, 1) * self.scale  # i j h -> h i j


class Attention(nn.Module):
    def __init__(self, dim, heads=4, dim_head=16, flash=False):
        super().__init__()
        self.heads = heads
        self.attend = Attend(flash=flash)
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_kv = nn.Linear(dim, dim_head * heads * 2, bias=False)
        self.to_out = nn.Linear(dim_head * heads, dim)

    def forward(self, x, mask=None, attn_bias=None):
        b, n, h = x.shape[0], x.shape[1], self.heads
        q, k, v = (self.to_q(x), *self.to_kv(x).chunk(2, dim=-1))
        q, k, v = (t.view(b, n, h, -1).transpose(1, 2) for t in (q, k, v))  # b n (h d) -> b h n d
        out = self.attend(q, k, v, mask=mask, attn_bias=attn_bias)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class ConformerBlock(nn.Module):
    def __init__(self, dim, heads, attn_flash):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * 2), nn.SiLU(), nn.Linear(dim * 2, dim))
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads=heads, flash=attn_flash)
        self.ff2 = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * 2), nn.SiLU(), nn.Linear(dim * 2, dim))
        self.post_norm = nn.LayerNorm(dim)

    def forward(self, x, mask=None, attn_bias=None):
        x = 0.5 * self.ff1(x) + x
        x = self.attn(self.attn_norm(x), mask=mask, attn_bias=attn_bias) + x
        x = 0.5 * self.ff2(x) + x
        return self.post_norm(x)


class Conformer(nn.Module):
    def __init__(self, dim, depth=2, heads=4, attn_flash=False, t5_rel_pos_bias=True):
        super().__init__()
        assert not (t5_rel_pos_bias and attn_flash), "flash attention is not compatible with learned bias"
        self.rel_pos_bias = T5RelativePositionBias(dim**0.5, heads=heads) if t5_rel_pos_bias else None
        self.layers = nn.ModuleList(ConformerBlock(dim, heads, attn_flash) for _ in range(depth))

    def forward(self, x, mask=None):
        attn_bias = self.rel_pos_bias(x.shape[-2]) if exists(self.rel_pos_bias) else None
        for block in self.layers:
            x = block(x, mask=mask, attn_bias=attn_bias)
        return x


class ConformerWrapper(nn.Module):
    def __init__(self, codebook_size=32, num_quantizers=4, dim=32, pad_id=-1):
        super().__init__()
        self.codebook_size, self.num_quantizers, self.pad_id = codebook_size, num_quantizers, pad_id
        num_codes_with_mask = codebook_size + 1
        self.code_embeds = nn.Embedding(num_codes_with_mask * num_quantizers, dim)
        self.register_buffer("quantizer_offsets", torch.arange(num_quantizers) * num_codes_with_mask, persistent=False)
        self.conformer = Conformer(dim)
        self.heads = nn.Linear(dim, codebook_size * num_quantizers)

    def forward(self, x, mask=None):
        # x: (b, n, q) acoustic codes, padded with pad_id
        if not exists(mask):
            mask = (x != self.pad_id).all(dim=-1)
        x = x.masked_fill(x == self.pad_id, 0) + self.quantizer_offsets
        x = self.code_embeds(x).sum(dim=-2)  # sum the quantizer embeddings of each timestep
        x = self.conformer(x, mask=mask)
        return self.heads(x).view(*x.shape[:2], self.num_quantizers, self.codebook_size)


def main():
    torch.manual_seed(0)
    net = ConformerWrapper().eval()
    codes = torch.randint(0, 32, (2, 12, 4))
    codes[1, 7:] = -1  # variable length batch, right padded with pad_id
    with torch.no_grad():
        logits = net(codes)
        alone = net(codes[1:, :7])
    d = (logits[1, :7] - alone[0]).abs().max().item()
    print(f"{'fixed' if FIXED else 'buggy'}: max |logits of the short sequence, batched vs alone| = {d:.3e}")


if __name__ == "__main__":
    main()
