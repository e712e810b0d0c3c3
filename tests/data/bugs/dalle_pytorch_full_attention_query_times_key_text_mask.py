# lucidrains/DALLE-pytorch commit 9bf1f0f ("fix mask for full attention so that last text token can actually
# predict the first image token"), dalle_pytorch/attention.py Attention.forward: the text padding mask was applied
# as the outer product mask[:, None, :, None] * mask[:, None, None, :], so every padded query row was filled with
# the mask value; the causal fill then used the same value, leaving those rows uniform over the whole sequence.
# The fix applies the mask to the key axis only: rearrange(mask, 'b j -> b () () j').
# DALLE.forward as the project wrote it: text padded with 0, <bos> = 0 prepended, mask padded True for <bos> and
# the image tokens, the last token dropped, logits masked so text predicts text and image predicts image.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def is_empty(t):
    return t.nelement() == 0


def max_neg_value(t):
    return -torch.finfo(t.dtype).max


class Attention(nn.Module):
    def __init__(self, dim, seq_len, causal=True, heads=8, dim_head=64, dropout=0.):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.seq_len = seq_len
        self.scale = dim_head ** -0.5
        self.causal = causal
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim), nn.Dropout(dropout))

    def forward(self, x, mask=None):
        b, n, _, h, device = *x.shape, self.heads, x.device
        qkv = self.to_qkv(x).chunk(3, dim=-1)
        # rearrange(t, 'b n (h d) -> b h n d', h=h)
        q, k, v = map(lambda t: t.reshape(b, n, h, -1).transpose(1, 2), qkv)

        dots = torch.einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        mask_value = max_neg_value(dots)

        if exists(mask):
            if FIXED:
                mask = mask[:, None, None, :]  # rearrange(mask, 'b j -> b () () j')
            else:
                # rearrange(mask, 'b i -> b () i ()') * rearrange(mask, 'b j -> b () () j')
                mask = mask[:, None, :, None] * mask[:, None, None, :]
            dots.masked_fill_(~mask, mask_value)
            del mask

        if self.causal:
            i, j = dots.shape[-2:]
            mask = torch.ones(i, j, device=device).triu_(j - i + 1).bool()
            dots.masked_fill_(mask, mask_value)

        attn = dots.softmax(dim=-1)
        out = torch.einsum('b h i j, b h j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)  # rearrange(out, 'b h n d -> b n (h d)')
        return self.to_out(out)


class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


class GEGLU(nn.Module):
    def forward(self, x):
        x, gates = x.chunk(2, dim=-1)
        return x * F.gelu(gates)


class FeedForward(nn.Module):
    def __init__(self, dim, dropout=0., mult=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult * 2), GEGLU(), nn.Dropout(dropout),
                                 nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class Transformer(nn.Module):
    """dalle_pytorch/transformer.py with attn_types=('full',), run as SequentialSequence (mask routed to attn)."""

    def __init__(self, *, dim, depth, seq_len, causal=True, heads=8, dim_head=64, ff_mult=4):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleList([
            PreNorm(dim, Attention(dim, causal=causal, seq_len=seq_len, heads=heads, dim_head=dim_head)),
            PreNorm(dim, FeedForward(dim, mult=ff_mult)),
        ]) for _ in range(depth)])

    def forward(self, x, mask=None):
        for f, g in self.layers:
            x = x + f(x, mask=mask)
            x = x + g(x)
        return x


class AxialPositionalEmbedding(nn.Module):
    """axial_positional_embedding.AxialPositionalEmbedding (summed axial embeddings), 2 axes."""

    def __init__(self, dim, axial_shape):
        super().__init__()
        self.axial_shape = axial_shape
        self.w0 = nn.Parameter(torch.zeros(1, axial_shape[0], 1, dim).normal_(0, 1))
        self.w1 = nn.Parameter(torch.zeros(1, 1, axial_shape[1], dim).normal_(0, 1))

    def forward(self, x):
        b, t, e = x.shape
        emb = (self.w0 + self.w1).reshape(1, -1, e)
        return emb[:, :t].expand(b, -1, -1)


class DiscreteVAE(nn.Module):
    """Only the attributes DALLE reads; images are given as codebook indices."""

    def __init__(self, image_size=8, num_tokens=16, num_layers=2):
        super().__init__()
        self.image_size = image_size
        self.num_tokens = num_tokens
        self.num_layers = num_layers


