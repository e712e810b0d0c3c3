"""open_clip CoCa: the captioning decoder is trained on labels it can already see.

Citation: mlfoundations/open_clip#715 ("coca training doesn't work"), fixed by PR #710
(commit 7079e7e, "fix coca training"), merged with PR #877 ("Tweaks to CoCa training fix").
Read from the upstream git history: src/open_clip/coca_model.py, transformer.py and loss.py
at 7079e7e^ and at 7079e7e.

Bug: after commit ae8333f removed the ``embed_cls`` slicing (``text[:, :-1]``) from
``CoCa._encode_text``, the unimodal text tower returns one token embedding per input token,
and ``CoCa.forward`` builds ``labels = text[:, -token_embs.shape[1]:]``, i.e. the labels are
the input tokens themselves. The multimodal text decoder (``MultimodalTransformer``) runs its
causal self-attention over those token embeddings, and the causal mask lets position i attend
to key i, so the caption loss asks position i to predict the token it is attending to.

Fix: ``labels = text[:, 1:]`` and, while training, ``token_embs = token_embs[:, :-1]`` (the
usual one-step shift, so position i predicts token i+1 from tokens <= i); ``generate`` passes
``is_training=False`` (later renamed ``output_labels``).

This program: CoCa with a tiny TextTransformer (embed_cls=True, pad_id=0, causal mask plus the
CLS/padding mask), a tiny MultimodalTransformer decoder (causal self-attention and
cross-attention to image tokens, sequence-first nn.MultiheadAttention with additive masks, as
open_clip wrote it), CoCaLoss, and a few optimizer steps on a right-padded batch of captions.
The vision tower is a stub that returns (pooled latent, patch tokens).
"""
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class CLIPTextCfg:
    context_length: int = 77
    vocab_size: int = 49408
    width: int = 512
    heads: int = 8
    layers: int = 12
    mlp_ratio: float = 4.0
    ls_init_value: Optional[float] = None
    embed_cls: bool = False
    pad_id: int = 0
    output_tokens: bool = False


@dataclass
class MultimodalCfg(CLIPTextCfg):
    mlp_ratio: int = 4
    dim_head: int = 64
    heads: int = 8
    n_queries: int = 256
    attn_pooler_heads: int = 8


class LayerNorm(nn.LayerNorm):
    """Subclass torch's LayerNorm (with cast back to input dtype)."""

    def forward(self, x: torch.Tensor):
        orig_type = x.dtype
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.to(orig_type)


class ResidualAttentionBlock(nn.Module):
    def __init__(
            self,
            d_model: int,
            n_head: int,
            mlp_ratio: float = 4.0,
            act_layer: Callable = nn.GELU,
            norm_layer: Callable = LayerNorm,
            is_cross_attention: bool = False,
    ):
        super().__init__()

        self.ln_1 = norm_layer(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_head)
        if is_cross_attention:
            self.ln_1_kv = norm_layer(d_model)

        self.ln_2 = norm_layer(d_model)
        mlp_width = int(d_model * mlp_ratio)
        self.mlp = nn.Sequential(OrderedDict([
            ("c_fc", nn.Linear(d_model, mlp_width)),
            ("gelu", act_layer()),
            ("c_proj", nn.Linear(mlp_width, d_model))
        ]))

    def attention(self, q_x, k_x=None, v_x=None, attn_mask=None):
        k_x = k_x if k_x is not None else q_x
        v_x = v_x if v_x is not None else q_x

        attn_mask = attn_mask.to(q_x.dtype) if attn_mask is not None else None
        return self.attn(
            q_x, k_x, v_x, need_weights=False, attn_mask=attn_mask
        )[0]

    def forward(self, q_x, k_x=None, v_x=None, attn_mask=None):
        k_x = self.ln_1_kv(k_x) if hasattr(self, "ln_1_kv") and k_x is not None else None
        v_x = self.ln_1_kv(v_x) if hasattr(self, "ln_1_kv") and v_x is not None else None

        x = q_x + self.attention(q_x=self.ln_1(q_x), k_x=k_x, v_x=v_x, attn_mask=attn_mask)
        x = x + self.mlp(self.ln_2(x))
        return x


