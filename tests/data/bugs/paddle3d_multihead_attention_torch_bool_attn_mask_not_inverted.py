# PaddlePaddle/Paddle3D#235 ("[Bug fix] operate logical NOT on attn_mask for multiheadattention of bevformer"),
# paddle3d/models/transformers/attentions/multihead_attention.py (commit 003ae39 before, fde66e3 after).
# Paddle3D's MultiheadAttention wraps paddle.nn.MultiHeadAttention in place of mmcv's torch nn.MultiheadAttention,
# but its callers (DetrTransformerDecoderLayer, ported from mmcv) still hand it the torch-style bool attn_mask
# (True = not allowed). paddle.nn.MultiHeadAttention reads a bool mask the other way (True = attend; False becomes
# -1e9), so with key_padding_mask None the mask was passed through as is and every query attended only to the
# keys it should not see. Fix: `attn_mask = ~attn_mask` before self.attn when key_padding_mask is None.
# paddle.nn.MultiHeadAttention and its _convert_attention_mask are written out in torch below; the caller passes a
# DN-DETR-style group mask built the torch way (True = not allowed), as the mmdet/mmcv heads being ported do.
import copy
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _convert_attention_mask(attn_mask, dtype):
    # paddle.nn.layer.transformer._convert_attention_mask
    if attn_mask is not None and attn_mask.dtype != dtype:
        if attn_mask.dtype in (torch.bool, torch.int64, torch.int32, torch.uint8):
            attn_mask = (attn_mask.to(dtype) - 1.0) * 1e9
        else:
            attn_mask = attn_mask.to(dtype)
    return attn_mask


