# detrex (then "ideadet"), IDEA-Research/detrex commit 28f3d0d ("support attention masks for conditional attn"),
# ideadet/layers/conditional_attention.py ConditionalSelfAttention.
# Before the fix ConditionalSelfAttention.forward took attn_mask and key_padding_mask but never used them: the scores
# went straight to softmax, so an encoder over a padded image batch attended the padded pixels, and the DN-DETR
# decoder's denoising queries and matching queries saw each other. The fix fills bool attn_mask / key_padding_mask
# positions (True = not allowed) with -inf (a float attn_mask is added) before the softmax.
# Around it: a DETR-style NestedTensor batch (mask True on padding), a sine position embedding, a DN-DETR-style
# self-attention mask over [denoising groups | matching queries], and DETR's nn.MultiheadAttention cross-attention.
import math
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ConditionalSelfAttention(nn.Module):
    def __init__(
        self,
        embed_dim,
        num_heads,
        attn_drop=0.,
        proj_drop=0.,
        batch_first=False,
        **kwargs,
    ):
        super(ConditionalSelfAttention, self).__init__()
        self.query_content_proj = nn.Linear(embed_dim, embed_dim)
        self.query_pos_proj = nn.Linear(embed_dim, embed_dim)
        self.key_content_proj = nn.Linear(embed_dim, embed_dim)
        self.key_pos_proj = nn.Linear(embed_dim, embed_dim)
        self.value_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj_drop = nn.Dropout(proj_drop)
        self.num_heads = num_heads
        self.embed_dim = embed_dim
        head_dim = embed_dim // num_heads
        self.scale = head_dim ** -0.5
        self.batch_first = batch_first

    def forward(self, query, key=None, value=None, identity=None, query_pos=None, key_pos=None, attn_mask=None,
                key_padding_mask=None, **kwargs):
        if key is None:
            key = query
        if value is None:
            value = key
        if identity is None:
            identity = query
        if key_pos is None:
            if query_pos is not None:
                # use query_pos if key_pos is not available
                if query_pos.shape == key.shape:
                    key_pos = query_pos
                else:
                    warnings.warn(f'position encoding of key is'
                                  f'missing in {self.__class__.__name__}.')

        assert query_pos is not None and key_pos is not None, "query_pos and key_pos must be passed into ConditionalAttention Module"

        # transpose (b n c) to (n b c) for attention calculation
        if self.batch_first:
            query = query.transpose(0, 1)  # (n b c)
            key = key.transpose(0, 1)
            value = value.transpose(0, 1)
            query_pos = query_pos.transpose(0, 1)
            key_pos = key_pos.transpose(0, 1)
            identity = identity.transpose(0, 1)

        # query/key/value content and position embedding projection
        query_content = self.query_content_proj(query)
        query_pos = self.query_pos_proj(query_pos)
        key_content = self.key_content_proj(key)
        key_pos = self.key_pos_proj(key_pos)
        value = self.value_proj(value)

        # attention calculation
        N, B, C = query_content.shape
        q = query_content + query_pos
        k = key_content + key_pos
        v = value

        q = q.reshape(N, B, self.num_heads, C // self.num_heads).permute(1, 2, 0, 3)  # (B, num_heads, N, head_dim)
        k = k.reshape(N, B, self.num_heads, C // self.num_heads).permute(1, 2, 0, 3)
        v = v.reshape(N, B, self.num_heads, C // self.num_heads).permute(1, 2, 0, 3)

        attn = (q @ k.transpose(-2, -1)) * self.scale

        if FIXED:
            # add attention mask
            if attn_mask is not None:
                if attn_mask.dtype == torch.bool:
                    attn.masked_fill_(attn_mask, float('-inf'))
                else:
                    attn += attn_mask
            if key_padding_mask is not None:
                attn = attn.masked_fill_(key_padding_mask.unsqueeze(1).unsqueeze(2), float('-inf'))

        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)

        out = (attn @ v).transpose(1, 2).reshape(B, N, C)
        out = self.out_proj(out)

        if not self.batch_first:
            out = out.transpose(0, 1)

        return identity + self.proj_drop(out)


def nested_tensor_from_tensor_list(tensor_list):
    """DETR util/misc.py: pad to the batch max size; mask True on padded pixels."""
    max_size = [max(s) for s in zip(*[img.shape for img in tensor_list])]
    b = len(tensor_list)
    c, h, w = max_size
    tensor = torch.zeros((b, c, h, w), dtype=tensor_list[0].dtype)
    mask = torch.ones((b, h, w), dtype=torch.bool)
    for img, pad_img, m in zip(tensor_list, tensor, mask):
        pad_img[: img.shape[0], : img.shape[1], : img.shape[2]].copy_(img)
        m[: img.shape[1], : img.shape[2]] = False
    return tensor, mask


def sine_position_embedding(mask, num_pos_feats, temperature=10000):
    """DETR PositionEmbeddingSine(normalize=True)."""
    not_mask = ~mask
    y_embed = not_mask.cumsum(1, dtype=torch.float32)
    x_embed = not_mask.cumsum(2, dtype=torch.float32)
    eps = 1e-6
    scale = 2 * math.pi
    y_embed = y_embed / (y_embed[:, -1:, :] + eps) * scale
    x_embed = x_embed / (x_embed[:, :, -1:] + eps) * scale
    dim_t = torch.arange(num_pos_feats, dtype=torch.float32)
    dim_t = temperature ** (2 * (dim_t // 2) / num_pos_feats)
    pos_x = x_embed[:, :, :, None] / dim_t
    pos_y = y_embed[:, :, :, None] / dim_t
    pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), dim=4).flatten(3)
    pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), dim=4).flatten(3)
    return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


