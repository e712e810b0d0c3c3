# lucidrains/DALLE-pytorch commit 9bf1f0f ("fix mask for full attention so that last text token can actually
# predict the first image token"), reported in lucidrains/DALLE-pytorch#39. dalle_pytorch/attention.py Attention:
# the text padding mask was applied as an outer product over queries and keys, so every padded text position got a
# fully masked row. Filled with max_neg_value, then the causal fill wrote the same value, so that row became a
# uniform average over the whole text + image sequence, future image tokens included. The last text position
# (a pad for any caption shorter than text_seq_len) is the one whose logits predict the first image token.
# Fix: the mask is applied over keys only, `rearrange(mask, 'b j -> b () () j')`.
# einops rearranges are written with torch ops; AxialPositionalEmbedding is a small stand-in for the package.
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# helpers

def exists(val):
    return val is not None

def max_neg_value(t):
    return -torch.finfo(t.dtype).max

def is_empty(t):
    return t.nelement() == 0

# classes

class Attention(nn.Module):
    def __init__(self, dim, seq_len, causal = True, heads = 8, dim_head = 64, dropout = 0.):
        super().__init__()
        inner_dim = dim_head *  heads
        self.heads = heads
        self.seq_len = seq_len
        self.scale = dim_head ** -0.5

        self.causal = causal

        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias = False)
        self.to_out = nn.Sequential(
            nn.Linear(inner_dim, dim),
            nn.Dropout(dropout)
        )

    def forward(self, x, mask = None):
        b, n, _, h, device = *x.shape, self.heads, x.device
        qkv = self.to_qkv(x).chunk(3, dim = -1)
        # rearrange(t, 'b n (h d) -> b h n d', h = h)
        q, k, v = map(lambda t: t.reshape(b, n, h, -1).transpose(1, 2), qkv)

        dots = torch.einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        mask_value = max_neg_value(dots)

        if exists(mask):
            if FIXED:
                mask = mask[:, None, None, :]                          # 'b j -> b () () j'
            else:
                mask = mask[:, None, :, None] * mask[:, None, None, :]  # 'b i -> b () i ()' * 'b j -> b () () j'
            dots.masked_fill_(~mask, mask_value)
            del mask

        if self.causal:
            i, j = dots.shape[-2:]
            mask = torch.ones(i, j, device = device).triu_(j - i + 1).bool()
            dots.masked_fill_(mask, mask_value)

        attn = dots.softmax(dim=-1)

        out = torch.einsum('b h i j, b h j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)  # 'b h n d -> b n (h d)'
        out =  self.to_out(out)
        return out

class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)

class GEGLU(nn.Module):
    def forward(self, x):
        x, gates = x.chunk(2, dim = -1)
        return x * F.gelu(gates)

class FeedForward(nn.Module):
    def __init__(self, dim, dropout = 0., mult = 4):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, dim * mult * 2),
            GEGLU(),
            nn.Dropout(dropout),
            nn.Linear(dim * mult, dim)
        )

    def forward(self, x):
        return self.net(x)

class SequentialSequence(nn.Module):
    # reversible.py: args_route = {'mask': ((True, False),) * depth}, i.e. the mask goes to attention only
    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x, mask = None):
        for f, g in self.layers:
            x = x + f(x, mask = mask)
            x = x + g(x)
        return x

class Transformer(nn.Module):
    def __init__(self, *, dim, depth, seq_len, causal = True, heads = 8, dim_head = 64, ff_mult = 4,
                 attn_dropout = 0., ff_dropout = 0.):
        super().__init__()
        layers = nn.ModuleList([])
        for _ in range(depth):
            attn_class = Attention  # attn_types = ('full',)
            layers.append(nn.ModuleList([
                PreNorm(dim, attn_class(dim, causal = causal, seq_len = seq_len, heads = heads, dim_head = dim_head, dropout = attn_dropout)),
                PreNorm(dim, FeedForward(dim, mult = ff_mult, dropout = ff_dropout))
            ]))
        self.layers = SequentialSequence(layers)

    def forward(self, x, **kwargs):
        return self.layers(x, **kwargs)

class AxialPositionalEmbedding(nn.Module):
    def __init__(self, dim, axial_shape):
        super().__init__()
        h, w = axial_shape
        self.row = nn.Parameter(torch.randn(1, h, 1, dim) * 0.02)
        self.col = nn.Parameter(torch.randn(1, 1, w, dim) * 0.02)

    def forward(self, x):
        b, n, _ = x.shape
        emb = (self.row + self.col).reshape(1, -1, x.shape[-1])
        return emb[:, :n].expand(b, -1, -1)

