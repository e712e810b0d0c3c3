# lucidrains/musiclm-pytorch commit 5002972 ("fix a bug with getting the height width by patches in
# audio transformer, thanks to @ukemamaster").
#
# MuLaN's audio tower, AudioSpectrogramTransformer (musiclm_pytorch/musiclm_pytorch.py), patchifies the
# spectrogram into x of shape (b, h, w, dim), builds a 2D grid of patch coordinates, and feeds the pairwise
# grid differences to a small MLP (dynamic_pos_bias_mlp) whose output is added to every attention layer's
# logits (rel_pos_bias). With patch dropout (training), the grid is gathered with the same kept patch
# indices as the tokens.
# Before the fix the patch counts were read as `num_patch_height, num_patch_width = x.shape[-2:]`, i.e.
# (w, dim) instead of (h, w): the grid is a w x dim lattice, so kept patch p is numbered at
# (p // dim, p % dim) rather than its (row, column) = (p // w, p % w). While training with patch dropout
# nothing fails (indices stay inside the larger grid) and every query/key pair gets the bias of wrong
# 2D relative positions.
# The fix reads `_, num_patch_height, num_patch_width, _ = x.shape`.
#
# Ported from the parent of 5002972. torchaudio's Spectrogram is replaced by the same power spectrogram
# computed with torch.stft (hann window, center, reflect); SpecAugment (torchaudio) is left out.
import sys
from functools import wraps

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv


# ---- einops stand-ins for the few patterns used below ----------------------------------------------
class Rearrange(nn.Module):
    def __init__(self, pattern, **axes):
        super().__init__()
        self.pattern = pattern
        self.axes = axes

    def forward(self, t):
        if self.pattern == 'b (h p1) (w p2) -> b h w (p1 p2)':
            p1, p2 = self.axes['p1'], self.axes['p2']
            b, H, W = t.shape
            t = t.reshape(b, H // p1, p1, W // p2, p2).permute(0, 1, 3, 2, 4)
            return t.reshape(b, H // p1, W // p2, p1 * p2)
        if self.pattern == '... i j h -> ... h i j':
            return t.movedim(-1, -3)
        raise NotImplementedError(self.pattern)


# functions

def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def round_down_nearest_multiple(n, divisor):
    return n // divisor * divisor


def Sequential(*modules):
    return nn.Sequential(*filter(exists, modules))


def once(fn):
    called = False

    @wraps(fn)
    def inner(x):
        nonlocal called
        if called:
            return
        called = True
        return fn(x)
    return inner


print_once = once(print)


def l2norm(t):
    return F.normalize(t, p=2, dim=-1)


# 2d sinusoidal positional embedding

def posemb_sincos_2d(patches, temperature=10000, dtype=torch.float32):
    _, h, w, dim, device, dtype = *patches.shape, patches.device, patches.dtype

    y, x = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing='ij')
    assert (dim % 4) == 0, 'feature dimension must be multiple of 4 for sincos emb'

    omega = torch.arange(dim // 4, device=device) / (dim // 4 - 1)
    omega = 1. / (temperature ** omega)

    y = y.flatten()[:, None] * omega[None, :]
    x = x.flatten()[:, None] * omega[None, :]

    pe = torch.cat((x.sin(), x.cos(), y.sin(), y.cos()), dim=1)
    pe = pe.type(dtype)

    return pe.reshape(h, w, -1)


# biasless layernorm

class LayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.register_buffer('beta', torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.beta)


class GEGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.gelu(gate) * x


def FeedForward(dim, mult=4, dropout=0.):
    dim_hidden = int(dim * mult * 2 / 3)

    return nn.Sequential(
        LayerNorm(dim),
        nn.Linear(dim, dim_hidden * 2, bias=False),
        GEGLU(),
        nn.Dropout(dropout),
        nn.Linear(dim_hidden, dim, bias=False)
    )


# attention

class Attention(nn.Module):
    def __init__(self, dim, causal=False, dim_head=64, heads=8, dropout=0., scale=8):
        super().__init__()
        self.heads = heads
        self.scale = scale
        self.causal = causal
        inner_dim = dim_head * heads

        self.norm = LayerNorm(dim)

        self.attn_dropout = nn.Dropout(dropout)

        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)

        self.q_scale = nn.Parameter(torch.ones(dim_head))
        self.k_scale = nn.Parameter(torch.ones(dim_head))

        self.to_out = nn.Sequential(
            nn.Linear(inner_dim, dim, bias=False),
            nn.Dropout(dropout)
        )

    def forward(self, x, rel_pos_bias=None, mask=None):
        b, n, _, device = *x.shape, x.device

        x = self.norm(x)

        q, k, v = self.to_q(x), *self.to_kv(x).chunk(2, dim=-1)

        q, k, v = map(lambda t: t.reshape(b, n, self.heads, -1).transpose(1, 2), (q, k, v))

        q, k = map(l2norm, (q, k))
        q = q * self.q_scale
        k = k * self.k_scale

        sim = einsum('b h i d, b h j d -> b h i j', q, k) * self.scale

        if exists(rel_pos_bias):
            sim = sim + rel_pos_bias

        if exists(mask):
            mask = mask[:, None, None, :]
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)

        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)

        attn = sim.softmax(dim=-1)
        attn = self.attn_dropout(attn)

        out = einsum('b h i j, b h j d -> b h i d', attn, v)

        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class Transformer(nn.Module):
    def __init__(self, dim, depth, dim_head=64, heads=8, attn_dropout=0., ff_mult=4, ff_dropout=0.):
        super().__init__()
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Attention(dim=dim, dim_head=dim_head, heads=heads, dropout=attn_dropout),
                FeedForward(dim=dim, mult=ff_mult, dropout=ff_dropout),
            ]))

    def forward(self, x, rel_pos_bias=None, mask=None):
        for attn, ff in self.layers:
            x = attn(x, rel_pos_bias=rel_pos_bias, mask=mask) + x
            x = ff(x) + x
        return x