class DALLE(nn.Module):
    def __init__(self, *, dim, vae, num_text_tokens=10000, text_seq_len=256, depth, heads=8, dim_head=64,
                 ignore_index=-100):
        super().__init__()
        image_size = vae.image_size
        num_image_tokens = vae.num_tokens
        image_fmap_size = (vae.image_size // (2 ** vae.num_layers))
        image_seq_len = image_fmap_size ** 2

        self.text_emb = nn.Embedding(num_text_tokens, dim)
        self.image_emb = nn.Embedding(num_image_tokens, dim)
        self.text_pos_emb = nn.Embedding(text_seq_len + 1, dim)  # +1 for <bos>
        self.image_pos_emb = AxialPositionalEmbedding(dim, axial_shape=(image_size, image_size))

        self.num_text_tokens = num_text_tokens
        self.num_image_tokens = num_image_tokens
        self.text_seq_len = text_seq_len
        self.image_seq_len = image_seq_len

        seq_len = text_seq_len + image_seq_len
        total_tokens = num_text_tokens + num_image_tokens
        self.total_tokens = total_tokens
        self.total_seq_len = seq_len
        self.vae = vae

        self.transformer = Transformer(dim=dim, causal=True, seq_len=seq_len, depth=depth, heads=heads,
                                       dim_head=dim_head)
        self.to_logits = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, self.total_tokens))

        seq_range = torch.arange(seq_len)
        logits_range = torch.arange(total_tokens)
        seq_range = seq_range[None, :, None]  # rearrange(seq_range, 'n -> () n ()')
        logits_range = logits_range[None, None, :]  # rearrange(logits_range, 'd -> () () d')
        logits_mask = (
            ((seq_range >= text_seq_len) & (logits_range < num_text_tokens)) |
            ((seq_range < text_seq_len) & (logits_range >= num_text_tokens))
        )
        self.register_buffer('logits_mask', logits_mask)
        self.ignore_index = ignore_index

    def forward(self, text, image=None, mask=None, return_loss=False):
        device, ignore_index, total_seq_len = text.device, self.ignore_index, self.total_seq_len

        text = F.pad(text, (1, 0), value=0)  # use padding as <bos>
        if exists(mask):
            mask = F.pad(mask, (1, 0), value=True)

        tokens = self.text_emb(text)
        tokens += self.text_pos_emb(torch.arange(text.shape[1], device=device))
        seq_len = tokens.shape[1]

        if exists(image) and not is_empty(image):
            image_len = image.shape[1]
            image_emb = self.image_emb(image)
            image_emb += self.image_pos_emb(image_emb)
            tokens = torch.cat((tokens, image_emb), dim=1)
            seq_len += image_len
            if exists(mask):
                mask = F.pad(mask, (0, image_emb.shape[1]), value=True)

        # when training, if the length exceeds the total text + image length
        # remove the last token, since it needs not to be trained
        if tokens.shape[1] > total_seq_len:
            seq_len -= 1
            tokens = tokens[:, :-1]
            if exists(mask):
                mask = mask[:, :-1]

        out = self.transformer(tokens, mask=mask)
        logits = self.to_logits(out)

        logits_mask = self.logits_mask[:, :seq_len]
        max_neg_value = -torch.finfo(logits.dtype).max
        logits.masked_fill_(logits_mask, max_neg_value)

        if not return_loss:
            return logits

        offsetted_image = image + self.num_text_tokens
        labels = torch.cat((text[:, 1:], offsetted_image), dim=1)
        loss = F.cross_entropy(logits.transpose(1, 2), labels)  # rearrange(logits, 'b n c -> b c n')
        return loss


def main():
    vae = DiscreteVAE(image_size=8, num_tokens=16, num_layers=2)
    dalle = DALLE(dim=32, vae=vae, num_text_tokens=20, text_seq_len=6, depth=2, heads=2, dim_head=16)
    dalle.eval()

    # README usage: text = torch.randint(0, 10000, (4, 256)); mask = torch.ones_like(text).bool()
    # here the captions are padded with 0 and the mask is text != 0
    text = torch.tensor([[3, 7, 5, 9, 11, 2],
                         [4, 8, 6, 0, 0, 0]])
    mask = text != 0
    image = torch.randint(0, vae.num_tokens, (2, dalle.image_seq_len))

    with torch.no_grad():
        loss = dalle(text, image, mask=mask, return_loss=True)
        logits = dalle(text, image, mask=mask)
    first_image_logits = logits[:, dalle.text_seq_len, dalle.num_text_tokens:]
    print("loss", round(loss.item(), 6))
    print("first image token prediction per caption", first_image_logits.argmax(-1).tolist())
    print("row 1 first image logits[:4]", [round(v, 5) for v in first_image_logits[1, :4].tolist()])


if __name__ == "__main__":
    main()
