"""Perceiver (lucidrains/perceiver-pytorch perceiver_pytorch/perceiver_pytorch.py): latents over padded inputs.

Follows lucidrains/perceiver-pytorch: `Attention.forward(x, context=None, mask=None)` computes
`sim = einsum('b i d, b j d -> b i j', q, k) * scale`, and when a mask over the context is given fills
`~mask` columns with `-torch.finfo(sim.dtype).max` before the softmax; `Perceiver.forward(data, mask=None)`
passes the input mask to the cross-attention only, the latent self-attention blocks take no mask.

Masks meant:
- cross-attention: each of the 16 latents (queries) sees every real input element of its row and none of the
  padding; there are more queries (16 latents) than keys (at most 6 inputs): the latent array is a learned
  bottleneck, not a sequence, so no causal structure;
- latent self-attention: full, no mask.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class PreNorm(nn.Module):
    def __init__(self, dim, fn, context_dim=None):
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)
        self.norm_context = nn.LayerNorm(context_dim) if context_dim is not None else None

    def forward(self, x, **kwargs):
        x = self.norm(x)
        if self.norm_context is not None:
            kwargs['context'] = self.norm_context(kwargs['context'])
        return self.fn(x, **kwargs)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult * 2), GEGLU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class GEGLU(nn.Module):
    def forward(self, x):
        x, gates = x.chunk(2, dim=-1)
        return x * F.gelu(gates)


class Attention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=2, dim_head=16):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = context_dim if context_dim is not None else query_dim
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(context_dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, query_dim)

    def forward(self, x, context=None, mask=None):
        h = self.heads
        q = self.to_q(x)
        context = context if context is not None else x
        k, v = self.to_kv(context).chunk(2, dim=-1)
        # 'b n (h d) -> (b h) n d'
        q, k, v = (t.reshape(t.size(0), t.size(1), h, -1).transpose(1, 2).reshape(t.size(0) * h, t.size(1), -1)
                   for t in (q, k, v))
        sim = torch.einsum('b i d, b j d -> b i j', q, k) * self.scale
        if mask is not None:
            # 'b j -> (b h) () j'
            mask = mask.repeat_interleave(h, dim=0)[:, None, :]
            max_neg_value = -torch.finfo(sim.dtype).max
            sim.masked_fill_(~mask, max_neg_value)
        attn = sim.softmax(dim=-1)
        out = torch.einsum('b i j, b j d -> b i d', attn, v)
        out = out.reshape(-1, h, out.size(1), out.size(2)).transpose(1, 2).reshape(-1, out.size(1), h * out.size(2))
        return self.to_out(out)


class Perceiver(nn.Module):
    def __init__(self, input_channels=12, num_latents=16, latent_dim=32, depth=2, self_per_cross_attn=1,
                 num_classes=5):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(num_latents, latent_dim))
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self_attns = nn.ModuleList([])
            for _ in range(self_per_cross_attn):
                self_attns.append(nn.ModuleList([
                    PreNorm(latent_dim, Attention(latent_dim)),
                    PreNorm(latent_dim, FeedForward(latent_dim)),
                ]))
            self.layers.append(nn.ModuleList([
                PreNorm(latent_dim, Attention(latent_dim, input_channels), context_dim=input_channels),
                PreNorm(latent_dim, FeedForward(latent_dim)),
                self_attns,
            ]))
        self.to_logits = nn.Sequential(nn.LayerNorm(latent_dim), nn.Linear(latent_dim, num_classes))

    def forward(self, data, mask=None):
        b = data.size(0)
        x = self.latents.unsqueeze(0).expand(b, -1, -1)
        for cross_attn, cross_ff, self_attns in self.layers:
            x = cross_attn(x, context=data, mask=mask) + x
            x = cross_ff(x) + x
            for self_attn, self_ff in self_attns:
                x = self_attn(x) + x
                x = self_ff(x) + x
        return self.to_logits(x.mean(dim=-2))


def main():
    torch.manual_seed(0)
    model = Perceiver().eval()
    lengths = torch.tensor([6, 2, 4])
    data = torch.randn(3, 6, 12)
    mask = torch.arange(6)[None, :] < lengths[:, None]
    with torch.no_grad():
        logits = model(data, mask=mask)
        # padding content must not matter
        noisy = torch.where(mask[..., None], data, torch.randn_like(data) * 100)
        assert torch.allclose(model(noisy, mask=mask), logits, atol=1e-5)
    print(logits.argmax(-1).tolist())


if __name__ == "__main__":
    main()