class DALLE(nn.Module):
    def __init__(self, *, dim, image_size, num_layers, num_image_tokens, num_text_tokens = 10000,
                 text_seq_len = 256, depth, heads = 8, dim_head = 64, attn_dropout = 0., ff_dropout = 0):
        super().__init__()
        image_fmap_size = (image_size // (2 ** num_layers))  # from the DiscreteVAE
        image_seq_len = image_fmap_size ** 2

        self.text_emb = nn.Embedding(num_text_tokens, dim)
        self.image_emb = nn.Embedding(num_image_tokens, dim)

        self.text_pos_emb = nn.Embedding(text_seq_len + 1, dim) # +1 for <bos>
        self.image_pos_emb = AxialPositionalEmbedding(dim, axial_shape = (image_size, image_size))

        self.num_text_tokens = num_text_tokens
        self.num_image_tokens = num_image_tokens

        self.text_seq_len = text_seq_len
        self.image_seq_len = image_seq_len

        seq_len = text_seq_len + image_seq_len
        total_tokens = num_text_tokens + num_image_tokens
        self.total_tokens = total_tokens
        self.total_seq_len = seq_len

        self.transformer = Transformer(dim = dim, causal = True, seq_len = seq_len, depth = depth, heads = heads,
                                       dim_head = dim_head, attn_dropout = attn_dropout, ff_dropout = ff_dropout)

        self.to_logits = nn.Sequential(
            nn.LayerNorm(dim),
            nn.Linear(dim, self.total_tokens),
        )

        seq_range = torch.arange(seq_len)[None, :, None]          # 'n -> () n ()'
        logits_range = torch.arange(total_tokens)[None, None, :]  # 'd -> () () d'

        logits_mask = (
            ((seq_range >= text_seq_len) & (logits_range < num_text_tokens)) |
            ((seq_range < text_seq_len) & (logits_range >= num_text_tokens))
        )

        self.register_buffer('logits_mask', logits_mask)

    def forward(self, text, image = None, mask = None, return_loss = False):
        device, total_seq_len = text.device, self.total_seq_len

        text = F.pad(text, (1, 0), value = 0) # use padding as <bos>

        if exists(mask):
            mask = F.pad(mask, (1, 0), value = True)

        tokens = self.text_emb(text)
        tokens += self.text_pos_emb(torch.arange(text.shape[1], device = device))

        seq_len = tokens.shape[1]

        if exists(image) and not is_empty(image):
            image_len = image.shape[1]
            image_emb = self.image_emb(image)
            image_emb += self.image_pos_emb(image_emb)

            tokens = torch.cat((tokens, image_emb), dim = 1)

            seq_len += image_len
            if exists(mask):
                mask = F.pad(mask, (0, image_emb.shape[1]), value = True)

        # when training, if the length exceeds the total text + image length
        # remove the last token, since it needs not to be trained
        if tokens.shape[1] > total_seq_len:
            seq_len -= 1
            tokens = tokens[:, :-1]

            if exists(mask):
                mask = mask[:, :-1]

        out = self.transformer(tokens, mask = mask)
        logits = self.to_logits(out)

        # mask logits to make sure text predicts text (except last token), and image predicts image
        logits_mask = self.logits_mask[:, :seq_len]
        max_neg_value = -torch.finfo(logits.dtype).max
        logits.masked_fill_(logits_mask, max_neg_value)

        if not return_loss:
            return logits

        assert exists(image), 'when training, image must be supplied'
        offsetted_image = image + self.num_text_tokens
        labels = torch.cat((text[:, 1:], offsetted_image), dim = 1)

        loss = F.cross_entropy(logits.transpose(1, 2), labels)  # 'b n c -> b c n'
        return loss, logits


def main():
    text_seq_len = 8
    dalle = DALLE(dim = 32, image_size = 16, num_layers = 2, num_image_tokens = 24, num_text_tokens = 40,
                  text_seq_len = text_seq_len, depth = 2, heads = 4, dim_head = 8).eval()

    # captions right-padded with 0 up to text_seq_len; mask True on real tokens
    lengths = [8, 5]
    text = torch.zeros(2, text_seq_len, dtype = torch.long)
    for b, n in enumerate(lengths):
        text[b, :n] = torch.randint(1, 40, (n,))
    mask = torch.arange(text_seq_len)[None, :] < torch.tensor(lengths)[:, None]
    image = torch.randint(0, 24, (2, 16))  # vae.get_codebook_indices(images), 4 x 4 feature map

    with torch.no_grad():
        loss, logits = dalle(text, image, mask = mask, return_loss = True)
        first_image_logits = logits[:, text_seq_len, dalle.num_text_tokens:]  # predicts image token 0
    print("loss:", round(loss.item(), 5))
    print("first image token argmax per caption:", first_image_logits.argmax(-1).tolist())
    print("first image token logits (short caption)[:5]:", [round(v, 4) for v in first_image_logits[1, :5].tolist()])


if __name__ == "__main__":
    main()
