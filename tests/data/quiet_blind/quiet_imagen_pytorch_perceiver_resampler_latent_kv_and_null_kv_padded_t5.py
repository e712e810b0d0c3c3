# Correct program (quiet batch quiet-yb).
# Ported from lucidrains/imagen-pytorch @00f4bab5a471f08c814f9ed780ca0c39dee0be20, imagen_pytorch/imagen_pytorch.py:
# PerceiverAttention / PerceiverResampler (learned latents are the queries; the keys are the text tokens with the
# latents' own keys appended, `mask = F.pad(mask, (0, latents.shape[-2]), value = True)`) and CrossAttention
# (a learned null key / value prepended to the text keys, `mask = F.pad(mask, (1, 0), value = True)`), with the
# max-negative masked_fill and the float32 softmax as written there. einops calls are spelled out in torch.
# The text is a right-padded batch of T5-style embeddings (pads zeroed, as t5_encode_text does) with its bool
# mask; the resampler is built with num_latents_mean_pooled = 0 and is handed the text mask, and the image tokens
# (8 per sample, a 2x4 feature map flattened as EinopsToAndFrom('b c h w', 'b (h w) c') does) cross-attend the
# padded text with the null key always on.
# Self-check: every sample run alone with only its own text tokens and no mask; the resampled latents and the
# cross-attention outputs must match the padded batch's. Also the batch with its pad embeddings replaced by noise.
import torch
import torch.nn.functional as F
from torch import einsum, nn

torch.manual_seed(0)


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def split_heads(t, h):
    b, n, hd = t.shape
    return t.view(b, n, h, hd // h).transpose(1, 2)


def merge_heads(t):
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


class Identity(nn.Module):
    def forward(self, x, *args, **kwargs):
        return x


class LayerNorm(nn.Module):
    def __init__(self, feats, stable=False, dim=-1):
        super().__init__()
        self.stable = stable
        self.dim = dim
        self.g = nn.Parameter(torch.ones(feats, *((1,) * (-dim - 1))))

    def forward(self, x):
        dtype, dim = x.dtype, self.dim
        if self.stable:
            x = x / x.amax(dim=dim, keepdim=True).detach()
        eps = 1e-5 if x.dtype == torch.float32 else 1e-3
        var = torch.var(x, dim=dim, unbiased=False, keepdim=True)
        mean = torch.mean(x, dim=dim, keepdim=True)
        return (x - mean) * (var + eps).rsqrt().type(dtype) * self.g.type(dtype)


def FeedForward(dim, mult=2):
    hidden_dim = int(dim * mult)
    return nn.Sequential(
        LayerNorm(dim),
        nn.Linear(dim, hidden_dim, bias=False),
        nn.GELU(),
        LayerNorm(hidden_dim),
        nn.Linear(hidden_dim, dim, bias=False),
    )


class PerceiverAttention(nn.Module):
    def __init__(self, *, dim, dim_head=64, heads=8):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        inner_dim = dim_head * heads

        self.norm = nn.LayerNorm(dim)
        self.norm_latents = nn.LayerNorm(dim)

        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)

        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim, bias=False), nn.LayerNorm(dim))

    def forward(self, x, latents, mask=None):
        x = self.norm(x)
        latents = self.norm_latents(latents)

        b, h = x.shape[0], self.heads

        q = self.to_q(latents)

        # the paper differs from Perceiver in which they also concat the key / values derived from the latents to be attended to
        kv_input = torch.cat((x, latents), dim=-2)
        k, v = self.to_kv(kv_input).chunk(2, dim=-1)

        q, k, v = (split_heads(t, h) for t in (q, k, v))

        q = q * self.scale

        # attention

        sim = einsum('... i d, ... j d  -> ... i j', q, k)

        if exists(mask):
            max_neg_value = -torch.finfo(sim.dtype).max
            mask = F.pad(mask, (0, latents.shape[-2]), value=True)
            mask = mask[:, None, None, :]
            sim = sim.masked_fill(~mask, max_neg_value)

        attn = sim.softmax(dim=-1, dtype=torch.float32)

        out = einsum('... i j, ... j d -> ... i d', attn, v)
        out = merge_heads(out)
        return self.to_out(out)


class PerceiverResampler(nn.Module):
    def __init__(self, *, dim, depth, dim_head=64, heads=8, num_latents=64, num_latents_mean_pooled=4,
                 max_seq_len=512, ff_mult=4):
        super().__init__()
        self.pos_emb = nn.Embedding(max_seq_len, dim)

        self.latents = nn.Parameter(torch.randn(num_latents, dim))

        self.to_latents_from_mean_pooled_seq = None
        assert num_latents_mean_pooled == 0  # built without the mean-pooled latents here

        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                PerceiverAttention(dim=dim, dim_head=dim_head, heads=heads),
                FeedForward(dim=dim, mult=ff_mult),
            ]))

    def forward(self, x, mask=None):
        n, device = x.shape[1], x.device
        pos_emb = self.pos_emb(torch.arange(n, device=device))

        x_with_pos = x + pos_emb

        latents = self.latents.unsqueeze(0).expand(x.shape[0], -1, -1)

        for attn, ff in self.layers:
            latents = attn(x_with_pos, latents, mask=mask) + latents
            latents = ff(latents) + latents

        return latents


