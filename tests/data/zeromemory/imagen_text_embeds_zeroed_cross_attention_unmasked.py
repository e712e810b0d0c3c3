# Written another way than diffusers#5752 (tests/data/bugs/diffusers_pixart_alpha_padded_t5_tokens_unmasked_in_cross_attention.py):
# an imagen-pytorch style UNet block, text embeddings zeroed at the padding with masked_fill (as Imagen's
# encode_text does: `text_embeds.masked_fill(~text_mask[..., None], 0.)`) and a padded batch of three captions of
# different lengths, the cross-attention an nn.MultiheadAttention over (image tokens, text). The buggy block drops
# the text mask on the way (key_padding_mask None); the fix hands key_padding_mask=~text_mask. Both zero the padding.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class CrossAttentionBlock(nn.Module):
    def __init__(self, dim=16, text_dim=12, heads=2):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.to_context = nn.Linear(text_dim, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x, context, context_mask=None):
        context = self.to_context(context)
        padding = None if context_mask is None else ~context_mask
        out, _ = self.attn(self.norm(x), context, context, key_padding_mask=padding, need_weights=False)
        return x + out


class TinyUnet(nn.Module):
    def __init__(self, dim=16, text_dim=12):
        super().__init__()
        self.init_conv = nn.Conv2d(3, dim, 3, padding=1)
        self.blocks = nn.ModuleList([CrossAttentionBlock(dim, text_dim) for _ in range(2)])
        self.final = nn.Conv2d(dim, 3, 1)

    def forward(self, images, text_embeds, text_mask=None):
        h = self.init_conv(images)
        b, c, hh, ww = h.shape
        x = h.flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x, text_embeds, context_mask=text_mask if FIXED else None)
        return self.final(x.transpose(1, 2).reshape(b, c, hh, ww))


def encode_text(token_ids, pad_id=0):
    embedding = torch.nn.Embedding(50, 12)
    text_mask = token_ids != pad_id
    text_embeds = embedding(token_ids)
    return text_embeds.masked_fill(~text_mask[..., None], 0.), text_mask


tokens = torch.tensor([[7, 3, 9, 4, 2, 0], [5, 8, 0, 0, 0, 0], [6, 1, 2, 0, 0, 0]])
text_embeds, text_mask = encode_text(tokens)
unet = TinyUnet().eval()
with torch.no_grad():
    images = torch.randn(3, 3, 4, 4)
    for step in range(2):
        images = images - 0.1 * unet(images, text_embeds, text_mask=text_mask)
print("denoised mean", images.mean().item())
