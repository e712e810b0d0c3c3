"""open_clip CoCa TextTransformer: the appended CLS token's padding mask is shifted by one key.

Citation: mlfoundations/open_clip#549 ("build_cls_mask() in CoCa TextTransfotmer"); fixed in
commit 19ffcc5 ("An alternative text masking helper that offers a correct option for CoCa cls
mask ...", adds ``correct_cls_mask``). Read from the upstream git history
(src/open_clip/transformer.py before and after 19ffcc5).

Bug: CoCa appends the CLS embedding at the *end* of the text, but ``build_cls_mask`` padded the
key axis on the *left*: ``F.pad(cls_mask, (1, 0, L, 0), value=True)``. For the CLS query, key 0
is always allowed and key j is allowed iff token j-1 is not padding, so on a padded caption the
CLS token attends to the first pad token and cannot attend to itself (its own key reads the last
text slot, a pad).

Fix: ``_build_additive_mask`` with ``correct_cls_mask=True`` puts the always-valid CLS column at
the end (``cat([valid, cls_valid])``), and broadcasts the key mask over all queries. Existing
CoCa weights keep the legacy layout by default; this program turns the option on as --fixed.

This program: TextTransformer(embed_cls=True, pad_id=0) with the causal mask, a batch of two
right-padded captions (lengths 7 and 4 in a context of 8), mask passed as an additive
(B*heads, L, L) attn_mask to nn.MultiheadAttention, as open_clip's ResidualAttentionBlock does.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def _expand_token(token, batch_size: int):
    return token.view(1, 1, -1).expand(batch_size, -1, -1)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_head, batch_first=True)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def attention(self, q_x, attn_mask=None):
        attn_mask = attn_mask.to(q_x.dtype) if attn_mask is not None else None
        return self.attn(q_x, q_x, q_x, need_weights=False, attn_mask=attn_mask)[0]

    def forward(self, q_x, attn_mask=None):
        x = q_x + self.attention(self.ln_1(q_x), attn_mask=attn_mask)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, width, layers, heads):
        super().__init__()
        self.resblocks = nn.ModuleList(ResidualAttentionBlock(width, heads) for _ in range(layers))

    def forward(self, x, attn_mask=None):
        for r in self.resblocks:
            x = r(x, attn_mask=attn_mask)
        return x


class TextTransformer(nn.Module):
    def __init__(self, context_length=8, vocab_size=64, width=32, heads=4, layers=2, output_dim=16,
                 embed_cls=False, no_causal_mask=False, use_pad_mask=False, correct_cls_mask=False, pad_id=0):
        super().__init__()
        self.num_pos = self.context_length = context_length
        self.heads = heads
        self.pad_id = pad_id
        self.use_pad_mask = use_pad_mask and no_causal_mask
        self.correct_cls_mask = correct_cls_mask
        self.token_embedding = nn.Embedding(vocab_size, width)
        if embed_cls:
            self.cls_emb = nn.Parameter(torch.empty(width).normal_(std=0.02))
            self.num_pos += 1
        else:
            self.cls_emb = None
        self.positional_embedding = nn.Parameter(torch.empty(self.num_pos, width).normal_(std=0.01))
        self.transformer = Transformer(width, layers, heads)
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Linear(width, output_dim)
        if no_causal_mask:
            self.attn_mask = None
        else:
            self.register_buffer("attn_mask", self.build_causal_mask(), persistent=False)

    def build_causal_mask(self):
        # pytorch uses additive attention mask; fill with -inf
        mask = torch.empty(self.num_pos, self.num_pos)
        mask.fill_(float("-inf"))
        mask.triu_(1)  # zero out the lower diagonal
        return mask

    def build_cls_mask(self, text, cast_dtype: torch.dtype):
        cls_mask = (text != self.pad_id).unsqueeze(1)
        cls_mask = F.pad(cls_mask, (1, 0, cls_mask.shape[2], 0), value=True)
        additive_mask = torch.empty(cls_mask.shape, dtype=cast_dtype, device=cls_mask.device)
        additive_mask.fill_(0)
        additive_mask.masked_fill_(~cls_mask, float("-inf"))
        additive_mask = torch.repeat_interleave(additive_mask, self.heads, 0)
        return additive_mask

    def _build_additive_mask(self, text, seq_len: int, dtype: torch.dtype):
        valid = text != self.pad_id  # [B, L] (True = keep)
        if self.cls_emb is not None:
            cls_valid = valid.new_ones(valid.size(0), 1)
            # cls mask pos at end if correct or front for incorrect legacy mode in existing CoCa weights
            valid = torch.cat([valid, cls_valid] if self.correct_cls_mask else [cls_valid, valid], 1)
        key_mask = valid.unsqueeze(1).expand(-1, seq_len, -1)  # [B, Q, K]
        additive = torch.zeros_like(key_mask, dtype=dtype)
        additive.masked_fill_(~key_mask, float("-inf"))
        return additive.repeat_interleave(self.heads, 0)  # [B*H, Q, K]

    def _embeds(self, text):
        cast_dtype = self.token_embedding.weight.dtype
        seq_len = text.shape[1]
        x = self.token_embedding(text).to(cast_dtype)
        attn_mask = self.attn_mask
        if FIXED:
            if self.cls_emb is not None:
                x = torch.cat([x, _expand_token(self.cls_emb, x.size(0))], 1)
                seq_len += 1
            if self.use_pad_mask or self.cls_emb is not None:
                add_mask = self._build_additive_mask(text, seq_len, x.dtype)
                attn_mask = add_mask if attn_mask is None else attn_mask.unsqueeze(0) + add_mask
        elif self.cls_emb is not None:
            seq_len += 1
            x = torch.cat([x, _expand_token(self.cls_emb, x.shape[0])], dim=1)
            cls_mask = self.build_cls_mask(text, cast_dtype)
            if attn_mask is not None:
                attn_mask = attn_mask[None, :seq_len, :seq_len] + cls_mask[:, :seq_len, :seq_len]
        x = x + self.positional_embedding[:seq_len].to(cast_dtype)
        return x, attn_mask

    def forward(self, text):
        x, attn_mask = self._embeds(text)
        x = self.transformer(x, attn_mask=attn_mask)
        pooled = self.ln_final(x[:, -1])  # appended cls embed: always take last token
        return self.text_projection(pooled), x[:, :-1]


def main():
    torch.manual_seed(0)
    text_cfg = dict(context_length=8, embed_cls=True, pad_id=0)
    if FIXED:
        text_cfg["correct_cls_mask"] = True
    model = TextTransformer(**text_cfg).eval()
    text = torch.tensor([[5, 9, 3, 7, 2, 8, 4, 0],
                         [6, 1, 3, 2, 0, 0, 0, 0]])  # right-padded captions, pad_id 0
    with torch.no_grad():
        text_latent, token_emb = model(text)
    print(f"text_cfg {text_cfg} caption embedding norms {[round(v, 4) for v in text_latent.norm(dim=-1).tolist()]}")


if __name__ == "__main__":
    main()
