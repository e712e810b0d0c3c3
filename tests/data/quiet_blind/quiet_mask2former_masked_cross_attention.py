# Citation: facebookresearch/Mask2Former mask2former/modeling/transformer_decoder/mask2former_transformer_decoder.py
#   (MultiScaleMaskedTransformerDecoder.forward, forward_prediction_heads, CrossAttentionLayer, SelfAttentionLayer).
# Masked attention: each query cross-attends (nn.MultiheadAttention, bool attn_mask True = blocked) only to pixels
# where its previous-layer predicted mask sigmoid >= 0.5, at the next feature level's resolution (memory of 16..64
# pixels, longer than the 10 queries). A query whose predicted mask is empty would get a fully blocked row, so the
# project unblocks such rows on purpose: attn_mask[torch.where(attn_mask.sum(-1) == attn_mask.shape[-1])] = False.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class SelfAttentionLayer(nn.Module):
    def __init__(self, d_model, nhead, dropout=0.0):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tgt, tgt_mask=None, tgt_key_padding_mask=None, query_pos=None):
        q = k = tgt + query_pos
        tgt2 = self.self_attn(q, k, value=tgt, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask)[0]
        return self.norm(tgt + tgt2)


class CrossAttentionLayer(nn.Module):
    def __init__(self, d_model, nhead, dropout=0.0):
        super().__init__()
        self.multihead_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tgt, memory, memory_mask=None, memory_key_padding_mask=None, pos=None, query_pos=None):
        tgt2 = self.multihead_attn(query=tgt + query_pos, key=memory + pos, value=memory, attn_mask=memory_mask,
                                   key_padding_mask=memory_key_padding_mask)[0]
        return self.norm(tgt + tgt2)


class FFNLayer(nn.Module):
    def __init__(self, d_model, dim_feedforward=64):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(d_model, dim_feedforward), nn.Linear(dim_feedforward, d_model)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tgt):
        return self.norm(tgt + self.linear2(F.relu(self.linear1(tgt))))


class MultiScaleMaskedTransformerDecoder(nn.Module):
    def __init__(self, hidden_dim=32, num_queries=10, nheads=4, dec_layers=3, num_classes=4, mask_dim=32):
        super().__init__()
        self.num_heads, self.num_layers, self.num_feature_levels = nheads, dec_layers, 3
        self.transformer_self_attention_layers = nn.ModuleList([SelfAttentionLayer(hidden_dim, nheads) for _ in range(dec_layers)])
        self.transformer_cross_attention_layers = nn.ModuleList([CrossAttentionLayer(hidden_dim, nheads) for _ in range(dec_layers)])
        self.transformer_ffn_layers = nn.ModuleList([FFNLayer(hidden_dim) for _ in range(dec_layers)])
        self.decoder_norm = nn.LayerNorm(hidden_dim)
        self.query_feat = nn.Embedding(num_queries, hidden_dim)
        self.query_embed = nn.Embedding(num_queries, hidden_dim)
        self.level_embed = nn.Embedding(self.num_feature_levels, hidden_dim)
        self.class_embed = nn.Linear(hidden_dim, num_classes + 1)
        self.mask_embed = nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, mask_dim))

    def forward(self, x, mask_features):
        src, pos, size_list = [], [], []
        for i in range(self.num_feature_levels):
            size_list.append(x[i].shape[-2:])
            pos.append((torch.randn_like(x[i]) * 0.1).flatten(2))
            src.append(x[i].flatten(2) + self.level_embed.weight[i][None, :, None])
            pos[-1] = pos[-1].permute(2, 0, 1)
            src[-1] = src[-1].permute(2, 0, 1)
        _, bs, _ = src[0].shape
        query_embed = self.query_embed.weight.unsqueeze(1).repeat(1, bs, 1)
        output = self.query_feat.weight.unsqueeze(1).repeat(1, bs, 1)
        predictions_class, predictions_mask = [], []
        outputs_class, outputs_mask, attn_mask = self.forward_prediction_heads(output, mask_features, attn_mask_target_size=size_list[0])
        predictions_class.append(outputs_class)
        predictions_mask.append(outputs_mask)
        for i in range(self.num_layers):
            level_index = i % self.num_feature_levels
            attn_mask[torch.where(attn_mask.sum(-1) == attn_mask.shape[-1])] = False
            output = self.transformer_cross_attention_layers[i](output, src[level_index], memory_mask=attn_mask,
                                                                memory_key_padding_mask=None, pos=pos[level_index],
                                                                query_pos=query_embed)
            output = self.transformer_self_attention_layers[i](output, tgt_mask=None, tgt_key_padding_mask=None,
                                                               query_pos=query_embed)
            output = self.transformer_ffn_layers[i](output)
            outputs_class, outputs_mask, attn_mask = self.forward_prediction_heads(
                output, mask_features, attn_mask_target_size=size_list[(i + 1) % self.num_feature_levels])
            predictions_class.append(outputs_class)
            predictions_mask.append(outputs_mask)
        return predictions_class[-1], predictions_mask[-1]

    def forward_prediction_heads(self, output, mask_features, attn_mask_target_size):
        decoder_output = self.decoder_norm(output)
        decoder_output = decoder_output.transpose(0, 1)
        outputs_class = self.class_embed(decoder_output)
        mask_embed = self.mask_embed(decoder_output)
        outputs_mask = torch.einsum("bqc,bchw->bqhw", mask_embed, mask_features)
        # [B, Q, H, W] -> [B, Q, H*W] -> [B, h, Q, H*W] -> [B*h, Q, HW]
        attn_mask = F.interpolate(outputs_mask, size=attn_mask_target_size, mode="bilinear", align_corners=False)
        attn_mask = (attn_mask.sigmoid().flatten(2).unsqueeze(1).repeat(1, self.num_heads, 1, 1).flatten(0, 1) < 0.5).bool()
        attn_mask = attn_mask.detach()
        return outputs_class, outputs_mask, attn_mask


bs, C = 2, 32
feats = [torch.randn(bs, C, 4, 4), torch.randn(bs, C, 6, 6), torch.randn(bs, C, 8, 8)]   # low -> high resolution
mask_features = torch.randn(bs, C, 16, 16)
decoder = MultiScaleMaskedTransformerDecoder()
with torch.no_grad():   # make some queries predict empty masks, exercising the unblocking line
    decoder.mask_embed[2].bias.fill_(-2.0)
pred_logits, pred_masks = decoder(feats, mask_features)
target_masks = (torch.rand(bs, 10, 16, 16) > 0.5).float()
loss = F.binary_cross_entropy_with_logits(pred_masks, target_masks) + \
    F.cross_entropy(pred_logits.flatten(0, 1), torch.randint(0, 5, (bs * 10,)))
loss.backward()
print("mask2former loss %.4f" % loss.item())
