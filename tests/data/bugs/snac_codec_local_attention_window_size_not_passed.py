# hubertsiuzdak/snac commit 946c3bf ("fix args & padding"): SNAC.__init__ did not pass its
# attn_window_size to Encoder/Decoder, so their LocalMHA blocks kept the default 32-frame windows
# whatever window the model was configured with (local attention over the wrong windows).
import math
import sys

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- snac/attention.py ----
class LocalMHA(nn.Module):
    def __init__(self, dim=1024, window_size=32, dim_head=64, use_rotary_pos_emb=True):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.heads = dim // dim_head
        self.window_size = window_size
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        if use_rotary_pos_emb:
            self.rel_pos = SinusoidalEmbeddings(dim_head, scale_base=window_size // 2)
        else:
            self.rel_pos = None
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, C, T = x.shape
        residual = x
        x = self.norm(x.transpose(1, 2))
        windows = T // self.window_size
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        # einops "b (w n) (h d) -> b h w n d" written with view/permute
        q, k, v = map(lambda t: t.reshape(B, windows, -1, self.heads, t.shape[-1] // self.heads).permute(0, 3, 1, 2, 4), (q, k, v))
        if self.rel_pos is not None:
            pos_emb, scale = self.rel_pos(k)
            q, k = apply_rotary_pos_emb(q, k, pos_emb, scale)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        out = out.permute(0, 2, 3, 1, 4).reshape(B, T, -1)  # "b h w n d -> b (w n) (h d)"
        out = self.to_out(out)
        return out.transpose(1, 2) + residual


class SinusoidalEmbeddings(nn.Module):
    def __init__(self, dim, scale_base=None, use_xpos=False):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.use_xpos = use_xpos
        self.scale_base = scale_base

    def forward(self, x):
        seq_len, device = x.shape[-2], x.device
        t = torch.arange(seq_len, device=x.device).type_as(self.inv_freq)
        freqs = torch.einsum("i , j -> i j", t, self.inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs, torch.ones(1, device=device)


def rotate_half(x):
    x1, x2 = x.unflatten(-1, (2, -1)).unbind(dim=-2)  # "b ... (r d) -> b ... r d", r=2
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, freqs, scale=1):
    q_len = q.shape[-2]
    q_freqs = freqs[..., -q_len:, :]
    inv_scale = scale**-1
    q = (q * q_freqs.cos() * scale) + (rotate_half(q) * q_freqs.sin() * scale)
    k = (k * freqs.cos() * inv_scale) + (rotate_half(k) * freqs.sin() * inv_scale)
    return q, k


# ---- snac/layers.py ----
def WNConv1d(*args, **kwargs):
    return weight_norm(nn.Conv1d(*args, **kwargs))


def WNConvTranspose1d(*args, **kwargs):
    return weight_norm(nn.ConvTranspose1d(*args, **kwargs))


def snake(x, alpha):
    shape = x.shape
    x = x.reshape(shape[0], shape[1], -1)
    x = x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)
    return x.reshape(shape)


class Snake1d(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x):
        return snake(x, self.alpha)


class ResidualUnit(nn.Module):
    def __init__(self, dim=16, dilation=1, kernel=7, groups=1):
        super().__init__()
        pad = ((kernel - 1) * dilation) // 2
        self.block = nn.Sequential(
            Snake1d(dim),
            WNConv1d(dim, dim, kernel_size=kernel, dilation=dilation, padding=pad, groups=groups),
            Snake1d(dim),
            WNConv1d(dim, dim, kernel_size=1),
        )

    def forward(self, x):
        y = self.block(x)
        pad = (x.shape[-1] - y.shape[-1]) // 2
        if pad > 0:
            x = x[..., pad:-pad]
        return x + y


class EncoderBlock(nn.Module):
    def __init__(self, output_dim=16, input_dim=None, stride=1, groups=1):
        super().__init__()
        input_dim = input_dim or output_dim // 2
        self.block = nn.Sequential(
            ResidualUnit(input_dim, dilation=1, groups=groups),
            ResidualUnit(input_dim, dilation=3, groups=groups),
            ResidualUnit(input_dim, dilation=9, groups=groups),
            Snake1d(input_dim),
            WNConv1d(input_dim, output_dim, kernel_size=2 * stride, stride=stride, padding=math.ceil(stride / 2)),
        )

    def forward(self, x):
        return self.block(x)


class NoiseBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.linear = WNConv1d(dim, dim, kernel_size=1, bias=False)

    def forward(self, x):
        B, C, T = x.shape
        noise = torch.randn((B, 1, T), device=x.device, dtype=x.dtype)
        return x + noise * self.linear(x)


class DecoderBlock(nn.Module):
    def __init__(self, input_dim=16, output_dim=8, stride=1, noise=False, groups=1):
        super().__init__()
        layers = [
            Snake1d(input_dim),
            WNConvTranspose1d(input_dim, output_dim, kernel_size=2 * stride, stride=stride,
                              padding=math.ceil(stride / 2), output_padding=stride % 2),
        ]
        if noise:
            layers.append(NoiseBlock(output_dim))
        layers += [
            ResidualUnit(output_dim, dilation=1, groups=groups),
            ResidualUnit(output_dim, dilation=3, groups=groups),
            ResidualUnit(output_dim, dilation=9, groups=groups),
        ]
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        return self.block(x)


class Encoder(nn.Module):
    def __init__(self, d_model=64, strides=[3, 3, 7, 7], depthwise=False, attn_window_size=32):
        super().__init__()
        layers = [WNConv1d(1, d_model, kernel_size=7, padding=3)]
        for stride in strides:
            d_model *= 2
            groups = d_model // 2 if depthwise else 1
            layers += [EncoderBlock(output_dim=d_model, stride=stride, groups=groups)]
        if attn_window_size is not None:
            layers += [LocalMHA(dim=d_model, window_size=attn_window_size)]
        groups = d_model if depthwise else 1
        layers += [WNConv1d(d_model, d_model, kernel_size=7, padding=3, groups=groups)]
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        return self.block(x)


class Decoder(nn.Module):
    def __init__(self, input_channel, channels, rates, noise=False, depthwise=False, attn_window_size=32, d_out=1):
        super().__init__()
        if depthwise:
            layers = [
                WNConv1d(input_channel, input_channel, kernel_size=7, padding=3, groups=input_channel),
                WNConv1d(input_channel, channels, kernel_size=1),
            ]
        else:
            layers = [WNConv1d(input_channel, channels, kernel_size=7, padding=3)]
        if attn_window_size is not None:
            layers += [LocalMHA(dim=channels, window_size=attn_window_size)]
        for i, stride in enumerate(rates):
            input_dim = channels // 2**i
            output_dim = channels // 2 ** (i + 1)
            groups = output_dim if depthwise else 1
            layers.append(DecoderBlock(input_dim, output_dim, stride, noise, groups=groups))
        layers += [Snake1d(output_dim), WNConv1d(output_dim, d_out, kernel_size=7, padding=3), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, x):
        return self.model(x)


# ---- snac/snac.py (the residual vector quantizer between encoder and decoder is left out) ----
class SNAC(nn.Module):
    def __init__(self, sampling_rate=44100, encoder_dim=64, encoder_rates=[3, 3, 7, 7], latent_dim=None,
                 decoder_dim=1536, decoder_rates=[7, 7, 3, 3], attn_window_size=32, vq_strides=[8, 4, 2, 1],
                 noise=True, depthwise=True):
        super().__init__()
        if latent_dim is None:
            latent_dim = encoder_dim * (2 ** len(encoder_rates))
        self.hop_length = math.prod(encoder_rates)
        self.vq_strides = vq_strides
        self.attn_window_size = attn_window_size
        if FIXED:
            self.encoder = Encoder(encoder_dim, encoder_rates, depthwise=depthwise, attn_window_size=attn_window_size)
            self.decoder = Decoder(latent_dim, decoder_dim, decoder_rates, noise, depthwise=depthwise,
                                   attn_window_size=attn_window_size)
        else:
            self.encoder = Encoder(encoder_dim, encoder_rates, depthwise=depthwise)
            self.decoder = Decoder(latent_dim, decoder_dim, decoder_rates, noise, depthwise=depthwise)

    def preprocess(self, audio_data):
        length = audio_data.shape[-1]
        if FIXED:
            lcm = math.lcm(self.vq_strides[0], self.attn_window_size or 1)
            pad_to = self.hop_length * lcm
        else:
            pad_to = self.hop_length * self.attn_window_size
        right_pad = math.ceil(length / pad_to) * pad_to - length
        return nn.functional.pad(audio_data, (0, right_pad))

    def forward(self, audio_data):
        length = audio_data.shape[-1]
        audio_data = self.preprocess(audio_data)
        z = self.encoder(audio_data)
        x = self.decoder(z)
        return x[..., :length], z


def local_attention_reference(mha, x, window):
    """LocalMHA computed window by window with the window the model was configured with."""
    B, C, T = x.shape
    h = mha.norm(x.transpose(1, 2))
    q, k, v = mha.to_qkv(h).chunk(3, dim=-1)
    outs = []
    for s in range(0, T, window):
        qs, ks, vs = (t[:, s : s + window].unflatten(-1, (mha.heads, -1)).transpose(1, 2) for t in (q, k, v))
        freqs, scale = mha.rel_pos(ks)
        qs, ks = apply_rotary_pos_emb(qs, ks, freqs, scale)
        att = torch.softmax(qs @ ks.transpose(-1, -2) / math.sqrt(qs.shape[-1]), dim=-1)
        outs.append((att @ vs).transpose(1, 2).flatten(-2))
    return mha.to_out(torch.cat(outs, dim=1)).transpose(1, 2) + x


ATTN_WINDOW = 8
model = SNAC(encoder_dim=16, encoder_rates=[2, 2], decoder_dim=64, decoder_rates=[2, 2],
             attn_window_size=ATTN_WINDOW, vq_strides=[4, 2, 1]).eval()
seen = []
for m in model.modules():
    if isinstance(m, LocalMHA):
        m.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp[0], out)))

audio = torch.randn(2, 1, 4 * 64)  # 64 latent frames
with torch.no_grad():
    recon, z = model(audio)
    diff = max((out - local_attention_reference(mod, inp, ATTN_WINDOW)).abs().max().item() for mod, inp, out in seen)
print(f"fixed={FIXED} windows used: {[mod.window_size for mod, _, _ in seen]} (configured {ATTN_WINDOW})")
print(f"max |LocalMHA output - {ATTN_WINDOW}-frame windowed reference| = {diff:.6f}")
