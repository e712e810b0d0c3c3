# Stylish-TTS/stylish-tts commit 6cb2c17 ("Fix SDPA not match manual attention"): the SDPA path of the text
# encoder filled masked scores with -inf, so padded phoneme rows (which see no key at all) become NaN.
# (The same commit also fixed an output transpose; that part is kept fixed here in both modes.)
import math
import sys

import torch
from torch import nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv


def sequence_mask(length, max_length=None):
    if max_length is None:
        max_length = length.max()
    x = torch.arange(max_length, dtype=length.dtype, device=length.device)
    return x.unsqueeze(0) < length.unsqueeze(1)


class LayerNorm(nn.Module):
    def __init__(self, channels, eps=1e-4):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        mean = torch.mean(x, 1, keepdim=True)
        variance = torch.mean((x - mean) ** 2, 1, keepdim=True)
        x = (x - mean) * torch.rsqrt(variance + self.eps)
        return x * self.gamma.view(1, -1, 1) + self.beta.view(1, -1, 1)


class RotaryPositionalEmbeddings(nn.Module):
    def __init__(self, d, base=10_000):
        super().__init__()
        self.base, self.d = base, int(d)

    def forward(self, x):
        x = x.permute(2, 0, 1, 3)  # b h t d -> t b h d
        theta = 1.0 / (self.base ** (torch.arange(0, self.d, 2).float() / self.d))
        idx_theta = torch.einsum("n,d->nd", torch.arange(x.shape[0]).float(), theta)
        idx_theta2 = torch.cat([idx_theta, idx_theta], dim=1)
        cos, sin = idx_theta2.cos()[:, None, None, :], idx_theta2.sin()[:, None, None, :]
        x_rope, x_pass = x[..., : self.d], x[..., self.d :]
        d_2 = self.d // 2
        neg_half_x = torch.cat([-x_rope[..., d_2:], x_rope[..., :d_2]], dim=-1)
        x_rope = x_rope * cos + neg_half_x * sin
        return torch.cat((x_rope, x_pass), dim=-1).permute(1, 2, 0, 3)  # t b h d -> b h t d


class MultiHeadAttention(nn.Module):
    def __init__(self, channels, out_channels, n_heads, p_dropout=0.0, use_sdpa=True):
        super().__init__()
        self.use_sdpa = use_sdpa
        self.n_heads = n_heads
        self.p_dropout = p_dropout
        self.k_channels = channels // n_heads
        self.conv_q = nn.Conv1d(channels, channels, 1)
        self.conv_k = nn.Conv1d(channels, channels, 1)
        self.conv_v = nn.Conv1d(channels, channels, 1)
        self.query_rotary_pe = RotaryPositionalEmbeddings(self.k_channels * 0.5)
        self.key_rotary_pe = RotaryPositionalEmbeddings(self.k_channels * 0.5)
        self.conv_o = nn.Conv1d(channels, out_channels, 1)

    def forward(self, x, c, attn_mask=None):
        q, k, v = self.conv_q(x), self.conv_k(c), self.conv_v(c)
        x, _ = self.attention(q, k, v, mask=attn_mask)
        return self.conv_o(x)

    def attention(self, query, key, value, mask=None):
        b, d, t_s, t_t = (*key.size(), query.size(2))
        # b (h c) t -> b h t c
        query = query.view(b, self.n_heads, self.k_channels, t_t).transpose(2, 3)
        key = key.view(b, self.n_heads, self.k_channels, t_s).transpose(2, 3)
        value = value.view(b, self.n_heads, self.k_channels, t_s).transpose(2, 3)
        query = self.query_rotary_pe(query)
        key = self.key_rotary_pe(key)

        if self.use_sdpa:
            final_attn_mask = None
            if mask is not None:
                expanded_bool_mask = mask
                additive_external_mask = torch.zeros_like(expanded_bool_mask, dtype=query.dtype)
                if FIXED:
                    additive_external_mask.masked_fill_(expanded_bool_mask == False, -1e4)
                else:
                    additive_external_mask.masked_fill_(expanded_bool_mask == False, -float("inf"))
                final_attn_mask = additive_external_mask

            output = F.scaled_dot_product_attention(
                query, key, value, attn_mask=final_attn_mask,
                dropout_p=self.p_dropout if self.training else 0.0, is_causal=False,
            )
            output = output.transpose(2, 3).contiguous().view(b, d, t_t)
            return output, None
        else:
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
        x = torch.relu(self.conv_1(x * x_mask))
        return self.conv_2(x * x_mask) * x_mask


class Encoder(nn.Module):
    def __init__(self, hidden_channels, filter_channels, n_heads, n_layers, kernel_size=1):
        super().__init__()
        self.n_layers = n_layers
        self.attn_layers = nn.ModuleList(MultiHeadAttention(hidden_channels, hidden_channels, n_heads) for _ in range(n_layers))
        self.norm_layers_1 = nn.ModuleList(LayerNorm(hidden_channels) for _ in range(n_layers))
        self.ffn_layers = nn.ModuleList(FFN(hidden_channels, hidden_channels, filter_channels, kernel_size) for _ in range(n_layers))
        self.norm_layers_2 = nn.ModuleList(LayerNorm(hidden_channels) for _ in range(n_layers))

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
    def __init__(self, n_vocab=50, inter_dim=16, hidden_dim=32, filter_channels=64, heads=4, layers=2, kernel_size=3):
        super().__init__()
        self.n_channels = hidden_dim
        self.emb = nn.Embedding(n_vocab, hidden_dim)
        nn.init.normal_(self.emb.weight, 0.0, hidden_dim**-0.5)
        self.encoder = Encoder(hidden_dim, filter_channels, heads, layers, kernel_size)
        self.proj_m = nn.Conv1d(hidden_dim, inter_dim, 1)

    def forward(self, x, x_lengths):
        x = self.emb(x) * math.sqrt(self.n_channels)
        x = torch.transpose(x, 1, -1)
        x_mask = torch.unsqueeze(sequence_mask(x_lengths, x.size(2)), 1).to(x.dtype)
        x = self.encoder(x, x_mask)
        mu = self.proj_m(x) * x_mask
        return mu, x, x_mask


def main():
    torch.manual_seed(0)
    model = TextEncoder().eval()
    # a padded batch of phoneme ids, as the training collate builds it
    x_lengths = torch.tensor([12, 7])
    x = torch.randint(1, 50, (2, 12)) * sequence_mask(x_lengths, 12)
    with torch.no_grad():
        mu, _, x_mask = model(x, x_lengths)
        # the first attention layer through the SDPA path and through the manual path, same weights and mask
        h = torch.transpose(model.emb(x) * math.sqrt(model.n_channels), 1, -1) * x_mask
        attn = model.encoder.attn_layers[0]
        attn_mask = x_mask.unsqueeze(2) * x_mask.unsqueeze(-1)
        sdpa_out = attn(h, h, attn_mask)
        attn.use_sdpa = False
        manual_out = attn(h, h, attn_mask)
    diff = (sdpa_out - manual_out).abs()
    print(f"{'fixed' if FIXED else 'buggy'}: encoder output finite: {torch.isfinite(mu).all().item()}; "
          f"SDPA vs manual attention, max diff = {diff.nan_to_num(float('inf')).max().item():.3e} "
          f"(padded rows: {diff[1, :, 7:].nan_to_num(float('inf')).max().item():.3e})")


if __name__ == "__main__":
    main()
