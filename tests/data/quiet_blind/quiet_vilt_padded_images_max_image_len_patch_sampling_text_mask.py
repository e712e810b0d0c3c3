"""ViLT (dandelin/ViLT): a batch of images of different sizes zero-padded
bottom-right to one canvas, right-padded captions, one single-stream transformer
over [text; image patches].

Ported from dandelin/ViLT @762fd3975c180db6fc88f577cf39549983fa373a:
  vilt/datasets/base_dataset.py   BaseDataset.collate (images copied into a
      zeros(batch, 3, max_h, max_w) canvas at [:h, :w]; texts padded to
      max_text_len with their tokenizer attention_mask)
  vilt/modules/vision_transformer.py  Attention.forward (masked_fill(~mask,
      -inf) on the keys), Block, PatchEmbed, VisionTransformer.visual_embed
      (pixel mask -> patch mask by F.interpolate, per-image position embeddings
      interpolated to (h, w) and padded, max_image_len: a random subset of the
      valid patches when an image has more, random padding patches with
      x_mask 0 when it has fewer), forward_features
  vilt/modules/vilt_module.py  ViLTransformerSS.infer (BertEmbeddings, token
      type embeddings, co_masks = cat([text_masks, image_masks]))
  vilt/modules/heads.py  Pooler
Tiny sizes, random weights, eval mode, CPU.

Checked against each (caption, image) pair run alone: its caption without pads,
its image cropped to its own size, every patch kept, mask of ones.  With
max_image_len=-1 (every valid patch, as in evaluation) and with
max_image_len=6 (ViLT's training-time patch sampling, here below the larger
images' patch counts) the batch's kept patches are read back from patch_index
(x_mask 1) and the single run is restricted to exactly those patches, in that
order; the text features, those image features and the pooled cls features
must match.
"""
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.models.bert.modeling_bert import BertConfig, BertEmbeddings

torch.manual_seed(0)


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.0):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop(x)
        x = self.fc2(x)
        x = self.drop(x)
        return x


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_scale=None, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = qk_scale or head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]

        attn = (q @ k.transpose(-2, -1)) * self.scale
        if mask is not None:
            mask = mask.bool()
            attn = attn.masked_fill(~mask[:, None, None, :], float("-inf"))
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)

        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x, attn


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, qk_scale=None, drop=0.0,
                 attn_drop=0.0, act_layer=nn.GELU, norm_layer=nn.LayerNorm):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_scale=qk_scale,
                              attn_drop=attn_drop, proj_drop=drop)
        self.drop_path = nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=drop)

    def forward(self, x, mask=None):
        _x, attn = self.attn(self.norm1(x), mask=mask)
        x = x + self.drop_path(_x)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x, attn


class PatchEmbed(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768):
        super().__init__()
        self.img_size = (img_size, img_size)
        self.patch_size = (patch_size, patch_size)
        self.num_patches = (img_size // patch_size) * (img_size // patch_size)
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x)


