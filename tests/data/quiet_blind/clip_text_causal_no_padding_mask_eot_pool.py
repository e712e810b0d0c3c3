"""OpenAI CLIP text tower: causal float mask only, zero-padded batch, features read at the EOT token.

Follows openai/CLIP clip/model.py (CLIP.build_attention_mask, ResidualAttentionBlock.attention,
CLIP.encode_text). Captions are tokenized to context_length and padded with 0 after the EOT token
(the highest id). The text Transformer uses nn.MultiheadAttention with one additive float mask,
`torch.empty(n, n).fill_(-inf).triu_(1)`, and no key_padding_mask: because pads come after EOT and
attention is causal, no real token (EOT included) can see a pad, and encode_text reads only the EOT
position (`text.argmax(dim=-1)`). Pad rows are computed and thrown away.
Mask meant: plain causal (lower triangle incl. diagonal) over all context_length positions.
"""
from collections import OrderedDict

import torch
from torch import nn


class LayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d_model, n_head, attn_mask=None):
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, n_head)
        self.ln_1 = LayerNorm(d_model)
        self.mlp = nn.Sequential(OrderedDict([
            ("c_fc", nn.Linear(d_model, d_model * 4)),
            ("gelu", QuickGELU()),
            ("c_proj", nn.Linear(d_model * 4, d_model)),
        ]))
        self.ln_2 = LayerNorm(d_model)
        self.attn_mask = attn_mask

    def attention(self, x):
        self.attn_mask = self.attn_mask.to(dtype=x.dtype, device=x.device) if self.attn_mask is not None else None
        return self.attn(x, x, x, need_weights=False, attn_mask=self.attn_mask)[0]

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class Transformer(nn.Module):
    def __init__(self, width, layers, heads, attn_mask=None):
        super().__init__()
        self.resblocks = nn.Sequential(*[ResidualAttentionBlock(width, heads, attn_mask) for _ in range(layers)])

    def forward(self, x):
        return self.resblocks(x)


class CLIPText(nn.Module):
    def __init__(self, embed_dim, context_length, vocab_size, transformer_width, transformer_heads,
                 transformer_layers):
        super().__init__()
        self.context_length = context_length
        self.transformer = Transformer(width=transformer_width, layers=transformer_layers,
                                       heads=transformer_heads, attn_mask=self.build_attention_mask())
        self.token_embedding = nn.Embedding(vocab_size, transformer_width)
        self.positional_embedding = nn.Parameter(torch.randn(context_length, transformer_width) * 0.01)
        self.ln_final = LayerNorm(transformer_width)
        self.text_projection = nn.Parameter(torch.randn(transformer_width, embed_dim) * transformer_width ** -0.5)

    def build_attention_mask(self):
        # causal mask built once for context_length; padding needs no mask (see module docstring)
        # pytorch uses additive attention mask; fill with -inf
        mask = torch.empty(self.context_length, self.context_length)
        mask.fill_(float("-inf"))
        mask.triu_(1)  # zero out the lower diagonal
        return mask

    def encode_text(self, text):
        x = self.token_embedding(text)
        x = x + self.positional_embedding
        x = x.permute(1, 0, 2)  # NLD -> LND
        x = self.transformer(x)
        x = x.permute(1, 0, 2)  # LND -> NLD
        x = self.ln_final(x)
        # take features from the eot embedding (eot_token is the highest number in each sequence)
        return x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ self.text_projection


def tokenize(token_lists, context_length, sot, eot):
    result = torch.zeros(len(token_lists), context_length, dtype=torch.long)
    for i, toks in enumerate(token_lists):
        ids = [sot] + toks + [eot]
        result[i, :len(ids)] = torch.tensor(ids)
    return result


if __name__ == "__main__":
    torch.manual_seed(0)
    vocab_size, sot, eot = 500, 498, 499
    model = CLIPText(embed_dim=32, context_length=12, vocab_size=vocab_size, transformer_width=64,
                     transformer_heads=4, transformer_layers=2).eval()
    text = tokenize([[10, 42, 7], [300, 5, 6, 77, 81, 9, 120], [1]], 12, sot, eot)
    with torch.no_grad():
        feats = model.encode_text(text)
    print("text features", tuple(feats.shape), "eot at", text.argmax(dim=-1).tolist())
