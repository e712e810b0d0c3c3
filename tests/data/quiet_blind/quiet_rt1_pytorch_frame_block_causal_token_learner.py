# Citation: lucidrains/robotic-transformer-pytorch @0a2083bd7da04eae4f069a9d09b861b14fe5f4f9:
#   robotic_transformer_pytorch/robotic_transformer_pytorch.py (posemb_sincos_1d, LayerNorm, FeedForward,
#   TransformerAttention, Transformer, TokenLearner, RT1.forward).
# RT-1: each video frame is reduced by the TokenLearner to num_learned_tokens tokens, the frames' tokens are laid
# out as (f n), and the transformer is block-causal over frames: RT1.forward builds
# ones((frames, frames)).triu(1) (True = a later frame), repeats it over the learned tokens of both axes and hands
# `~attn_mask` (True = may attend) to each TransformerAttention, which fills the rest with -finfo.max. The tokens of
# one frame see each other and every earlier frame; a frame's logits come from its mean-pooled tokens.
# Trimmed: the MaxViT backbone is its convolutional stem only, and no text conditioner is used (cond_fns None, as
# the Transformer allows; its `len(self.layers * 2)` is written `len(self.layers) * 2`); einops calls are written
# as torch ops.
# Self-check: the logits of every frame equal those of the same video cut after that frame (no future frames), and
# a per-frame double loop over the tokens a frame may see.
import torch
import torch.nn.functional as F
from torch import nn, einsum

torch.manual_seed(0)


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def posemb_sincos_1d(seq, dim, temperature=10000, device=None, dtype=torch.float32):
    n = torch.arange(seq, device=device)
    omega = torch.arange(dim // 2, device=device) / (dim // 2 - 1)
    omega = 1. / (temperature ** omega)

    n = n[:, None] * omega[None, :]
    pos_emb = torch.cat((n.sin(), n.cos()), dim=1)
    return pos_emb.type(dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.register_buffer("beta", torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.beta)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4, dropout=0.):
        super().__init__()
        inner_dim = int(dim * mult)
        self.norm = LayerNorm(dim)

        self.net = nn.Sequential(
            nn.Linear(dim, inner_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(inner_dim, dim),
            nn.Dropout(dropout)
        )

    def forward(self, x, cond_fn=None):
        x = self.norm(x)

        if exists(cond_fn):
            # adaptive layernorm
            x = cond_fn(x)

        return self.net(x)


class MaxViTStem(nn.Module):
    """MaxViT's convolutional stem only (return_embeddings=True path, no stages)."""

    def __init__(self, dim, channels=3):
        super().__init__()
        self.conv_stem = nn.Sequential(
            nn.Conv2d(channels, dim, 3, stride=2, padding=1),
            nn.Conv2d(dim, dim, 3, padding=1)
        )
        self.embed_dim = dim

    def forward(self, x, return_embeddings=True):
        return self.conv_stem(x)


class TransformerAttention(nn.Module):
    def __init__(self, dim, causal=False, dim_head=64, dim_context=None, heads=8, norm_context=False, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.causal = causal
        inner_dim = dim_head * heads

        dim_context = default(dim_context, dim)

        self.norm = LayerNorm(dim)
        self.context_norm = LayerNorm(dim_context) if norm_context else nn.Identity()

        self.attn_dropout = nn.Dropout(dropout)

        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim_context, dim_head * 2, bias=False)
        self.to_out = nn.Sequential(
            nn.Linear(inner_dim, dim, bias=False),
            nn.Dropout(dropout)
        )

    def forward(self, x, context=None, mask=None, attn_bias=None, attn_mask=None, cond_fn=None):
        b = x.shape[0]

        if exists(context):
            context = self.context_norm(context)

        kv_input = default(context, x)

        x = self.norm(x)

        if exists(cond_fn):
            # adaptive layer-norm
            x = cond_fn(x)

        q, k, v = self.to_q(x), *self.to_kv(kv_input).chunk(2, dim=-1)

        q = q.reshape(b, q.shape[1], self.heads, -1).transpose(1, 2)  # b n (h d) -> b h n d

        q = q * self.scale

        sim = einsum('b h i d, b j d -> b h i j', q, k)

        if exists(attn_bias):
            sim = sim + attn_bias

        if exists(attn_mask):
            sim = sim.masked_fill(~attn_mask, -torch.finfo(sim.dtype).max)

        if exists(mask):
            mask = mask[:, None, None, :]  # b j -> b 1 1 j
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)

        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)

        attn = sim.softmax(dim=-1)
        attn = self.attn_dropout(attn)

        out = einsum('b h i j, b j d -> b h i d', attn, v)

        out = out.transpose(1, 2).reshape(b, out.shape[2], -1)  # b h n d -> b n (h d)
        return self.to_out(out)


