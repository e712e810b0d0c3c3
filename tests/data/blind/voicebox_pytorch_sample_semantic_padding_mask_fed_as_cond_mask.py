# lucidrains/voicebox-pytorch commit 91654c3 ("differentiate between attention mask and conditioning mask").
# ConditionalFlowMatcherWrapper.sample gets a batch of variable-length semantic token ids from the spear-tts
# TextToSemantic.generate together with their target mask (True on real tokens, right padded), and handed that
# mask to VoiceBox.forward as `mask`, which is the infilling (conditioning) mask: `cond * ~mask`. The transformer's
# attention never received any mask, so every frame attended the padded tail of the shorter rows.
# Fix: the generate mask becomes `self_attn_mask`, passed through Transformer.forward to each Attention / Attend as a
# key padding mask; the conditioning mask is a separate `cond_mask` argument.
# (einops written out with torch; torchdiffeq's odeint replaced by the same fixed-step Euler the ODE amounts to
# at steps=3; the TextToSemantic model replaced by its generate output.)
import math
import sys
from functools import partial

import torch
from torch import nn, einsum
from torch.nn import Module
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def prob_mask_like(shape, prob, device):
    if prob == 1:
        return torch.ones(shape, device=device, dtype=torch.bool)
    elif prob == 0:
        return torch.zeros(shape, device=device, dtype=torch.bool)
    return torch.zeros(shape, device=device).float().uniform_(0, 1) < prob


class LearnedSinusoidalPosEmb(Module):
    def __init__(self, dim):
        super().__init__()
        self.weights = nn.Parameter(torch.randn(dim // 2))

    def forward(self, x):
        freqs = x[:, None] * self.weights[None, :] * 2 * math.pi
        return torch.cat((freqs.sin(), freqs.cos()), dim=-1)


class RotaryEmbedding(Module):
    def __init__(self, dim, theta=10000):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, seq_len):
        t = torch.arange(seq_len, device=self.inv_freq.device).type_as(self.inv_freq)
        freqs = torch.einsum('i , j -> i j', t, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(pos, t):
    return t * pos.cos() + rotate_half(t) * pos.sin()


class ConvPositionEmbed(Module):
    def __init__(self, dim, *, kernel_size, groups=None):
        super().__init__()
        groups = default(groups, dim)
        self.dw_conv1d = nn.Sequential(
            nn.Conv1d(dim, dim, kernel_size, groups=groups, padding=kernel_size // 2), nn.GELU())

    def forward(self, x):
        return self.dw_conv1d(x.transpose(1, 2)).transpose(1, 2)


class RMSNorm(Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.gamma


class AdaptiveRMSNorm(Module):
    def __init__(self, dim, cond_dim=None):
        super().__init__()
        cond_dim = default(cond_dim, dim)
        self.scale = dim ** 0.5
        self.to_gamma = nn.Linear(cond_dim, dim)
        self.to_beta = nn.Linear(cond_dim, dim)
        nn.init.zeros_(self.to_gamma.weight)
        nn.init.ones_(self.to_gamma.bias)
        nn.init.zeros_(self.to_beta.weight)
        nn.init.zeros_(self.to_beta.bias)

    def forward(self, x, *, cond):
        normed = F.normalize(x, dim=-1) * self.scale
        gamma, beta = self.to_gamma(cond)[:, None], self.to_beta(cond)[:, None]
        return normed * gamma + beta


class Attend(nn.Module):
    def __init__(self, dropout=0., flash=False):
        super().__init__()
        self.attn_dropout = nn.Dropout(dropout)
        self.flash = flash

    def forward(self, q, k, v, mask=None):
        scale = q.shape[-1] ** -0.5

        if exists(mask) and mask.ndim != 4:
            mask = mask[:, None, None, :]                    # b j -> b 1 1 j

        sim = einsum("b h i d, b h j d -> b h i j", q, k) * scale

        if exists(mask):
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)

        attn = sim.softmax(dim=-1)
        attn = self.attn_dropout(attn)
        return einsum("b h i j, b h j d -> b h i d", attn, v)


class Attention(Module):
    def __init__(self, dim, dim_head=64, heads=8, dropout=0, flash=False):
        super().__init__()
        self.heads = heads
        dim_inner = dim_head * heads
        self.attend = Attend(dropout, flash=flash)
        self.to_qkv = nn.Linear(dim, dim_inner * 3, bias=False)
        self.to_out = nn.Linear(dim_inner, dim, bias=False)

    def forward(self, x, mask=None, rotary_emb=None):
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = map(lambda t: t.view(b, n, self.heads, -1).transpose(1, 2), (q, k, v))

        if exists(rotary_emb):
            q, k = map(lambda t: apply_rotary_pos_emb(rotary_emb, t), (q, k))

        out = self.attend(q, k, v, mask=mask)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


def FeedForward(dim, mult=4):
    return nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))


class Transformer(Module):
    def __init__(self, dim, *, depth, dim_head=64, heads=8, ff_mult=4, attn_dropout=0, attn_flash=False,
                 adaptive_rmsnorm=False, adaptive_rmsnorm_cond_dim_in=None):
        super().__init__()
        self.layers = nn.ModuleList([])
        self.rotary_emb = RotaryEmbedding(dim=dim_head)
        rmsnorm_klass = partial(AdaptiveRMSNorm, cond_dim=adaptive_rmsnorm_cond_dim_in) if adaptive_rmsnorm else RMSNorm

        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                rmsnorm_klass(dim=dim),
                Attention(dim=dim, dim_head=dim_head, heads=heads, dropout=attn_dropout, flash=attn_flash),
                rmsnorm_klass(dim=dim),
                FeedForward(dim=dim, mult=ff_mult),
            ]))
        self.final_norm = RMSNorm(dim)

    def forward(self, x, mask=None, adaptive_rmsnorm_cond=None):
        rotary_emb = self.rotary_emb(x.shape[-2])
        rmsnorm_kwargs = dict(cond=adaptive_rmsnorm_cond) if exists(adaptive_rmsnorm_cond) else dict()

        for attn_prenorm, attn, ff_prenorm, ff in self.layers:
            attn_input = attn_prenorm(x, **rmsnorm_kwargs)
            x = attn(attn_input, mask=mask, rotary_emb=rotary_emb) + x
            ff_input = ff_prenorm(x, **rmsnorm_kwargs)
            x = ff(ff_input) + x

        return self.final_norm(x)