class PaddleMultiHeadAttention(nn.Module):
    """paddle.nn.MultiHeadAttention(embed_dim, num_heads, dropout): batch-first, attn_mask bool True = keep."""

    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _prepare_qkv(self, query, key, value):
        q = self.q_proj(query)
        q = q.reshape(q.shape[0], q.shape[1], self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        k = self.k_proj(key)
        k = k.reshape(k.shape[0], k.shape[1], self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        v = self.v_proj(value)
        v = v.reshape(v.shape[0], v.shape[1], self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        return q, k, v

    def forward(self, query, key=None, value=None, attn_mask=None):
        key = query if key is None else key
        value = query if value is None else value
        q, k, v = self._prepare_qkv(query, key, value)
        # scale dot product attention
        product = torch.matmul(q * (self.head_dim ** -0.5), k.transpose(-1, -2))
        if attn_mask is not None:
            attn_mask = _convert_attention_mask(attn_mask, product.dtype)
            product = product + attn_mask
        weights = F.softmax(product, dim=-1)
        if self.dropout:
            weights = F.dropout(weights, self.dropout, training=self.training)
        out = torch.matmul(weights, v)
        out = out.permute(0, 2, 1, 3)
        out = out.reshape(out.shape[0], out.shape[1], out.shape[2] * out.shape[3])
        return self.out_proj(out)


class MultiheadAttention(nn.Module):
    """paddle3d.models.transformers.attentions.MultiheadAttention: a wrapper for paddle.nn.MultiHeadAttention."""

    def __init__(self, embed_dims, num_heads, attn_drop=0., proj_drop=0.,
                 dropout_layer=dict(type_name='Dropout', p=0.), batch_first=False, **kwargs):
        super().__init__()
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.batch_first = batch_first
        self.attn = PaddleMultiHeadAttention(embed_dims, num_heads, attn_drop, **kwargs)
        self.proj_drop = nn.Dropout(proj_drop)
        dropout_layer_ = copy.deepcopy(dropout_layer)
        dropout_layer_name = dropout_layer_.pop("type_name")
        self.dropout_layer = getattr(nn, dropout_layer_name)(**dropout_layer_)

    def forward(self, query, key=None, value=None, identity=None, query_pos=None, key_pos=None,
                attn_mask=None, key_padding_mask=None, **kwargs):
        if key is None:
            key = query
        if value is None:
            value = key
        if identity is None:
            identity = query
        if key_pos is None:
            if query_pos is not None:
                if query_pos.shape == key.shape:
                    key_pos = query_pos
        if query_pos is not None:
            query = query + query_pos
        if key_pos is not None:
            key = key + key_pos

        # (num_query, batch, embed_dims) -> (batch, num_query, embed_dims) for paddle.nn.MultiHeadAttention
        if not self.batch_first:
            query = query.permute(1, 0, 2)
            key = key.permute(1, 0, 2)
            value = value.permute(1, 0, 2)

        if key_padding_mask is None:
            if FIXED:
                if attn_mask is not None:
                    attn_mask = ~attn_mask
            out = self.attn(query=query, key=key, value=value, attn_mask=attn_mask)
        else:
            if attn_mask is None:
                attn_mask = ~key_padding_mask
                out = self.attn(query=query, key=key, value=value, attn_mask=attn_mask)
            else:
                raise ValueError('key_padding_mask is not None')

        if not self.batch_first:
            out = out.permute(1, 0, 2)
        return identity + self.dropout_layer(self.proj_drop(out))


class FFN(nn.Module):
    def __init__(self, embed_dims=32, feedforward_channels=64, num_fcs=2, ffn_drop=0.,
                 act_cfg=dict(type_name='ReLU')):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dims, feedforward_channels), nn.ReLU(), nn.Dropout(ffn_drop),
            nn.Linear(feedforward_channels, embed_dims), nn.Dropout(ffn_drop),
        )

    def forward(self, x, identity=None):
        out = self.layers(x)
        if identity is None:
            identity = x
        return identity + out


class DetrTransformerDecoderLayer(nn.Module):
    def __init__(self, attn_cfgs, feedforward_channels, ffn_dropout=0.0, operation_order=None,
                 batch_first=False, **kwargs):
        super().__init__()
        self.batch_first = batch_first
        num_attn = operation_order.count('self_attn') + operation_order.count('cross_attn')
        if isinstance(attn_cfgs, dict):
            attn_cfgs = [copy.deepcopy(attn_cfgs) for _ in range(num_attn)]
        self.num_attn = num_attn
        self.operation_order = operation_order
        self.pre_norm = operation_order[0] == 'norm'
        self.attentions = nn.ModuleList()
        for index in range(num_attn):
            params = dict(attn_cfgs[index])
            params.pop('type_name')
            params['batch_first'] = self.batch_first
            self.attentions.append(MultiheadAttention(**params))
        self.embed_dims = self.attentions[0].embed_dims
        self.ffns = nn.ModuleList([
            FFN(self.embed_dims, feedforward_channels, 2, ffn_dropout)
            for _ in range(operation_order.count('ffn'))
        ])
        self.norms = nn.ModuleList([nn.LayerNorm(self.embed_dims) for _ in range(operation_order.count('norm'))])

    def forward(self, query, key=None, value=None, query_pos=None, key_pos=None, attn_masks=None,
                query_key_padding_mask=None, key_padding_mask=None, **kwargs):
        norm_index = 0
        attn_index = 0
        ffn_index = 0
        identity = query
        if attn_masks is None:
            attn_masks = [None for _ in range(self.num_attn)]
        elif isinstance(attn_masks, torch.Tensor):
            attn_masks = [copy.deepcopy(attn_masks) for _ in range(self.num_attn)]
        for layer in self.operation_order:
            if layer == 'self_attn':
                temp_key = temp_value = query
                query = self.attentions[attn_index](
                    query, temp_key, temp_value, identity if self.pre_norm else None,
                    query_pos=query_pos, key_pos=query_pos, attn_mask=attn_masks[attn_index],
                    key_padding_mask=query_key_padding_mask, **kwargs)
                attn_index += 1
                identity = query
            elif layer == 'norm':
                query = self.norms[norm_index](query)
                norm_index += 1
            elif layer == 'cross_attn':
                query = self.attentions[attn_index](
                    query, key, value, identity if self.pre_norm else None,
                    query_pos=query_pos, key_pos=key_pos, attn_mask=attn_masks[attn_index],
                    key_padding_mask=key_padding_mask, **kwargs)
                attn_index += 1
                identity = query
            elif layer == 'ffn':
                query = self.ffns[ffn_index](query, identity if self.pre_norm else None)
                ffn_index += 1
        return query


def build_dn_attn_mask(num_dn_groups, num_gt, num_queries):
    """mmdet/DN-DETR style self-attention mask, torch convention (True = not allowed): the matching queries
    never see the denoising queries, and each denoising group sees only itself."""
    pad_size = num_dn_groups * num_gt
    tgt_size = pad_size + num_queries
    attn_mask = torch.zeros(tgt_size, tgt_size, dtype=torch.bool)
    attn_mask[pad_size:, :pad_size] = True
    for i in range(num_dn_groups):
        start, end = num_gt * i, num_gt * (i + 1)
        attn_mask[start:end, :start] = True
        attn_mask[start:end, end:pad_size] = True
    return attn_mask


def main():
    embed_dims, num_heads = 32, 4
    layer = DetrTransformerDecoderLayer(
        attn_cfgs=dict(type_name='MultiheadAttention', embed_dims=embed_dims, num_heads=num_heads, attn_drop=0.0),
        feedforward_channels=64,
        operation_order=('self_attn', 'norm', 'cross_attn', 'norm', 'ffn', 'norm'),
    ).eval()

    bs, num_dn_groups, num_gt, num_queries, num_keys = 2, 2, 3, 5, 12
    num_q = num_dn_groups * num_gt + num_queries
    query = torch.randn(num_q, bs, embed_dims)
    query_pos = torch.randn(num_q, bs, embed_dims)
    memory = torch.randn(num_keys, bs, embed_dims)
    memory_pos = torch.randn(num_keys, bs, embed_dims)
    attn_mask = build_dn_attn_mask(num_dn_groups, num_gt, num_queries)

    with torch.no_grad():
        out = layer(query, key=memory, value=memory, query_pos=query_pos, key_pos=memory_pos,
                    attn_masks=[attn_mask, None])
    pad_size = num_dn_groups * num_gt
    print("decoder output, first matching query[:4]", out[pad_size, 0, :4].tolist())
    print("decoder output, first denoising query[:4]", out[0, 0, :4].tolist())


if __name__ == "__main__":
    main()
