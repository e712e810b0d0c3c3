# HXMap/MapQR#12 (fix: commit 732cb8f): MapTRv2Head builds self_attn_mask to keep the one2one and one2many map-element
# query groups apart, but the DetrTransformerDecoderLayer self-attention only reads attn_masks, so the mask was dropped.
import copy
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MultiheadAttention(nn.Module):
    """mmcv.cnn.bricks.transformer.MultiheadAttention (batch_first=False)."""

    def __init__(self, embed_dims, num_heads, dropout=0.0):
        super().__init__()
        self.attn = nn.MultiheadAttention(embed_dims, num_heads, dropout=dropout)

    def forward(self, query, key=None, value=None, identity=None, query_pos=None, key_pos=None,
                attn_mask=None, key_padding_mask=None, **kwargs):
        key = query if key is None else key
        value = key if value is None else value
        identity = query if identity is None else identity
        if key_pos is None and query_pos is not None and query_pos.shape == key.shape:
            key_pos = query_pos
        if query_pos is not None:
            query = query + query_pos
        if key_pos is not None:
            key = key + key_pos
        out = self.attn(query=query, key=key, value=value, attn_mask=attn_mask,
                        key_padding_mask=key_padding_mask)[0]
        return identity + out


class BaseTransformerLayer(nn.Module):
    """mmcv BaseTransformerLayer as used through DetrTransformerDecoderLayer."""

    def __init__(self, embed_dims, num_heads, feedforward_channels,
                 operation_order=('self_attn', 'norm', 'cross_attn', 'norm', 'ffn', 'norm')):
        super().__init__()
        self.operation_order = operation_order
        self.num_attn = operation_order.count('self_attn') + operation_order.count('cross_attn')
        self.attentions = nn.ModuleList([MultiheadAttention(embed_dims, num_heads) for _ in range(self.num_attn)])
        self.norms = nn.ModuleList([nn.LayerNorm(embed_dims) for _ in range(3)])
        self.ffns = nn.ModuleList([nn.Sequential(nn.Linear(embed_dims, feedforward_channels), nn.ReLU(),
                                                 nn.Linear(feedforward_channels, embed_dims))])

    def forward(self, query, key=None, value=None, query_pos=None, key_pos=None, attn_masks=None,
                query_key_padding_mask=None, key_padding_mask=None, **kwargs):
        norm_index = attn_index = ffn_index = 0
        identity = query
        if attn_masks is None:
            attn_masks = [None for _ in range(self.num_attn)]
        elif isinstance(attn_masks, torch.Tensor):
            attn_masks = [copy.deepcopy(attn_masks) for _ in range(self.num_attn)]
        for layer in self.operation_order:
            if layer == 'self_attn':
                temp_key = temp_value = query
                query = self.attentions[attn_index](
                    query, temp_key, temp_value, identity, query_pos=query_pos, key_pos=query_pos,
                    attn_mask=attn_masks[attn_index], key_padding_mask=query_key_padding_mask)
                attn_index += 1
                identity = query
            elif layer == 'norm':
                query = self.norms[norm_index](query)
                norm_index += 1
            elif layer == 'cross_attn':
                query = self.attentions[attn_index](
                    query, key, value, identity, query_pos=query_pos, key_pos=key_pos,
                    attn_mask=attn_masks[attn_index], key_padding_mask=key_padding_mask)
                attn_index += 1
                identity = query
            elif layer == 'ffn':
                query = identity + self.ffns[ffn_index](query)
                ffn_index += 1
        return query


class CustomTransformerLayer(BaseTransformerLayer):
    """Added by the fix: the self-attention takes kwargs['self_attn_mask']."""

    def forward(self, query, key=None, value=None, query_pos=None, key_pos=None, attn_masks=None,
                query_key_padding_mask=None, key_padding_mask=None, **kwargs):
        self_attn_mask = kwargs['self_attn_mask']
        return super().forward(query, key, value, query_pos, key_pos,
                               attn_masks=[self_attn_mask, None],
                               query_key_padding_mask=query_key_padding_mask, key_padding_mask=key_padding_mask)


class MapTRDecoder(nn.Module):
    def __init__(self, layer_cls, num_layers, embed_dims):
        super().__init__()
        self.layers = nn.ModuleList([layer_cls(embed_dims, 4, 2 * embed_dims) for _ in range(num_layers)])

    def forward(self, query, value, query_pos, **kwargs):
        output = query
        for layer in self.layers:
            output = layer(output, key=value, value=value, query_pos=query_pos, **kwargs)
        return output


D, NUM_PTS, ONE2ONE, ONE2MANY, BEV = 32, 4, 3, 6, 16
num_vec = ONE2ONE + ONE2MANY  # training: k_one2many copies of the one2one queries
decoder = MapTRDecoder(CustomTransformerLayer if FIXED else BaseTransformerLayer, 2, D)
instance_embedding = nn.Embedding(num_vec, D)
pts_embedding = nn.Embedding(NUM_PTS, D)
bev_embed = torch.randn(BEV, 1, D)  # [bev_h*bev_w, bs, C]


def run(nv):
    q = (pts_embedding.weight.unsqueeze(0) + instance_embedding.weight[:nv].unsqueeze(1)).flatten(0, 1)
    query_pos, query = torch.zeros_like(q).unsqueeze(1), q.unsqueeze(1)  # [nv*num_pts, bs, C]
    # make attn mask: attention mask to prevent information leakage (MapTRv2Head.forward)
    self_attn_mask = torch.zeros([nv, nv]).bool()
    self_attn_mask[ONE2ONE:, 0:ONE2ONE] = True
    self_attn_mask[0:ONE2ONE, ONE2ONE:] = True
    self_attn_mask = self_attn_mask.repeat_interleave(NUM_PTS, 0).repeat_interleave(NUM_PTS, 1)
    return decoder(query, bev_embed, query_pos, self_attn_mask=self_attn_mask, num_vec=nv, num_pts_per_vec=NUM_PTS)


decoder.train()
for m in decoder.modules():
    if isinstance(m, nn.Dropout):
        m.p = 0.0
hs_train = run(num_vec)[: ONE2ONE * NUM_PTS]  # one2one queries in the training forward
with torch.no_grad():
    hs_one2one_only = run(ONE2ONE)  # what the one2one group should see: itself only (as at inference)
print(f"fixed={FIXED} max|one2one output (train, with one2many) - one2one alone| = "
      f"{(hs_train - hs_one2one_only).abs().max().item():.3e}")