def _expand_token(token, batch_size: int):
    return token.view(1, 1, -1).expand(batch_size, -1, -1)


class Transformer(nn.Module):
    def __init__(self, width, layers, heads, mlp_ratio=4.0, act_layer=nn.GELU, norm_layer=LayerNorm):
        super().__init__()
        self.width = width
        self.layers = layers
        self.resblocks = nn.ModuleList([
            ResidualAttentionBlock(width, heads, mlp_ratio, act_layer=act_layer, norm_layer=norm_layer)
            for _ in range(layers)
        ])

    def get_cast_dtype(self) -> torch.dtype:
        return self.resblocks[0].mlp.c_fc.weight.dtype

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None):
        for r in self.resblocks:
            x = r(x, attn_mask=attn_mask)
        return x


def text_global_pool(x, text=None, pool_type='argmax'):
    if pool_type == 'first':
        pooled, tokens = x[:, 0], x[:, 1:]
    elif pool_type == 'last':
        pooled, tokens = x[:, -1], x[:, :-1]
    elif pool_type == 'argmax':
        pooled, tokens = x[torch.arange(x.shape[0]), text.argmax(dim=-1)], x
    else:
        pooled = tokens = x
    return pooled, tokens


class TextTransformer(nn.Module):
    def __init__(self, context_length=77, vocab_size=49408, width=512, heads=8, layers=12,
                 mlp_ratio=4.0, output_dim=512, embed_cls=False, pad_id=0, pool_type='argmax',
                 output_tokens=False):
        super().__init__()
        self.output_tokens = output_tokens
        self.num_pos = self.context_length = context_length
        self.vocab_size = vocab_size
        self.width = width
        self.heads = heads
        self.pad_id = pad_id
        self.pool_type = pool_type

        self.token_embedding = nn.Embedding(vocab_size, width)
        if embed_cls:
            self.cls_emb = nn.Parameter(torch.empty(width))
            self.num_pos += 1
        else:
            self.cls_emb = None
        self.positional_embedding = nn.Parameter(torch.empty(self.num_pos, width))
        self.transformer = Transformer(width=width, layers=layers, heads=heads, mlp_ratio=mlp_ratio)
        self.ln_final = LayerNorm(width)
        self.register_buffer('attn_mask', self.build_causal_mask(), persistent=False)
        self.text_projection = nn.Parameter(torch.empty(width, output_dim))

        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        if self.cls_emb is not None:
            nn.init.normal_(self.cls_emb, std=0.01)
        nn.init.normal_(self.text_projection, std=width ** -0.5)

    def build_causal_mask(self):
        # lazily create causal attention mask, with full attention between the tokens
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

    def forward(self, text):
        cast_dtype = self.transformer.get_cast_dtype()
        seq_len = text.shape[1]

        x = self.token_embedding(text).to(cast_dtype)  # [batch_size, n_ctx, d_model]
        attn_mask = self.attn_mask
        if self.cls_emb is not None:
            seq_len += 1
            x = torch.cat([x, _expand_token(self.cls_emb, x.shape[0])], dim=1)
            cls_mask = self.build_cls_mask(text, cast_dtype)
            if attn_mask is not None:
                attn_mask = attn_mask[None, :seq_len, :seq_len] + cls_mask[:, :seq_len, :seq_len]

        x = x + self.positional_embedding[:seq_len].to(cast_dtype)
        x = x.permute(1, 0, 2)  # NLD -> LND
        x = self.transformer(x, attn_mask=attn_mask)
        x = x.permute(1, 0, 2)  # LND -> NLD

        if self.cls_emb is not None:
            # presence of appended cls embed (CoCa) overrides pool_type, always take last token
            pooled, tokens = text_global_pool(x, pool_type='last')
            pooled = self.ln_final(pooled)  # final LN applied after pooling in this case
        else:
            x = self.ln_final(x)
            pooled, tokens = text_global_pool(x, text, pool_type=self.pool_type)

        pooled = pooled @ self.text_projection

        if self.output_tokens:
            return pooled, tokens
        return pooled