class CrossAttention(nn.Module):
    def __init__(self, dim, *, context_dim=None, dim_head=64, heads=8, norm_context=False):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        inner_dim = dim_head * heads

        context_dim = default(context_dim, dim)

        self.norm = LayerNorm(dim)
        self.norm_context = LayerNorm(context_dim) if norm_context else Identity()

        self.null_kv = nn.Parameter(torch.randn(2, dim_head))
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(context_dim, inner_dim * 2, bias=False)

        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim, bias=False), LayerNorm(dim))

    def forward(self, x, context, mask=None):
        b, n, device = *x.shape[:2], x.device

        x = self.norm(x)
        context = self.norm_context(context)

        q, k, v = (self.to_q(x), *self.to_kv(context).chunk(2, dim=-1))

        q, k, v = (split_heads(t, self.heads) for t in (q, k, v))

        # add null key / value for classifier free guidance in prior net

        nk, nv = (t.view(1, 1, 1, -1).expand(b, self.heads, 1, -1) for t in self.null_kv.unbind(dim=-2))

        k = torch.cat((nk, k), dim=-2)
        v = torch.cat((nv, v), dim=-2)

        q = q * self.scale

        sim = einsum('b h i d, b h j d -> b h i j', q, k)
        max_neg_value = -torch.finfo(sim.dtype).max

        if exists(mask):
            mask = F.pad(mask, (1, 0), value=True)
            mask = mask[:, None, None, :]
            sim = sim.masked_fill(~mask, max_neg_value)

        attn = sim.softmax(dim=-1, dtype=torch.float32)

        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        out = merge_heads(out)
        return self.to_out(out)


# ---- a padded batch of T5-style text embeddings -----------------------------------------------------------------
text_embed_dim, cond_dim, dim = 24, 32, 16
text_lens = [5, 2, 7]
max_text_len = 7
B = len(text_lens)

text_mask = torch.arange(max_text_len)[None, :] < torch.tensor(text_lens)[:, None]  # True = real token
text_embeds = torch.randn(B, max_text_len, text_embed_dim)
text_embeds = text_embeds.masked_fill(~text_mask[..., None], 0.)  # t5_encode_text zeroes the pads

text_to_cond = nn.Linear(text_embed_dim, cond_dim)
attn_pool = PerceiverResampler(dim=cond_dim, depth=2, dim_head=8, heads=2, num_latents=4,
                               num_latents_mean_pooled=0, max_seq_len=16, ff_mult=2)
cross_attn = CrossAttention(dim=dim, context_dim=cond_dim, dim_head=8, heads=2)
for m in (text_to_cond, attn_pool, cross_attn):
    m.eval()

fmap = torch.randn(B, dim, 2, 4)  # an image feature map, 'b c h w'
image_tokens = fmap.flatten(2).transpose(1, 2)  # 'b (h w) c'


def run(text_embeds, text_mask, image_tokens):
    text_tokens = text_to_cond(text_embeds)
    latents = attn_pool(text_tokens, mask=text_mask)
    out = cross_attn(image_tokens, context=text_tokens, mask=text_mask)
    return latents, out


with torch.no_grad():
    latents, out = run(text_embeds, text_mask, image_tokens)

    # reference 1: each sample alone, only its own tokens, no mask
    for i, n in enumerate(text_lens):
        ref_latents, ref_out = run(text_embeds[i:i + 1, :n], None, image_tokens[i:i + 1])
        assert torch.allclose(latents[i], ref_latents[0], atol=1e-5), (i, (latents[i] - ref_latents[0]).abs().max())
        assert torch.allclose(out[i], ref_out[0], atol=1e-5), (i, (out[i] - ref_out[0]).abs().max())

    # reference 2: pads replaced by noise change nothing
    noisy = torch.where(text_mask[..., None], text_embeds, 5 * torch.randn_like(text_embeds))
    latents2, out2 = run(noisy, text_mask, image_tokens)
    assert torch.allclose(latents, latents2, atol=1e-5)
    assert torch.allclose(out, out2, atol=1e-5)
    assert torch.isfinite(latents).all() and torch.isfinite(out).all()

print("ok: resampled latents", tuple(latents.shape), "cross-attention", tuple(out.shape),
      "match each sample run alone")
