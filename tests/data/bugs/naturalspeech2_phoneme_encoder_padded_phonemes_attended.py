"""NaturalSpeech 2 phoneme encoder over a right-padded batch of phoneme ids.

Citation: lucidrains/naturalspeech2-pytorch commit c2cae47 ("phoneme encoder needs to account for
padding, use an extra token placed at the very end of the embedding table for padding"),
naturalspeech2_pytorch/naturalspeech2_pytorch.py (PhonemeEncoder, Attention, Transformer) and
naturalspeech2_pytorch/attend.py (Attend).

The bug: PhonemeEncoder.forward(x) took no mask: a batch of phoneme sequences padded to the longest
one ran through a same-padded Conv1d and the transformer's attention over every position, padding
included, so a short sentence's phoneme encodings depended on the pad slots after it.

The fix: the embedding table gets one extra row used for padding (pad ids < 0 mapped to it),
the conv becomes a CausalConv1d, and forward(x, mask) hands the mask through Transformer and
Attention to Attend, which fills the padded keys of the similarity with -finfo.max.

einops' rearrange is written out with view / permute (einops is not installed here); the rest
follows the project at toy sizes (use_flash = False, the einsum path of Attend).
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def Sequential(*mods):
    return nn.Sequential(*filter(exists, mods))


class Rearrange(nn.Module):
    # Rearrange('b n c -> b c n') and back
    def forward(self, x):
        return x.transpose(1, 2)


# attend.py

class Attend(nn.Module):
    def __init__(self, dropout = 0., causal = False, use_flash = False):
        super().__init__()
        self.dropout = dropout
        self.attn_dropout = nn.Dropout(dropout)
        self.causal = causal
        self.register_buffer("mask", None, persistent = False)
        self.use_flash = use_flash

    def get_mask(self, n, device):
        if exists(self.mask) and self.mask.shape[-1] >= n:
            return self.mask[:n, :n]

        mask = torch.ones((n, n), device = device, dtype = torch.bool).triu(1)
        self.register_buffer("mask", mask, persistent = False)
        return mask

    def forward(self, q, k, v, mask = None):
        n, device = q.shape[-2], q.device

        scale = q.shape[-1] ** -0.5

        kv_einsum_eq = 'b j d' if k.ndim == 3 else 'b h j d'

        # similarity

        sim = einsum(f"b h i d, {kv_einsum_eq} -> b h i j", q, k) * scale

        # key padding mask

        if exists(mask):
            mask = mask[:, None, None, :]  # rearrange(mask, 'b j -> b 1 1 j')
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)

        # causal mask

        if self.causal:
            causal_mask = self.get_mask(n, device)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)

        # attention

        attn = sim.softmax(dim = -1)
        attn = self.attn_dropout(attn)

        # aggregate values

        out = einsum(f"b h i j, {kv_einsum_eq} -> b h i d", attn, v)

        return out


# naturalspeech2_pytorch.py

class CausalConv1d(nn.Conv1d):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        kernel_size, = self.kernel_size
        dilation, = self.dilation
        stride, = self.stride

        assert stride == 1
        self.causal_padding = dilation * (kernel_size - 1)

    def forward(self, x):
        causal_padded_x = F.pad(x, (self.causal_padding, 0), value = 0.)
        return super().forward(causal_padded_x)


class RMSNorm(nn.Module):
    def __init__(self, dim, scale = True, dim_cond = None):
        super().__init__()
        self.cond = exists(dim_cond)
        self.to_gamma_beta = nn.Linear(dim_cond, dim * 2) if self.cond else None

        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x, cond = None):
        gamma = default(self.gamma, 1)
        out = F.normalize(x, dim = -1) * self.scale * gamma

        if not self.cond:
            return out

        gamma, beta = self.to_gamma_beta(cond).chunk(2, dim = -1)
        return out * gamma[:, None, :] + beta[:, None, :]


class GEGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim = -1)
        return F.gelu(gate) * x


def FeedForward(dim, mult = 4, causal_conv = False):
    dim_inner = int(dim * mult * 2 / 3)

    conv = None
    if causal_conv:
        conv = nn.Sequential(
            Rearrange(),
            CausalConv1d(dim_inner, dim_inner, 3),
            Rearrange(),
        )

    return Sequential(
        nn.Linear(dim, dim_inner * 2),
        GEGLU(),
        conv,
        nn.Linear(dim_inner, dim)
    )


class Attention(nn.Module):
    def __init__(
        self,
        dim,
        *,
        dim_context = None,
        causal = False,
        dim_head = 64,
        heads = 8,
        dropout = 0.,
        use_flash = False,
        cross_attn_include_queries = False
    ):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.cross_attn_include_queries = cross_attn_include_queries

        dim_inner = dim_head * heads
        dim_context = default(dim_context, dim)

        self.attend = Attend(causal = causal, dropout = dropout, use_flash = use_flash)
        self.to_q = nn.Linear(dim, dim_inner, bias = False)
        self.to_kv = nn.Linear(dim_context, dim_inner * 2, bias = False)
        self.to_out = nn.Linear(dim_inner, dim, bias = False)

    def forward(self, x, context = None, mask = None):
        h, has_context = self.heads, exists(context)

        context = default(context, x)

        if has_context and self.cross_attn_include_queries:
            context = torch.cat((x, context), dim = -2)

        q, k, v = (self.to_q(x), *self.to_kv(context).chunk(2, dim = -1))
        # rearrange(t, 'b n (h d) -> b h n d', h = h)
        q, k, v = map(lambda t: t.view(t.shape[0], t.shape[1], h, -1).permute(0, 2, 1, 3), (q, k, v))

        if FIXED:
            out = self.attend(q, k, v, mask = mask)
        else:
            out = self.attend(q, k, v)

        # rearrange(out, 'b h n d -> b n (h d)')
        out = out.permute(0, 2, 1, 3).reshape(out.shape[0], out.shape[2], -1)
        return self.to_out(out)


class Transformer(nn.Module):
    def __init__(
        self,
        dim,
        *,
        depth,
        causal = False,
        dim_head = 64,
        heads = 8,
        use_flash = False,
        dropout = 0.,
        ff_mult = 4,
        final_norm = False
    ):
        super().__init__()
        self.layers = nn.ModuleList([])

        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                RMSNorm(dim),
                Attention(
                    dim,
                    causal = causal,
                    dim_head = dim_head,
                    heads = heads,
                    dropout = dropout,
                    use_flash = use_flash
                ),
                RMSNorm(dim),
                FeedForward(
                    dim,
                    mult = ff_mult
                )
            ]))

        self.norm = RMSNorm(dim) if final_norm else nn.Identity()

    def forward(self, x, mask = None):
        for attn_norm, attn, ff_norm, ff in self.layers:
            if FIXED:
                x = attn(attn_norm(x), mask = mask) + x
            else:
                x = attn(attn_norm(x)) + x
            x = ff(ff_norm(x)) + x

        return self.norm(x)


class PhonemeEncoder(nn.Module):
    def __init__(
        self,
        *,
        num_tokens = None,
        dim = 512,
        dim_hidden = 1024,
        kernel_size = 9,
        depth = 6,
        dim_head = 64,
        heads = 8,
        conv_dropout = 0.2,
        attn_dropout = 0.,
        use_flash = False
    ):
        super().__init__()

        if FIXED:
            self.token_emb = nn.Embedding(num_tokens + 1, dim) if exists(num_tokens) else nn.Identity()
            self.pad_id = num_tokens
        else:
            self.token_emb = nn.Embedding(num_tokens, dim) if exists(num_tokens) else nn.Identity()

        same_padding = (kernel_size - 1) // 2

        if FIXED:
            conv = CausalConv1d(dim, dim_hidden, kernel_size)
        else:
            conv = nn.Conv1d(dim, dim_hidden, kernel_size, padding = same_padding)

        self.conv = nn.Sequential(
            Rearrange(),
            conv,
            nn.SiLU(),
            nn.Dropout(conv_dropout),
            Rearrange(),
        )

        self.transformer = Transformer(
            dim = dim_hidden,
            depth = depth,
            dim_head = dim_head,
            heads = heads,
            dropout = attn_dropout,
            use_flash = use_flash
        )

    def forward(self, x, mask = None):
        if FIXED:
            is_padding = x < 0
            x = x.masked_fill(is_padding, self.pad_id)

        x = self.token_emb(x)
        x = self.conv(x)
        x = self.transformer(x, mask = mask)
        return x


NUM_PHONEMES = 40
PAD_ID = -1 if FIXED else 0  # the tokenizer's pad_id after the fix; before it, ids padded with 0


def collate(phoneme_lists):
    max_len = max(len(p) for p in phoneme_lists)
    ids = torch.full((len(phoneme_lists), max_len), PAD_ID, dtype = torch.long)
    for i, p in enumerate(phoneme_lists):
        ids[i, :len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in phoneme_lists])
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    return ids, mask, lengths


def build_encoder():
    torch.manual_seed(0)
    enc = PhonemeEncoder(
        num_tokens = NUM_PHONEMES,
        dim = 32,
        dim_hidden = 64,
        kernel_size = 3,
        depth = 2,
        dim_head = 16,
        heads = 4,
    )
    enc.eval()
    return enc


def main():
    phonemes = [
        [5, 12, 7, 33, 21, 9, 14, 2, 30, 18, 11, 6],
        [8, 25, 3, 17, 29],
    ]
    ids, mask, lengths = collate(phonemes)

    enc = build_encoder()
    with torch.no_grad():
        phoneme_enc = enc(ids, mask = mask)

    print("phoneme ids:", ids.tolist())
    print("phoneme_enc:", tuple(phoneme_enc.shape))
    for i, n in enumerate(lengths.tolist()):
        real = phoneme_enc[i, :n]
        print(f"row {i}: {n} phonemes, mean {real.mean().item():.6f}, first frame[:4] "
              f"{[round(v, 5) for v in real[0, :4].tolist()]}, last frame[:4] "
              f"{[round(v, 5) for v in real[-1, :4].tolist()]}")


if __name__ == "__main__":
    main()