def pair(t):
    return (t, t) if not isinstance(t, tuple) else t


class Spectrogram(nn.Module):
    """torchaudio.transforms.Spectrogram(power=2), written with torch.stft."""

    def __init__(self, n_fft, power, win_length, hop_length, pad, center, pad_mode):
        super().__init__()
        self.n_fft, self.power, self.win_length = n_fft, power, win_length
        self.hop_length = default(hop_length, win_length // 2)
        self.center, self.pad_mode = center, pad_mode
        self.register_buffer('window', torch.hann_window(win_length))

    def forward(self, wav):
        spec = torch.stft(wav, self.n_fft, hop_length=self.hop_length, win_length=self.win_length,
                          window=self.window, center=self.center, pad_mode=self.pad_mode,
                          return_complex=True)
        return spec.abs().pow(self.power)


class AudioSpectrogramTransformer(nn.Module):
    def __init__(
        self,
        dim,
        depth,
        patch_size=16,
        dim_head=64,
        heads=8,
        attn_dropout=0.,
        ff_mult=4,
        ff_dropout=0.,
        spec_n_fft=128,
        spec_power=2,
        spec_win_length=24,
        spec_hop_length=None,
        spec_pad=0,
        spec_center=True,
        spec_pad_mode='reflect',
        patch_dropout_prob=0.25
    ):
        super().__init__()
        self.dim = dim

        self.patch_size = pair(patch_size)
        patch_input_dim = self.patch_size[0] * self.patch_size[1]

        self.to_patch_tokens = Sequential(
            Rearrange('b (h p1) (w p2) -> b h w (p1 p2)', p1=self.patch_size[0], p2=self.patch_size[1]),
            nn.LayerNorm(patch_input_dim),
            nn.Linear(patch_input_dim, dim),
            nn.LayerNorm(dim)
        )

        self.spec = Spectrogram(
            n_fft=spec_n_fft,
            power=spec_power,
            win_length=spec_win_length,
            hop_length=spec_hop_length,
            pad=spec_pad,
            center=spec_center,
            pad_mode=spec_pad_mode
        )

        self.transformer = Transformer(
            dim=dim,
            depth=depth,
            dim_head=dim_head,
            heads=heads,
            attn_dropout=attn_dropout,
            ff_mult=ff_mult,
            ff_dropout=ff_dropout
        )

        self.norm = LayerNorm(dim)

        # patch dropout

        self.patch_dropout_prob = patch_dropout_prob

        # 2d dynamic positional bias

        mlp_hidden_dim = dim // 4

        self.dynamic_pos_bias_mlp = nn.Sequential(
            nn.Linear(2, mlp_hidden_dim),
            nn.SiLU(),
            nn.Linear(mlp_hidden_dim, mlp_hidden_dim),
            nn.SiLU(),
            nn.Linear(mlp_hidden_dim, heads),
            Rearrange('... i j h -> ... h i j')
        )

    def forward(self, x, force_no_patch_dropout=False):
        batch, device = x.shape[0], x.device

        x = self.spec(x)

        # automatically crop if audio does not yield a 2d spectrogram that is divisible by patch sizes

        height, width = x.shape[-2:]
        patch_height, patch_width = self.patch_size

        rounded_height, rounded_width = map(lambda args: round_down_nearest_multiple(*args),
                                            ((height, patch_height), (width, patch_width)))

        if (height, width) != (rounded_height, rounded_width):
            print_once(f'spectrogram yielded shape of {(height, width)}, but had to be cropped to '
                       f'{(rounded_height, rounded_width)} to be patchified for transformer')

        x = x[..., :rounded_height, :rounded_width]

        # to patches

        x = self.to_patch_tokens(x)

        # get number of patches along height and width

        if FIXED:
            _, num_patch_height, num_patch_width, _ = x.shape
        else:
            num_patch_height, num_patch_width = x.shape[-2:]

        # get 2d relative positions

        grid = torch.stack(torch.meshgrid(
            torch.arange(num_patch_height, device=device),
            torch.arange(num_patch_width, device=device),
            indexing='ij'), dim=-1)

        grid = grid.reshape(-1, grid.shape[-1])

        # 2d sinusoidal positional embedding

        x = x + posemb_sincos_2d(x)

        x = x.reshape(batch, -1, x.shape[-1])

        # patch dropout

        if self.training and self.patch_dropout_prob > 0. and not force_no_patch_dropout:
            n, device = x.shape[1], x.device

            batch_indices = torch.arange(batch, device=device)
            batch_indices = batch_indices[:, None]
            num_patches_keep = max(1, int(n * (1 - self.patch_dropout_prob)))
            patch_indices_keep = torch.randn(batch, n, device=device).topk(num_patches_keep, dim=-1).indices

            x = x[batch_indices, patch_indices_keep]

            grid = grid[None].expand(batch, *grid.shape)
            grid = grid[batch_indices, patch_indices_keep]

        # 2d relative positional bias

        rel_dist = grid[..., :, None, :] - grid[..., None, :, :]
        rel_pos_bias = self.dynamic_pos_bias_mlp(rel_dist.float())

        # attention, what else

        x = self.transformer(x, rel_pos_bias=rel_pos_bias)

        # final global average and norm

        x = x.mean(dim=1)

        return self.norm(x)


def main():
    torch.manual_seed(0)
    audio_transformer = AudioSpectrogramTransformer(
        dim=32,
        depth=2,
        patch_size=16,
        dim_head=16,
        heads=4,
        spec_n_fft=128,
        spec_win_length=24,
        patch_dropout_prob=0.25,
    )
    audio_transformer.train()  # MuLaN training step: patch dropout on

    # two clips of 768 samples: spectrogram (65, 65) -> cropped (64, 64) -> 4 x 4 patches of 16 x 16
    wavs = torch.randn(2, 768)

    torch.manual_seed(1)
    audio_embeds = audio_transformer(wavs)

    # contrastive step as MuLaN does it, against fixed text latents
    text_latents = l2norm(torch.randn(2, 32, generator=torch.Generator().manual_seed(2)))
    audio_latents = l2norm(audio_embeds)
    sims = einsum('i d, j d -> i j', text_latents, audio_latents) * 10.
    loss = F.cross_entropy(sims, torch.arange(2)) + F.cross_entropy(sims.t(), torch.arange(2))

    print("audio embeds[:, :6]:", [[round(v, 5) for v in row[:6].tolist()] for row in audio_embeds])
    print("contrastive loss:", round(loss.item(), 6))


if __name__ == "__main__":
    main()
