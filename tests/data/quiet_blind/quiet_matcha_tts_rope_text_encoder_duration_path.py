"""Matcha-TTS text encoder + duration-expanded alignment over a right-padded phoneme batch.

Ported (tiny sizes) from shivammehta25/Matcha-TTS @108906c603fad5055f2649b3fd71d2bbdf222eac:
  * matcha/models/components/text_encoder.py: TextEncoder (ConvReluNorm prenet, Encoder, DurationPredictor),
    MultiHeadAttention.attention with RoPE on half of each head's channels, and
    Encoder.forward's pair mask attn_mask = x_mask.unsqueeze(2) * x_mask.unsqueeze(-1) filled with
    scores.masked_fill(mask == 0, -1e4) (finite: padded query rows are fully masked on purpose and come
    out uniform, then x * x_mask zeroes them).
  * matcha/utils/model.py: sequence_mask, fix_len_compatibility, generate_path.
  * matcha/models/matcha_tts.py MatchaTTS.synthesise: w_ceil, y_lengths, y_mask over the U-Net-compatible
    length, attn_mask = x_mask.unsqueeze(-1) * y_mask.unsqueeze(2), attn = generate_path(...),
    mu_y = attn^T @ mu_x (each mel frame copies exactly one phoneme's encoder output).
Check: the padded batch must equal each sentence run alone, and the path must equal a loop over durations.
"""
import math

import torch
import torch.nn as nn

torch.manual_seed(0)


def sequence_mask(length, max_length=None):
    if max_length is None:
        max_length = length.max()
    x = torch.arange(max_length, dtype=length.dtype, device=length.device)
    return x.unsqueeze(0) < length.unsqueeze(1)


def fix_len_compatibility(length, num_downsamplings_in_unet=2):
    factor = torch.scalar_tensor(2).pow(num_downsamplings_in_unet)
    length = (length / factor).ceil() * factor
    return length.int().item()


def convert_pad_shape(pad_shape):
    inverted_shape = pad_shape[::-1]
    return [item for sublist in inverted_shape for item in sublist]


def generate_path(duration, mask):
    b, t_x, t_y = mask.shape
    cum_duration = torch.cumsum(duration, 1)
    cum_duration_flat = cum_duration.view(b * t_x)
    path = sequence_mask(cum_duration_flat, t_y).to(mask.dtype)
    path = path.view(b, t_x, t_y)
    path = path - torch.nn.functional.pad(path, convert_pad_shape([[0, 0], [1, 0], [0, 0]]))[:, :-1]
    path = path * mask
    return path


class LayerNorm(nn.Module):
    def __init__(self, channels, eps=1e-4):
        super().__init__()
        self.channels = channels
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        n_dims = len(x.shape)
        mean = torch.mean(x, 1, keepdim=True)
        variance = torch.mean((x - mean) ** 2, 1, keepdim=True)
        x = (x - mean) * torch.rsqrt(variance + self.eps)
        shape = [1, -1] + [1] * (n_dims - 2)
        return x * self.gamma.view(*shape) + self.beta.view(*shape)