class VisionTransformer(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, depth=12, num_heads=12,
                 mlp_ratio=4.0, qkv_bias=True, drop_rate=0.0, add_norm_before_transformer=False):
        super().__init__()
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.embed_dim = embed_dim
        self.add_norm_before_transformer = add_norm_before_transformer
        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        num_patches = self.patch_embed.num_patches
        self.patch_size = patch_size
        self.patch_dim = img_size // patch_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(p=drop_rate)
        if add_norm_before_transformer:
            self.pre_norm = norm_layer(embed_dim)
        self.blocks = nn.ModuleList([
            Block(dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                  drop=drop_rate, norm_layer=norm_layer)
            for _ in range(depth)
        ])
        self.norm = norm_layer(embed_dim)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def visual_embed(self, _x, max_image_len=200, mask_it=False):
        _, _, ph, pw = self.patch_embed.proj.weight.shape

        x = self.patch_embed(_x)
        x_mask = (_x.sum(dim=1) != 0).float()[:, None, :, :]
        x_mask = F.interpolate(x_mask, size=(x.shape[2], x.shape[3])).long()
        x_h = x_mask[:, 0].sum(dim=1)[:, 0]
        x_w = x_mask[:, 0].sum(dim=2)[:, 0]

        B, C, H, W = x.shape
        spatial_pos = self.pos_embed[:, 1:, :].transpose(1, 2).view(1, C, self.patch_dim, self.patch_dim)
        pos_embed = torch.cat(
            [
                F.pad(
                    F.interpolate(spatial_pos, size=(h, w), mode="bilinear", align_corners=True),
                    (0, W - w, 0, H - h),
                )
                for h, w in zip(x_h, x_w)
            ],
            dim=0,
        )

        pos_embed = pos_embed.flatten(2).transpose(1, 2)
        x = x.flatten(2).transpose(1, 2)
        patch_index = (
            torch.stack(
                torch.meshgrid(torch.arange(x_mask.shape[-2]), torch.arange(x_mask.shape[-1]), indexing="ij"),
                dim=-1,
            )[None, None, :, :, :]
            .expand(x_mask.shape[0], x_mask.shape[1], -1, -1, -1)
            .flatten(1, 3)
        )
        x_mask = x_mask.flatten(1)

        if max_image_len < 0 or max_image_len is None or not isinstance(max_image_len, int):
            eff = x_h * x_w
            max_image_len = eff.max()
        else:
            eff = x_h * x_w
            max_image_len = min(eff.max(), max_image_len)

        valid_idx = x_mask.nonzero(as_tuple=False)
        non_valid_idx = (1 - x_mask).nonzero(as_tuple=False)
        unique_rows = valid_idx[:, 0].unique()
        valid_row_idx = [valid_idx[valid_idx[:, 0] == u] for u in unique_rows]
        non_valid_row_idx = [non_valid_idx[non_valid_idx[:, 0] == u] for u in unique_rows]

        valid_nums = [v.size(0) for v in valid_row_idx]
        non_valid_nums = [v.size(0) for v in non_valid_row_idx]
        pad_nums = [max_image_len - v for v in valid_nums]

        select = list()
        for i, (v, nv, p) in enumerate(zip(valid_nums, non_valid_nums, pad_nums)):
            if p <= 0:
                valid_choice = torch.multinomial(torch.ones(v).float(), max_image_len)
                select.append(valid_row_idx[i][valid_choice])
            else:
                pad_choice = torch.multinomial(torch.ones(nv).float(), p, replacement=True)
                select.append(torch.cat([valid_row_idx[i], non_valid_row_idx[i][pad_choice]], dim=0))

        select = torch.cat(select, dim=0)
        x = x[select[:, 0], select[:, 1]].view(B, -1, C)
        x_mask = x_mask[select[:, 0], select[:, 1]].view(B, -1)
        patch_index = patch_index[select[:, 0], select[:, 1]].view(B, -1, 2)
        pos_embed = pos_embed[select[:, 0], select[:, 1]].view(B, -1, C)

        cls_tokens = self.cls_token.expand(B, -1, -1)
        x = torch.cat((cls_tokens, x), dim=1)
        pos_embed = torch.cat((self.pos_embed[:, 0, :][:, None, :].expand(B, -1, -1), pos_embed), dim=1)
        x = x + pos_embed
        x = self.pos_drop(x)

        if self.add_norm_before_transformer:
            x = self.pre_norm(x)

        x_mask = torch.cat([torch.ones(x_mask.shape[0], 1).to(x_mask), x_mask], dim=1)
        return x, x_mask, (patch_index, (H, W)), None


