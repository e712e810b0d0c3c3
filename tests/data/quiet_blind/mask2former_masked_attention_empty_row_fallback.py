"""Mask2Former masked-attention decoder: 20 queries cross-attend only inside their predicted masks.

Follows facebookresearch/Mask2Former
mask2former/modeling/transformer_decoder/mask2former_transformer_decoder.py
(MultiScaleMaskedTransformerDecoder.forward / forward_prediction_heads, CrossAttentionLayer,
SelfAttentionLayer). Each layer predicts per-query masks from the mask features, resizes them to the
next feature level (round-robin over 3 scales of different H*W), and builds a bool memory_mask
[B*heads, Q, H*W] that is True (blocked) where sigmoid(mask) < 0.5. A query whose predicted mask is
empty at that scale would have a fully blocked row, so the decoder un-blocks that whole row
(`attn_mask[torch.where(attn_mask.sum(-1) == attn_mask.shape[-1])] = False`): that query then attends
to every pixel. Self-attention among the queries is unmasked.
Mask meant: cross-attention Q=20 queries x H*W pixels (16, 64 or 256 keys), each row the query's own
foreground (data dependent, the same for every head), an empty row opened fully;
query self-attention full 20x20.
"""
import torch
import torch.nn.functional as F
from torch import nn


class SelfAttentionLayer(nn.Module):
    def __init__(self, d_model, nhead):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=0.0)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tgt, tgt_mask=None, tgt_key_padding_mask=None, query_pos=None):
        q = k = tgt + query_pos
        tgt2 = self.self_attn(q, k, value=tgt, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask)[0]
        return self.norm(tgt + tgt2)


class CrossAttentionLayer(nn.Module):
    def __init__(self, d_model, nhead):
        super().__init__()
        self.multihead_attn = nn.MultiheadAttention(d_model, nhead, dropout=0.0)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tgt, memory, memory_mask=None, memory_key_padding_mask=None, pos=None, query_pos=None):
        tgt2 = self.multihead_attn(query=tgt + query_pos, key=memory + pos, value=memory,
                                   attn_mask=memory_mask, key_padding_mask=memory_key_padding_mask)[0]
        return self.norm(tgt + tgt2)


class FFNLayer(nn.Module):
    def __init__(self, d_model, dim_feedforward):
        super().__init__()
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tgt):
        return self.norm(tgt + self.linear2(F.relu(self.linear1(tgt))))


class MultiScaleMaskedTransformerDecoder(nn.Module):
    def __init__(self, hidden_dim=32, num_queries=20, nheads=4, dim_feedforward=64, dec_layers=3,
                 mask_dim=32, num_classes=5):
        super().__init__()
        self.num_heads = nheads
        self.num_layers = dec_layers
        self.num_feature_levels = 3
        self.transformer_self_attention_layers = nn.ModuleList()
        self.transformer_cross_attention_layers = nn.ModuleList()
        self.transformer_ffn_layers = nn.ModuleList()
        for _ in range(self.num_layers):
            self.transformer_self_attention_layers.append(SelfAttentionLayer(hidden_dim, nheads))
            self.transformer_cross_attention_layers.append(CrossAttentionLayer(hidden_dim, nheads))
            self.transformer_ffn_layers.append(FFNLayer(hidden_dim, dim_feedforward))
        self.decoder_norm = nn.LayerNorm(hidden_dim)
        self.query_feat = nn.Embedding(num_queries, hidden_dim)
        self.query_embed = nn.Embedding(num_queries, hidden_dim)
        self.level_embed = nn.Embedding(self.num_feature_levels, hidden_dim)
        self.class_embed = nn.Linear(hidden_dim, num_classes + 1)
        self.mask_embed = nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, mask_dim))

    def forward(self, x, mask_features, pos_list):
        src, pos, size_list = [], [], []
        for i in range(self.num_feature_levels):
            size_list.append(x[i].shape[-2:])
            pos.append(pos_list[i].flatten(2).permute(2, 0, 1))
            src.append((x[i].flatten(2) + self.level_embed.weight[i][None, :, None]).permute(2, 0, 1))
        _, bs, _ = src[0].shape
        query_embed = self.query_embed.weight.unsqueeze(1).repeat(1, bs, 1)
        output = self.query_feat.weight.unsqueeze(1).repeat(1, bs, 1)

        predictions_mask = []
        outputs_class, outputs_mask, attn_mask = self.forward_prediction_heads(output, mask_features, size_list[0])
        predictions_mask.append(outputs_mask)
        for i in range(self.num_layers):
            level_index = i % self.num_feature_levels
            # a query whose predicted mask is empty would attend to nothing: let it see everything
            attn_mask[torch.where(attn_mask.sum(-1) == attn_mask.shape[-1])] = False
            output = self.transformer_cross_attention_layers[i](
                output, src[level_index], memory_mask=attn_mask, memory_key_padding_mask=None,
                pos=pos[level_index], query_pos=query_embed)
            output = self.transformer_self_attention_layers[i](
                output, tgt_mask=None, tgt_key_padding_mask=None, query_pos=query_embed)
            output = self.transformer_ffn_layers[i](output)
            outputs_class, outputs_mask, attn_mask = self.forward_prediction_heads(
                output, mask_features, size_list[(i + 1) % self.num_feature_levels])
            predictions_mask.append(outputs_mask)
        return outputs_class, predictions_mask[-1]

    def forward_prediction_heads(self, output, mask_features, attn_mask_target_size):
        decoder_output = self.decoder_norm(output).transpose(0, 1)
        outputs_class = self.class_embed(decoder_output)
        mask_embed = self.mask_embed(decoder_output)
        outputs_mask = torch.einsum("bqc,bchw->bqhw", mask_embed, mask_features)
        attn_mask = F.interpolate(outputs_mask, size=attn_mask_target_size, mode="bilinear", align_corners=False)
        # [B, Q, H, W] -> [B, Q, H*W] -> [B, h, Q, H*W] -> [B*h, Q, HW]; True = not allowed
        attn_mask = (attn_mask.sigmoid().flatten(2).unsqueeze(1).repeat(1, self.num_heads, 1, 1)
                     .flatten(0, 1) < 0.5).bool()
        return outputs_class, outputs_mask, attn_mask.detach()


if __name__ == "__main__":
    torch.manual_seed(0)
    bs, dim = 2, 32
    decoder = MultiScaleMaskedTransformerDecoder(hidden_dim=dim).eval()
    feats = [torch.randn(bs, dim, s, s) for s in (4, 8, 16)]   # 1/32, 1/16, 1/8 scales
    pos = [torch.randn(bs, dim, s, s) * 0.1 for s in (4, 8, 16)]
    mask_features = torch.randn(bs, dim, 32, 32)              # 1/4 scale
    with torch.no_grad():
        logits, masks = decoder(feats, mask_features, pos)
    print("class logits", tuple(logits.shape), "masks", tuple(masks.shape))