class MultimodalTransformer(Transformer):
    def __init__(self, width, layers, heads, context_length=77, mlp_ratio=4.0, output_dim=512):
        super().__init__(width=width, layers=layers, heads=heads, mlp_ratio=mlp_ratio)
        self.context_length = context_length
        self.cross_attn = nn.ModuleList([
            ResidualAttentionBlock(width, heads, mlp_ratio, is_cross_attention=True)
            for _ in range(layers)
        ])

        self.register_buffer('attn_mask', self.build_attention_mask(), persistent=False)

        self.ln_final = LayerNorm(width)
        self.text_projection = nn.Parameter(torch.empty(width, output_dim))
        nn.init.normal_(self.text_projection, std=width ** -0.5)

    def build_attention_mask(self):
        # lazily create causal attention mask, with full attention between the tokens
        # pytorch uses additive attention mask; fill with -inf
        mask = torch.empty(self.context_length, self.context_length)
        mask.fill_(float("-inf"))
        mask.triu_(1)  # zero out the lower diagonal
        return mask

    def forward(self, image_embs, text_embs):
        text_embs = text_embs.permute(1, 0, 2)  # NLD -> LND
        image_embs = image_embs.permute(1, 0, 2)  # NLD -> LND
        seq_len = text_embs.shape[0]

        for resblock, cross_attn in zip(self.resblocks, self.cross_attn):
            text_embs = resblock(text_embs, attn_mask=self.attn_mask[:seq_len, :seq_len])
            text_embs = cross_attn(text_embs, k_x=image_embs, v_x=image_embs)

        x = text_embs.permute(1, 0, 2)  # LND -> NLD
        x = self.ln_final(x)
        x = x @ self.text_projection
        return x


class VisionTowerStub(nn.Module):
    """Stands in for open_clip's VisionTransformer(attentional_pool=True, output_tokens=True):
    returns (pooled latent, image tokens)."""

    def __init__(self, patch_dim, width, output_dim, n_tokens):
        super().__init__()
        self.n_tokens = n_tokens
        self.proj = nn.Linear(patch_dim, width)
        self.pool_proj = nn.Linear(width, output_dim)

    def forward(self, images):
        B = images.shape[0]
        patches = images.reshape(B, self.n_tokens, -1)
        tokens = self.proj(patches)
        return self.pool_proj(tokens.mean(dim=1)), tokens


class CoCa(nn.Module):
    def __init__(self, embed_dim, multimodal_cfg, text_cfg, patch_dim, n_image_tokens,
                 init_logit_scale: float = np.log(1 / 0.07), pad_id: int = 0):
        super().__init__()
        multimodal_cfg = MultimodalCfg(**multimodal_cfg) if isinstance(multimodal_cfg, dict) else multimodal_cfg
        text_cfg = CLIPTextCfg(**text_cfg) if isinstance(text_cfg, dict) else text_cfg

        self.text = TextTransformer(
            context_length=text_cfg.context_length,
            vocab_size=text_cfg.vocab_size,
            width=text_cfg.width,
            heads=text_cfg.heads,
            layers=text_cfg.layers,
            output_dim=embed_dim,
            embed_cls=text_cfg.embed_cls,
            pad_id=text_cfg.pad_id,
            output_tokens=text_cfg.output_tokens,
        )
        vocab_size = text_cfg.vocab_size
        self.visual = VisionTowerStub(patch_dim, multimodal_cfg.width, embed_dim, n_image_tokens)
        self.text_decoder = MultimodalTransformer(
            context_length=multimodal_cfg.context_length,
            width=multimodal_cfg.width,
            heads=multimodal_cfg.heads,
            layers=multimodal_cfg.layers,
            output_dim=vocab_size,
        )
        self.logit_scale = nn.Parameter(torch.ones([]) * init_logit_scale)
        self.pad_id = pad_id
        self.context_length = multimodal_cfg.context_length

    def _encode_image(self, images, normalize: bool = True):
        image_latent, tokens_embs = self.visual(images)
        image_latent = F.normalize(image_latent, dim=-1) if normalize else image_latent
        return image_latent, tokens_embs

    def _encode_text(self, text, normalize: bool = True):
        text_latent, token_emb = self.text(text)
        text_latent = F.normalize(text_latent, dim=-1) if normalize else text_latent
        return text_latent, token_emb

    def forward(self, image, text=None, image_latent=None, image_embs=None, is_training=True):
        if image_latent is None or image_embs is None:
            image_latent, image_embs = self._encode_image(image)

        if text is None:
            return {"image_features": image_latent, "image_embs": image_embs}

        text_latent, token_embs = self._encode_text(text)

        if FIXED:
            labels = text[:, 1:]
            if is_training:
                token_embs = token_embs[:, :-1]
        else:
            # TODO: add assertion to avoid bugs?
            labels = text[:, -token_embs.shape[1]:]

        logits = self.text_decoder(image_embs, token_embs)
        return {
            "image_features": image_latent,
            "text_features": text_latent,
            "logits": logits,
            "labels": labels,
            "logit_scale": self.logit_scale.exp(),
        }