def dn_self_attn_mask(num_dn_groups, num_gt, num_queries):
    """DN-DETR prepare_for_dn: True = not allowed. Matching queries cannot see denoising ones, and each
    denoising group sees only itself."""
    pad_size = num_dn_groups * num_gt
    tgt_size = pad_size + num_queries
    attn_mask = torch.zeros(tgt_size, tgt_size, dtype=torch.bool)
    attn_mask[pad_size:, :pad_size] = True
    for i in range(num_dn_groups):
        s, e = num_gt * i, num_gt * (i + 1)
        attn_mask[s:e, :s] = True
        attn_mask[s:e, e:pad_size] = True
    return attn_mask


class TinyConditionalDETR(nn.Module):
    def __init__(self, d_model=32, nhead=4, num_queries=6):
        super().__init__()
        self.input_proj = nn.Conv2d(3, d_model, kernel_size=4, stride=4)
        self.enc_self_attn = ConditionalSelfAttention(d_model, nhead)
        self.enc_norm = nn.LayerNorm(d_model)
        self.query_embed = nn.Embedding(num_queries, d_model)
        self.query_pos = nn.Embedding(num_queries, d_model)
        self.dn_label_embed = nn.Embedding(4, d_model)
        self.dn_pos_proj = nn.Linear(4, d_model)
        self.dec_self_attn = ConditionalSelfAttention(d_model, nhead)
        self.dec_norm1 = nn.LayerNorm(d_model)
        self.cross_attn = nn.MultiheadAttention(d_model, nhead)
        self.dec_norm2 = nn.LayerNorm(d_model)
        self.class_embed = nn.Linear(d_model, 4)
        self.bbox_embed = nn.Linear(d_model, 4)
        self.d_model = d_model

    def forward(self, images, dn_labels, dn_boxes, num_dn_groups):
        samples, mask = nested_tensor_from_tensor_list(images)
        src = self.input_proj(samples)
        mask = F.interpolate(mask[None].float(), size=src.shape[-2:]).to(torch.bool)[0]
        pos = sine_position_embedding(mask, self.d_model // 2)
        bs = src.shape[0]
        src = src.flatten(2).permute(2, 0, 1)  # (HW, B, C)
        pos = pos.flatten(2).permute(2, 0, 1)
        mask = mask.flatten(1)  # (B, HW) True = pad

        memory = self.enc_norm(self.enc_self_attn(src, query_pos=pos, key_pos=pos, key_padding_mask=mask))

        # [denoising groups | matching queries], sequence first
        dn_tgt = self.dn_label_embed(dn_labels).repeat(1, num_dn_groups, 1)  # (B, G * num_gt, C)
        dn_pos = self.dn_pos_proj(dn_boxes).repeat(1, num_dn_groups, 1)
        tgt = torch.cat([dn_tgt, self.query_embed.weight[None].expand(bs, -1, -1)], 1).transpose(0, 1)
        query_pos = torch.cat([dn_pos, self.query_pos.weight[None].expand(bs, -1, -1)], 1).transpose(0, 1)
        attn_mask = dn_self_attn_mask(num_dn_groups, dn_labels.shape[1], self.query_embed.num_embeddings)

        tgt = self.dec_norm1(self.dec_self_attn(tgt, query_pos=query_pos, key_pos=query_pos, attn_mask=attn_mask))
        tgt2 = self.cross_attn(tgt + query_pos, memory + pos, memory, key_padding_mask=mask)[0]
        hs = self.dec_norm2(tgt + tgt2).transpose(0, 1)  # (B, Nq, C)
        pad_size = num_dn_groups * dn_labels.shape[1]
        return {
            "pred_logits": self.class_embed(hs[:, pad_size:]),
            "pred_boxes": self.bbox_embed(hs[:, pad_size:]).sigmoid(),
            "dn_logits": self.class_embed(hs[:, :pad_size]),
        }


model = TinyConditionalDETR().eval()
images = [torch.randn(3, 32, 48), torch.randn(3, 24, 28)]
dn_labels = torch.tensor([[1, 3], [2, 0]])
dn_boxes = torch.rand(2, 2, 4)
with torch.no_grad():
    out = model(images, dn_labels, dn_boxes, num_dn_groups=2)
probs = out["pred_logits"].softmax(-1)
print("scores (image 1):", [round(v, 4) for v in probs[1].max(-1).values.tolist()])
print("boxes (image 1, query 0):", [round(v, 4) for v in out["pred_boxes"][1, 0].tolist()])