class ConvReluNorm(nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels, kernel_size, n_layers):
        super().__init__()
        self.n_layers = n_layers
        self.conv_layers = nn.ModuleList()
        self.norm_layers = nn.ModuleList()
        self.conv_layers.append(nn.Conv1d(in_channels, hidden_channels, kernel_size, padding=kernel_size // 2))
        self.norm_layers.append(LayerNorm(hidden_channels))
        for _ in range(n_layers - 1):
            self.conv_layers.append(nn.Conv1d(hidden_channels, hidden_channels, kernel_size, padding=kernel_size // 2))
            self.norm_layers.append(LayerNorm(hidden_channels))
        self.proj = nn.Conv1d(hidden_channels, out_channels, 1)
        # upstream zero-inits proj; small random weights here so the prenet actually does something
        nn.init.normal_(self.proj.weight, std=0.1)

    def forward(self, x, x_mask):
        x_org = x
        for i in range(self.n_layers):
            x = self.conv_layers[i](x * x_mask)
            x = self.norm_layers[i](x)
            x = torch.relu(x)
        x = x_org + self.proj(x)
        return x * x_mask


class DurationPredictor(nn.Module):
    def __init__(self, in_channels, filter_channels, kernel_size):
        super().__init__()
        self.conv_1 = nn.Conv1d(in_channels, filter_channels, kernel_size, padding=kernel_size // 2)
        self.norm_1 = LayerNorm(filter_channels)
        self.conv_2 = nn.Conv1d(filter_channels, filter_channels, kernel_size, padding=kernel_size // 2)
        self.norm_2 = LayerNorm(filter_channels)
        self.proj = nn.Conv1d(filter_channels, 1, 1)

    def forward(self, x, x_mask):
        x = self.conv_1(x * x_mask)
        x = torch.relu(x)
        x = self.norm_1(x)
        x = self.conv_2(x * x_mask)
        x = torch.relu(x)
        x = self.norm_2(x)
        x = self.proj(x * x_mask)
        return x * x_mask


class RotaryPositionalEmbeddings(nn.Module):
    def __init__(self, d, base=10_000):
        super().__init__()
        self.base = base
        self.d = int(d)
        self.cos_cached = None
        self.sin_cached = None

    def _build_cache(self, x):
        if self.cos_cached is not None and x.shape[0] <= self.cos_cached.shape[0]:
            return
        seq_len = x.shape[0]
        theta = 1.0 / (self.base ** (torch.arange(0, self.d, 2).float() / self.d))
        seq_idx = torch.arange(seq_len).float()
        idx_theta = torch.einsum("n,d->nd", seq_idx, theta)
        idx_theta2 = torch.cat([idx_theta, idx_theta], dim=1)
        self.cos_cached = idx_theta2.cos()[:, None, None, :]
        self.sin_cached = idx_theta2.sin()[:, None, None, :]

    def _neg_half(self, x):
        d_2 = self.d // 2
        return torch.cat([-x[:, :, :, d_2:], x[:, :, :, :d_2]], dim=-1)

    def forward(self, x):
        x = x.permute(2, 0, 1, 3)  # einops "b h t d -> t b h d"
        self._build_cache(x)
        x_rope, x_pass = x[..., : self.d], x[..., self.d:]
        neg_half_x = self._neg_half(x_rope)
        x_rope = (x_rope * self.cos_cached[: x.shape[0]]) + (neg_half_x * self.sin_cached[: x.shape[0]])
        return torch.cat((x_rope, x_pass), dim=-1).permute(1, 2, 0, 3)  # "t b h d -> b h t d"


class MultiHeadAttention(nn.Module):
    def __init__(self, channels, out_channels, n_heads):
        super().__init__()
        assert channels % n_heads == 0
        self.n_heads = n_heads
        self.k_channels = channels // n_heads
        self.conv_q = nn.Conv1d(channels, channels, 1)
        self.conv_k = nn.Conv1d(channels, channels, 1)
        self.conv_v = nn.Conv1d(channels, channels, 1)
        self.query_rotary_pe = RotaryPositionalEmbeddings(self.k_channels * 0.5)
        self.key_rotary_pe = RotaryPositionalEmbeddings(self.k_channels * 0.5)
        self.conv_o = nn.Conv1d(channels, out_channels, 1)
        nn.init.xavier_uniform_(self.conv_q.weight)
        nn.init.xavier_uniform_(self.conv_k.weight)
        nn.init.xavier_uniform_(self.conv_v.weight)

    def forward(self, x, c, attn_mask=None):
        q = self.conv_q(x)
        k = self.conv_k(c)
        v = self.conv_v(c)
        x, self.attn = self.attention(q, k, v, mask=attn_mask)
        return self.conv_o(x)

    def attention(self, query, key, value, mask=None):
        b, d, t_s, t_t = (*key.size(), query.size(2))
        query = query.view(b, self.n_heads, -1, query.size(-1)).transpose(2, 3)  # "b (h c) t-> b h t c"
        key = key.view(b, self.n_heads, -1, key.size(-1)).transpose(2, 3)  # "b (h c) t-> b h t c"
        value = value.view(b, self.n_heads, -1, value.size(-1)).transpose(2, 3)  # "b (h c) t-> b h t c"
        query = self.query_rotary_pe(query)
        key = self.key_rotary_pe(key)
        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(self.k_channels)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e4)
        p_attn = torch.nn.functional.softmax(scores, dim=-1)
        output = torch.matmul(p_attn, value)
        output = output.transpose(2, 3).contiguous().view(b, d, t_t)
        return output, p_attn


class FFN(nn.Module):
    def __init__(self, in_channels, out_channels, filter_channels, kernel_size):
        super().__init__()
        self.conv_1 = nn.Conv1d(in_channels, filter_channels, kernel_size, padding=kernel_size // 2)
        self.conv_2 = nn.Conv1d(filter_channels, out_channels, kernel_size, padding=kernel_size // 2)

    def forward(self, x, x_mask):
        x = self.conv_1(x * x_mask)
        x = torch.relu(x)
        x = self.conv_2(x * x_mask)
        return x * x_mask


class Encoder(nn.Module):
    def __init__(self, hidden_channels, filter_channels, n_heads, n_layers, kernel_size=1):
        super().__init__()
        self.n_layers = n_layers
        self.attn_layers = nn.ModuleList()
        self.norm_layers_1 = nn.ModuleList()
        self.ffn_layers = nn.ModuleList()
        self.norm_layers_2 = nn.ModuleList()
        for _ in range(n_layers):
            self.attn_layers.append(MultiHeadAttention(hidden_channels, hidden_channels, n_heads))
            self.norm_layers_1.append(LayerNorm(hidden_channels))
            self.ffn_layers.append(FFN(hidden_channels, hidden_channels, filter_channels, kernel_size))
            self.norm_layers_2.append(LayerNorm(hidden_channels))

    def forward(self, x, x_mask):
        attn_mask = x_mask.unsqueeze(2) * x_mask.unsqueeze(-1)
        for i in range(self.n_layers):
            x = x * x_mask
            y = self.attn_layers[i](x, x, attn_mask)
            x = self.norm_layers_1[i](x + y)
            y = self.ffn_layers[i](x, x_mask)
            x = self.norm_layers_2[i](x + y)
        return x * x_mask


class TextEncoder(nn.Module):
    def __init__(self, n_vocab=20, n_feats=6, n_channels=16, filter_channels=32, n_heads=2, n_layers=2,
                 kernel_size=3, filter_channels_dp=16, dp_kernel_size=3):
        super().__init__()
        self.n_channels = n_channels
        self.emb = nn.Embedding(n_vocab, n_channels)
        nn.init.normal_(self.emb.weight, 0.0, n_channels ** -0.5)
        self.prenet = ConvReluNorm(n_channels, n_channels, n_channels, kernel_size=5, n_layers=3)
        self.encoder = Encoder(n_channels, filter_channels, n_heads, n_layers, kernel_size)
        self.proj_m = nn.Conv1d(n_channels, n_feats, 1)
        self.proj_w = DurationPredictor(n_channels, filter_channels_dp, dp_kernel_size)
        with torch.no_grad():  # durations of a few frames per phoneme
            self.proj_w.proj.weight.mul_(0.3)
            self.proj_w.proj.bias.fill_(math.log(2.2))

    def forward(self, x, x_lengths):
        x = self.emb(x) * math.sqrt(self.n_channels)
        x = torch.transpose(x, 1, -1)
        x_mask = torch.unsqueeze(sequence_mask(x_lengths, x.size(2)), 1).to(x.dtype)
        x = self.prenet(x, x_mask)
        x = self.encoder(x, x_mask)
        mu = self.proj_m(x) * x_mask
        logw = self.proj_w(torch.detach(x), x_mask)
        return mu, logw, x_mask


@torch.no_grad()
def synthesise_prior(encoder, x, x_lengths, length_scale=1.0):
    mu_x, logw, x_mask = encoder(x, x_lengths)
    w = torch.exp(logw) * x_mask
    w_ceil = torch.ceil(w) * length_scale
    y_lengths = torch.clamp_min(torch.sum(w_ceil, [1, 2]), 1).long()
    y_max_length = y_lengths.max()
    y_max_length_ = fix_len_compatibility(y_max_length)
    y_mask = sequence_mask(y_lengths, y_max_length_).unsqueeze(1).to(x_mask.dtype)
    attn_mask = x_mask.unsqueeze(-1) * y_mask.unsqueeze(2)
    attn = generate_path(w_ceil.squeeze(1), attn_mask.squeeze(1)).unsqueeze(1)
    mu_y = torch.matmul(attn.squeeze(1).transpose(1, 2), mu_x.transpose(1, 2)).transpose(1, 2)
    return mu_x, logw, w_ceil, y_lengths, y_mask, attn.squeeze(1), mu_y


def path_by_loop(durations, t_y):
    """Independent reference: phoneme i owns frames [sum(d[:i]), sum(d[:i+1]))."""
    path = torch.zeros(len(durations), t_y)
    start = 0
    for i, d in enumerate(durations):
        path[i, start:start + d] = 1.0
        start += d
    return path


def main():
    enc = TextEncoder().eval()
    lengths = [9, 4, 6]
    sents = [torch.randint(1, 20, (n,)) for n in lengths]
    x = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, s in enumerate(sents):
        x[i, : len(s)] = s
    x_lengths = torch.tensor(lengths)

    mu_x, logw, w_ceil, y_lengths, y_mask, attn, mu_y = synthesise_prior(enc, x, x_lengths)
    ok = True
    for i, s in enumerate(sents):
        n = len(s)
        m1, lw1, wc1, yl1, ym1, at1, muy1 = synthesise_prior(enc, s[None], torch.tensor([n]))
        ok &= torch.allclose(mu_x[i, :, :n], m1[0], atol=1e-5)
        ok &= torch.allclose(logw[i, :, :n], lw1[0], atol=1e-5)
        ok &= torch.equal(w_ceil[i, :, :n], wc1[0])
        yl = int(yl1[0])
        ok &= yl == int(y_lengths[i])
        ok &= torch.allclose(mu_y[i, :, :yl], muy1[0, :, :yl], atol=1e-5)
        ok &= bool((mu_y[i, :, yl:] == 0).all()) and bool((attn[i, n:] == 0).all())
        durs = [int(d) for d in wc1[0, 0]]
        ok &= torch.equal(attn[i, :n], path_by_loop(durs, attn.size(-1)))
        ok &= torch.equal(attn[i].sum(0)[:yl], torch.ones(yl))  # every real frame has exactly one phoneme
    print("y_lengths", y_lengths.tolist(), "T_y (U-Net compatible)", attn.size(-1))
    print("padded batch matches each sentence alone and the duration loop:", bool(ok))
    assert ok


if __name__ == "__main__":
    main()