class VoiceBox(Module):
    def __init__(self, *, num_cond_tokens, dim_in=None, dim_cond_emb=32, dim=64, depth=2, dim_head=16, heads=4,
                 ff_mult=4, time_hidden_dim=None, conv_pos_embed_kernel_size=31, p_drop_prob=0.3,
                 frac_lengths_mask=(0.7, 1.)):
        super().__init__()
        dim_in = default(dim_in, dim)
        time_hidden_dim = default(time_hidden_dim, dim * 4)
        self.proj_in = nn.Identity()
        self.sinu_pos_emb = nn.Sequential(LearnedSinusoidalPosEmb(dim), nn.Linear(dim, time_hidden_dim), nn.SiLU())

        self.condition_on_text = True
        self.null_cond_id = num_cond_tokens
        self.to_cond_emb = nn.Embedding(num_cond_tokens + 1, dim_cond_emb)
        self.p_drop_prob = p_drop_prob
        self.frac_lengths_mask = frac_lengths_mask

        self.to_embed = nn.Linear(dim_in * 2 + dim_cond_emb, dim)
        self.null_cond = nn.Parameter(torch.zeros(dim_in))
        self.conv_embed = ConvPositionEmbed(dim=dim, kernel_size=conv_pos_embed_kernel_size)

        self.transformer = Transformer(dim=dim, depth=depth, dim_head=dim_head, heads=heads, ff_mult=ff_mult,
                                       adaptive_rmsnorm=True, adaptive_rmsnorm_cond_dim_in=time_hidden_dim)
        self.to_pred = nn.Linear(dim, dim_in, bias=False)

    @torch.inference_mode()
    def forward_with_cond_scale(self, *args, cond_scale=1., **kwargs):
        logits = self.forward(*args, cond_drop_prob=0., **kwargs)
        if cond_scale == 1.:
            return logits
        null_logits = self.forward(*args, cond_drop_prob=1., **kwargs)
        return null_logits + (logits - null_logits) * cond_scale

    def forward(self, x, *, times, cond_token_ids, cond_drop_prob=0.1, cond=None, mask=None, self_attn_mask=None,
                cond_mask=None):
        x = self.proj_in(x)
        cond = self.proj_in(cond)
        batch, seq_len, cond_dim = cond.shape

        if times.ndim == 0:
            times = times.expand(batch)

        if FIXED:
            # construct conditioning mask if not given
            if not exists(cond_mask):
                cond_mask = torch.ones((batch, seq_len), device=cond.device, dtype=torch.bool)
            cond_mask_with_pad_dim = cond_mask[..., None]
            # as described in section 3.2
            x = x * cond_mask_with_pad_dim
            cond = cond * ~cond_mask_with_pad_dim
        else:
            # construct mask if not given (the sampler always gives one here)
            cond = cond * (~mask)[..., None]

        # classifier free guidance
        if cond_drop_prob > 0.:
            cond_drop_mask = prob_mask_like(cond.shape[:1], cond_drop_prob, cond.device)
            cond = torch.where(cond_drop_mask[:, None, None], self.null_cond, cond)
            cond_token_ids = torch.where(cond_drop_mask[:, None], self.null_cond_id, cond_token_ids)

        cond_emb = self.to_cond_emb(cond_token_ids)

        embed = torch.cat((x, cond_emb, cond), dim=-1)
        x = self.to_embed(embed)
        x = self.conv_embed(x) + x

        time_emb = self.sinu_pos_emb(times)

        if FIXED:
            x = self.transformer(x, mask=self_attn_mask, adaptive_rmsnorm_cond=time_emb)
        else:
            x = self.transformer(x, adaptive_rmsnorm_cond=time_emb)

        return self.to_pred(x)