class Transformer(nn.Module):
    def __init__(self, dim, dim_head=64, heads=8, depth=6, attn_dropout=0., ff_dropout=0.):
        super().__init__()
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                TransformerAttention(dim=dim, heads=heads, dim_head=dim_head, dropout=attn_dropout),
                FeedForward(dim=dim, dropout=ff_dropout)
            ]))

    def forward(self, x, cond_fns=None, attn_mask=None):
        if not exists(cond_fns):
            cond_fns = (None,) * (len(self.layers) * 2)  # upstream: len(self.layers * 2); it always passes cond_fns

        cond_fns = iter(cond_fns)

        for attn, ff in self.layers:
            x = attn(x, attn_mask=attn_mask, cond_fn=next(cond_fns)) + x
            x = ff(x, cond_fn=next(cond_fns)) + x
        return x


class TokenLearner(nn.Module):
    """
    https://arxiv.org/abs/2106.11297
    using the 1.1 version with the MLP (2 dense layers with gelu) for generating attention map
    """

    def __init__(self, *, dim, ff_mult=2, num_output_tokens=8, num_layers=2):
        super().__init__()
        inner_dim = dim * ff_mult * num_output_tokens

        self.num_output_tokens = num_output_tokens
        self.net = nn.Sequential(
            nn.Conv2d(dim * num_output_tokens, inner_dim, 1, groups=num_output_tokens),
            nn.GELU(),
            nn.Conv2d(inner_dim, num_output_tokens, 1, groups=num_output_tokens),
        )

    def forward(self, x):
        lead = x.shape[:-3]
        x = x.reshape(-1, *x.shape[-3:])  # pack_one(x, '* c h w')
        g = self.num_output_tokens
        x = x.repeat(1, g, 1, 1)  # b c h w -> b (g c) h w
        attn = self.net(x)

        attn = attn.unsqueeze(1)  # b g h w -> b 1 g h w
        bsz, _, h, w = x.shape
        x = x.reshape(bsz, g, -1, h, w).transpose(1, 2)  # b (g c) h w -> b c g h w

        x = (x * attn).mean(dim=(-2, -1))  # reduce 'b c g h w -> b c g', 'mean'
        x = x.reshape(*lead, *x.shape[1:])  # unpack_one(x, ps, '* c n')
        return x


class RT1(nn.Module):
    def __init__(self, *, vit, num_actions=11, action_bins=256, depth=6, heads=8, dim_head=64,
                 token_learner_ff_mult=2, token_learner_num_layers=2, token_learner_num_output_tokens=8):
        super().__init__()
        self.vit = vit
        self.token_learner = TokenLearner(
            dim=vit.embed_dim,
            ff_mult=token_learner_ff_mult,
            num_output_tokens=token_learner_num_output_tokens,
            num_layers=token_learner_num_layers
        )

        self.num_learned_tokens = token_learner_num_output_tokens

        self.transformer_depth = depth

        self.transformer = Transformer(
            dim=vit.embed_dim,
            dim_head=dim_head,
            heads=heads,
            depth=depth
        )

        self.num_actions = num_actions
        self.action_bins = action_bins
        self.to_logits = nn.Sequential(
            LayerNorm(vit.embed_dim),
            nn.Linear(vit.embed_dim, num_actions * action_bins),
        )

    def forward(self, video, texts=None, cond_drop_prob=0.):
        frames, device = video.shape[2], video.device

        video = video.permute(0, 2, 1, 3, 4)  # b c f h w -> b f c h w
        b = video.shape[0]
        images = video.reshape(b * frames, *video.shape[2:])  # pack_one(video, '* c h w')

        tokens = self.vit(images, return_embeddings=True)

        tokens = tokens.reshape(b, frames, *tokens.shape[1:])  # unpack_one
        learned_tokens = self.token_learner(tokens)  # b f c n

        learned_tokens = learned_tokens.permute(0, 1, 3, 2).reshape(b, frames * self.num_learned_tokens, -1)  # b (f n) c

        # causal attention mask

        attn_mask = torch.ones((frames, frames), dtype=torch.bool, device=device).triu(1)
        r = self.num_learned_tokens
        attn_mask = attn_mask.repeat_interleave(r, dim=0).repeat_interleave(r, dim=1)  # 'i j -> (i r1) (j r2)'

        # sinusoidal positional embedding

        pos_emb = posemb_sincos_1d(frames, learned_tokens.shape[-1], dtype=learned_tokens.dtype, device=learned_tokens.device)

        learned_tokens = learned_tokens + pos_emb.repeat_interleave(r, dim=0)  # 'n d -> (n r) d'

        # attention

        attended_tokens = self.transformer(learned_tokens, attn_mask=~attn_mask)

        pooled = attended_tokens.reshape(b, frames, r, -1).mean(dim=2)  # reduce 'b (f n) d -> b f d', 'mean'

        logits = self.to_logits(pooled)
        return logits.reshape(*logits.shape[:-1], self.num_actions, self.action_bins)


