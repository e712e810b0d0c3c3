"""Stable Diffusion v1 (CompVis/stable-diffusion) UNet SpatialTransformer with classifier-free guidance.

Follows ldm/modules/attention.py (CrossAttention: `sim = einsum('b i d, b j d -> b i j', q, k) * scale`,
optional `mask` that the UNet never passes; BasicTransformerBlock: attn1 self-attention over the h*w
latent pixels, attn2 cross-attention to `context`; SpatialTransformer) and scripts/txt2img.py (uc =
model.get_learned_conditioning(batch_size * [""]), `x_in = torch.cat([x] * 2)`, `c_in = torch.cat([uc, c])`).
The CLIP text context always has 77 positions (prompt, <eos>, then padding). Stable Diffusion was
trained to attend to ALL 77 of them with no padding mask - the padded positions carry the causal CLIP
encoder's summary of the prompt - so the cross-attention here is deliberately unmasked, including for the
empty unconditional prompt. Self-attention over the 8x8 = 64 latent tokens is unmasked too.
"""
from inspect import isfunction

import torch
import torch.nn as nn


def exists(val):
    return val is not None


def default(val, d):
    if exists(val):
        return val
    return d() if isfunction(d) else d


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = default(context_dim, query_dim)
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, mask=None):
        h = self.heads
        q = self.to_q(x)
        context = default(context, x)
        k = self.to_k(context)
        v = self.to_v(context)
        # einops rearrange "b n (h d) -> (b h) n d", spelled in torch (einops is not installed here)
        q, k, v = map(lambda t: t.reshape(t.shape[0], t.shape[1], h, -1).permute(0, 2, 1, 3).reshape(t.shape[0] * h, t.shape[1], -1), (q, k, v))
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale
        if exists(mask):
            mask = mask.reshape(mask.shape[0], -1)
            max_neg_value = -torch.finfo(sim.dtype).max
            mask = mask.repeat_interleave(h, dim=0)[:, None, :]
            sim.masked_fill_(~mask, max_neg_value)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b i j, b j d -> b i d", attn, v)
        out = out.reshape(-1, h, out.shape[1], out.shape[2]).permute(0, 2, 1, 3).flatten(2)
        return self.to_out(out)


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, d_head, context_dim=None):
        super().__init__()
        self.attn1 = CrossAttention(query_dim=dim, heads=n_heads, dim_head=d_head)  # self-attention
        self.ff = nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))
        self.attn2 = CrossAttention(query_dim=dim, context_dim=context_dim, heads=n_heads, dim_head=d_head)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)

    def forward(self, x, context=None):
        x = self.attn1(self.norm1(x)) + x
        x = self.attn2(self.norm2(x), context=context) + x
        x = self.ff(self.norm3(x)) + x
        return x


class SpatialTransformer(nn.Module):
    def __init__(self, in_channels, n_heads, d_head, depth=1, context_dim=None):
        super().__init__()
        inner_dim = n_heads * d_head
        self.norm = nn.GroupNorm(num_groups=8, num_channels=in_channels, eps=1e-6, affine=True)
        self.proj_in = nn.Conv2d(in_channels, inner_dim, kernel_size=1)
        self.transformer_blocks = nn.ModuleList([BasicTransformerBlock(inner_dim, n_heads, d_head, context_dim=context_dim) for _ in range(depth)])
        self.proj_out = nn.Conv2d(inner_dim, in_channels, kernel_size=1)

    def forward(self, x, context=None):
        b, c, h, w = x.shape
        x_in = x
        x = self.proj_in(self.norm(x))
        x = x.flatten(2).transpose(1, 2)  # b c h w -> b (h w) c
        for block in self.transformer_blocks:
            x = block(x, context=context)
        x = x.transpose(1, 2).reshape(b, -1, h, w)
        return self.proj_out(x) + x_in


class FrozenCLIPEmbedderStub(nn.Module):
    """Stands in for FrozenCLIPEmbedder: padding="max_length", max_length=77, causal CLIP text encoder."""

    def __init__(self, vocab=100, dim=32, max_length=77):
        super().__init__()
        self.max_length = max_length
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_length, dim) * 0.02)
        self.layer = nn.TransformerEncoderLayer(dim, 4, dim * 2, dropout=0.0, batch_first=True)
        self.bos, self.eos = 98, 99

    def encode(self, prompts):
        ids = []
        for p in prompts:
            toks = [self.bos] + [hash_word(w) for w in p.split()] + [self.eos]
            toks = toks + [self.eos] * (self.max_length - len(toks))  # CLIP pads with <|endoftext|>
            ids.append(toks)
        ids = torch.tensor(ids)
        z = self.tok(ids) + self.pos
        causal = nn.Transformer.generate_square_subsequent_mask(self.max_length)
        return self.layer(z, src_mask=causal, is_causal=True)


def hash_word(w):
    return sum(ord(ch) for ch in w) % 97


def main():
    torch.manual_seed(0)
    batch_size, scale = 2, 7.5
    cond_stage_model = FrozenCLIPEmbedderStub().eval()
    st = SpatialTransformer(in_channels=16, n_heads=4, d_head=8, context_dim=32).eval()
    prompts = ["a photograph of an astronaut riding a horse", "a red cube"]
    x = torch.randn(batch_size, 16, 8, 8)
    with torch.no_grad():
        uc = cond_stage_model.encode(batch_size * [""])
        c = cond_stage_model.encode(prompts)
        x_in = torch.cat([x] * 2)
        c_in = torch.cat([uc, c])
        e_t_uncond, e_t = st(x_in, context=c_in).chunk(2)
        e_t = e_t_uncond + scale * (e_t - e_t_uncond)
    print("guided eps", tuple(e_t.shape), f"{e_t.std().item():.4f}")


if __name__ == "__main__":
    main()