class CoCaLoss(nn.Module):
    def __init__(self, caption_loss_weight, clip_loss_weight, pad_id=0):
        super().__init__()
        self.clip_loss_weight = clip_loss_weight
        self.caption_loss_weight = caption_loss_weight
        self.caption_loss = nn.CrossEntropyLoss(ignore_index=pad_id)

    def forward(self, image_features, text_features, logits, labels, logit_scale, output_dict=False):
        clip_loss = torch.tensor(0)
        if self.clip_loss_weight:
            logits_per_image = logit_scale * image_features @ text_features.T
            logits_per_text = logit_scale * text_features @ image_features.T
            gt = torch.arange(logits_per_image.shape[0])
            clip_loss = (F.cross_entropy(logits_per_image, gt) + F.cross_entropy(logits_per_text, gt)) / 2
            clip_loss = self.clip_loss_weight * clip_loss

        caption_loss = self.caption_loss(logits.permute(0, 2, 1), labels)
        caption_loss = caption_loss * self.caption_loss_weight

        if output_dict:
            return {"contrastive_loss": clip_loss, "caption_loss": caption_loss}
        return clip_loss, caption_loss


def tokenize(captions, context_length, sot_token=62, eot_token=63):
    # open_clip's tokenizer layout: [sot, ..., eot] right-padded with 0
    result = torch.zeros(len(captions), context_length, dtype=torch.long)
    for i, toks in enumerate(captions):
        toks = [sot_token] + list(toks) + [eot_token]
        result[i, :len(toks)] = torch.tensor(toks[:context_length])
    return result


def main():
    torch.manual_seed(0)
    context_length = 8
    text_cfg = dict(context_length=context_length, vocab_size=64, width=32, heads=4, layers=2,
                    embed_cls=True, pad_id=0, output_tokens=True)
    multimodal_cfg = dict(context_length=context_length, vocab_size=64, width=32, heads=4, layers=2)
    n_image_tokens, patch_dim = 4, 12
    model = CoCa(embed_dim=16, multimodal_cfg=multimodal_cfg, text_cfg=text_cfg,
                 patch_dim=patch_dim, n_image_tokens=n_image_tokens, pad_id=0)
    loss_fn = CoCaLoss(caption_loss_weight=2.0, clip_loss_weight=1.0, pad_id=0)

    captions = [[5, 9, 17, 23, 4], [11, 30], [7, 7, 40, 2]]
    text = tokenize(captions, context_length)
    images = torch.randn(len(captions), n_image_tokens * patch_dim)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(15):
        out = model(images, text)
        losses = loss_fn(out["image_features"], out["text_features"], out["logits"], out["labels"],
                         out["logit_scale"], output_dict=True)
        total = sum(losses.values())
        opt.zero_grad()
        total.backward()
        opt.step()
        if step in (0, 14):
            print(f"step {step}: caption_loss={losses['caption_loss'].item():.4f} "
                  f"contrastive_loss={losses['contrastive_loss'].item():.4f}")

    model.eval()
    with torch.no_grad():
        out = model(images, text)
        pred = out["logits"].argmax(-1)
        valid = out["labels"] != 0
        acc = (pred[valid] == out["labels"][valid]).float().mean().item()
    print(f"labels shape {tuple(out['labels'].shape)}, logits shape {tuple(out['logits'].shape)}")
    print(f"train-batch caption token accuracy: {acc:.3f}")


if __name__ == "__main__":
    main()