class Pooler(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        first_token_tensor = hidden_states[:, 0]
        return self.activation(self.dense(first_token_tensor))


config = {
    "vocab_size": 50, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "mlp_ratio": 4,
    "max_text_len": 12, "drop_rate": 0.1, "patch_size": 4, "image_size": 16, "max_image_len": -1,
}


class ViLTransformerSS(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        bert_config = BertConfig(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_layers"],
            num_attention_heads=config["num_heads"],
            intermediate_size=config["hidden_size"] * config["mlp_ratio"],
            max_position_embeddings=config["max_text_len"],
            hidden_dropout_prob=config["drop_rate"],
            attention_probs_dropout_prob=config["drop_rate"],
        )
        self.text_embeddings = BertEmbeddings(bert_config)
        self.token_type_embeddings = nn.Embedding(2, config["hidden_size"])
        self.transformer = VisionTransformer(
            img_size=config["image_size"], patch_size=config["patch_size"], embed_dim=config["hidden_size"],
            depth=config["num_layers"], num_heads=config["num_heads"], mlp_ratio=config["mlp_ratio"],
            drop_rate=config["drop_rate"], add_norm_before_transformer=False,
        )
        self.pooler = Pooler(config["hidden_size"])

    def infer(self, batch, image_token_type_idx=1, image_embeds=None, image_masks=None):
        imgkey = "image"
        text_ids = batch["text_ids"]
        text_masks = batch["text_masks"]
        text_embeds = self.text_embeddings(text_ids)

        patch_index = None
        if image_embeds is None and image_masks is None:
            img = batch[imgkey][0]
            image_embeds, image_masks, patch_index, image_labels = self.transformer.visual_embed(
                img, max_image_len=self.config["max_image_len"], mask_it=False
            )

        text_embeds, image_embeds = (
            text_embeds + self.token_type_embeddings(torch.zeros_like(text_masks)),
            image_embeds + self.token_type_embeddings(torch.full_like(image_masks, image_token_type_idx)),
        )

        co_embeds = torch.cat([text_embeds, image_embeds], dim=1)
        co_masks = torch.cat([text_masks, image_masks], dim=1)

        x = co_embeds
        for i, blk in enumerate(self.transformer.blocks):
            x, _attn = blk(x, mask=co_masks)

        x = self.transformer.norm(x)
        text_feats, image_feats = x[:, : text_embeds.shape[1]], x[:, text_embeds.shape[1]:]
        cls_feats = self.pooler(x)
        return {
            "text_feats": text_feats, "image_feats": image_feats, "cls_feats": cls_feats,
            "image_masks": image_masks, "text_masks": text_masks, "patch_index": patch_index,
        }


def collate(samples, max_text_len):
    """BaseDataset.collate: zero canvas for images, max_length padding for texts."""
    img_sizes = [s["image"][0].shape for s in samples]
    max_height = max(i[1] for i in img_sizes)
    max_width = max(i[2] for i in img_sizes)
    new_images = [torch.zeros(len(samples), 3, max_height, max_width)]
    for bi, s in enumerate(samples):
        orig = s["image"][0]
        new_images[0][bi, :, : orig.shape[1], : orig.shape[2]] = orig
    input_ids = torch.zeros(len(samples), max_text_len, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), max_text_len, dtype=torch.long)
    for _i, s in enumerate(samples):
        ids = torch.tensor(s["input_ids"])
        input_ids[_i, : len(ids)] = ids
        attention_mask[_i, : len(ids)] = 1
    return {"image": new_images, "text_ids": input_ids, "text_masks": attention_mask}


model = ViLTransformerSS(config).eval()

PS = config["patch_size"]
# (h, w) in patches: 3x4, 4x2, 2x2 -> 12, 8 and 4 valid patches on a 4x4 canvas
sizes = [(3, 4), (4, 2), (2, 2)]
captions = [[2, 11, 7, 23, 5, 3], [2, 9, 3], [2, 14, 30, 8, 41, 19, 6, 3]]
samples = []
for (h, w), ids in zip(sizes, captions):
    img = torch.randn(3, h * PS, w * PS)
    samples.append({"image": [img], "input_ids": ids})

batch = collate(samples, config["max_text_len"])
ATOL = 1e-5


def run_single(s, keep_cells=None):
    """One pair alone: caption ids only, image at its own size, all patches, mask of ones."""
    ids = torch.tensor([s["input_ids"]])
    one = {"image": [s["image"][0][None]], "text_ids": ids, "text_masks": torch.ones_like(ids)}
    saved = model.config["max_image_len"]
    model.config["max_image_len"] = -1
    img_embeds, img_masks, (pidx, _), _ = model.transformer.visual_embed(one["image"][0], max_image_len=-1)
    model.config["max_image_len"] = saved
    assert bool(img_masks.all())
    if keep_cells is not None:
        cells = [tuple(c) for c in pidx[0].tolist()]
        order = [0] + [1 + cells.index(c) for c in keep_cells]
        img_embeds = img_embeds[:, order]
        img_masks = img_masks[:, order]
    return model.infer(one, image_embeds=img_embeds, image_masks=img_masks)


def check(out):
    patch_index, _ = out["patch_index"]
    for i, s in enumerate(samples):
        h, w = sizes[i]
        keep = out["image_masks"][i, 1:].bool()
        kept_cells = [tuple(c) for c in patch_index[i][keep].tolist()]
        n_keep = h * w if model.config["max_image_len"] < 0 else min(model.config["max_image_len"], h * w)
        assert len(kept_cells) == n_keep and len(set(kept_cells)) == n_keep
        assert all(r < h and c < w for r, c in kept_cells)
        ref = run_single(s, keep_cells=kept_cells)
        n_txt = len(s["input_ids"])
        assert torch.allclose(out["text_feats"][i, :n_txt], ref["text_feats"][0], atol=ATOL)
        got_img = torch.cat([out["image_feats"][i, :1], out["image_feats"][i, 1:][keep]])
        assert torch.allclose(got_img, ref["image_feats"][0], atol=ATOL)
        assert torch.allclose(out["cls_feats"][i], ref["cls_feats"][0], atol=ATOL)


with torch.no_grad():
    # evaluation setting: every valid patch kept (the largest image's are drawn
    # in a random order, the others' in raster order then random pad patches)
    model.config["max_image_len"] = -1
    out = model.infer(batch)
    assert out["image_masks"].shape[1] == 1 + 12
    check(out)

    # training setting: max_image_len patches sampled per image
    model.config["max_image_len"] = 6
    torch.manual_seed(1)
    out = model.infer(batch)
    assert out["image_masks"].shape[1] == 1 + 6
    check(out)

print("ok: ViLT padded images / sampled patches / padded captions match each pair run alone")