def reference_frame_logits(model, video, f):
    """Logits of frame f from a double loop: each token attends, by hand, to the tokens of frames 0..f only."""
    b, frames, r = video.shape[0], video.shape[2], model.num_learned_tokens
    v = video.permute(0, 2, 1, 3, 4)
    feats = model.vit(v.reshape(b * frames, *v.shape[2:]))
    tok = model.token_learner(feats.reshape(b, frames, *feats.shape[1:]))  # b f c n
    tok = tok[:, :f + 1].permute(0, 1, 3, 2).reshape(b, (f + 1) * r, -1)
    d = tok.shape[-1]
    tok = tok + posemb_sincos_1d(frames, d)[:f + 1].repeat_interleave(r, dim=0)
    frame_of = [i // r for i in range(tok.shape[1])]
    x = tok
    for attn, ff in model.transformer.layers:
        xn = attn.norm(x)
        q = attn.to_q(xn)
        k, vv = attn.to_kv(x).chunk(2, dim=-1)
        dh = k.shape[-1]
        out = torch.zeros_like(q)
        for bi in range(b):
            for i in range(x.shape[1]):
                keys = [j for j in range(x.shape[1]) if frame_of[j] <= frame_of[i]]
                for h in range(attn.heads):
                    qi = q[bi, i, h * dh:(h + 1) * dh] * attn.scale
                    s = torch.stack([qi @ k[bi, j] for j in keys])
                    p = s.softmax(dim=0)
                    out[bi, i, h * dh:(h + 1) * dh] = sum(p[n] * vv[bi, j] for n, j in enumerate(keys))
        x = attn.to_out(out) + x
        x = ff(x) + x
    pooled = x.reshape(b, f + 1, r, -1)[:, f].mean(dim=1)
    return model.to_logits(pooled).reshape(b, model.num_actions, model.action_bins)


def main():
    vit = MaxViTStem(dim=16)
    model = RT1(vit=vit, num_actions=3, action_bins=8, depth=2, heads=2, dim_head=8,
                token_learner_num_output_tokens=4).eval()
    video = torch.randn(2, 3, 5, 8, 8)  # (b, c, f, h, w)
    frames = video.shape[2]
    with torch.no_grad():
        logits = model(video)  # (b, f, actions, bins)
        for f in range(frames):
            cut = model(video[:, :, :f + 1])
            assert torch.allclose(logits[:, f], cut[:, f], atol=1e-5), f
            ref = reference_frame_logits(model, video, f)
            assert torch.allclose(logits[:, f], ref, atol=1e-5), f
        # a later frame changed: earlier frames' logits stay, its own move
        video2 = video.clone()
        video2[:, :, 3] = torch.randn_like(video2[:, :, 3])
        logits2 = model(video2)
        assert torch.allclose(logits2[:, :3], logits[:, :3], atol=1e-5)
        assert not torch.allclose(logits2[:, 3], logits[:, 3], atol=1e-4)
    print(f"RT-1 block-causal frames: logits of {frames} frames match cut videos and the double loop")


if __name__ == "__main__":
    main()