def sample(voicebox, *, cond, semantic_token_ids, target_mask, steps=3, cond_scale=1.):
    # ConditionalFlowMatcherWrapper.sample, with `semantic_token_ids, mask = self.text_to_semantic.generate(...,
    # return_target_mask = True)` already run
    mask = None
    self_attn_mask = None
    if FIXED:
        self_attn_mask = target_mask
    else:
        mask = target_mask
    cond_token_ids = semantic_token_ids

    cond_length = cond.shape[-2]
    cond_tokens_seq_len = cond_token_ids.shape[-1]
    if cond_length > cond_tokens_seq_len:
        cond = cond[:, :cond_tokens_seq_len, :]
    elif cond_length < cond_tokens_seq_len:
        cond = F.pad(cond, (0, 0, 0, cond_tokens_seq_len), value=0.)

    voicebox.eval()

    def fn(t, x):
        if FIXED:
            return voicebox.forward_with_cond_scale(x, times=t, cond_token_ids=cond_token_ids, cond=cond,
                                                    cond_scale=cond_scale, self_attn_mask=self_attn_mask)
        return voicebox.forward_with_cond_scale(x, times=t, cond_token_ids=cond_token_ids, cond=cond,
                                                cond_scale=cond_scale, mask=mask)

    y = torch.randn_like(cond)
    t = torch.linspace(0, 1, steps)
    for t0, t1 in zip(t[:-1], t[1:]):
        y = y + (t1 - t0) * fn(t0, y)
    return y


def main():
    torch.manual_seed(0)
    num_semantic = 100
    voicebox = VoiceBox(num_cond_tokens=num_semantic, dim=64, depth=2, dim_head=16, heads=4)

    # TextToSemantic.generate output: right padded with the pad id after eos, mask = real target tokens
    target_pad_id = 0
    lengths = torch.tensor([14, 9])
    semantic_token_ids = torch.randint(1, num_semantic, (2, 14))
    target_mask = torch.arange(14)[None, :] < lengths[:, None]
    semantic_token_ids = semantic_token_ids.masked_fill(~target_mask, target_pad_id)

    cond = torch.randn(2, 14, 64)
    torch.manual_seed(1)
    sampled = sample(voicebox, cond=cond, semantic_token_ids=semantic_token_ids, target_mask=target_mask)

    real = sampled[1, :9]
    print("sampled", tuple(sampled.shape))
    print("row 1 real frames mean/std", round(real.mean().item(), 4), round(real.std().item(), 4))
    print("row 1 frame 0 [:4]", [round(v, 4) for v in real[0, :4].tolist()])


if __name__ == "__main__":
    main()
