"""DETR decoder: 100 object queries cross-attend to a padded image memory.

Follows facebookresearch/detr models/transformer.py (TransformerDecoderLayer.forward_post,
Transformer.forward). The decoder self-attention over the object queries is unmasked (queries are a set,
no order); the cross-attention uses `memory_key_padding_mask` from the NestedTensor mask so that the
padded pixels of the smaller image in the batch are never attended. There are more queries (100) than
memory positions of the small image (6x5=30 valid of 8x8=64): that is the point of DETR.
"""
import torch
from torch import nn


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=64, dropout=0.0):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.multihead_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)

    @staticmethod
    def with_pos_embed(tensor, pos):
        return tensor if pos is None else tensor + pos

    def forward(self, tgt, memory, memory_key_padding_mask=None, pos=None, query_pos=None):
        q = k = self.with_pos_embed(tgt, query_pos)
        tgt2 = self.self_attn(q, k, value=tgt)[0]
        tgt = self.norm1(tgt + tgt2)
        tgt2 = self.multihead_attn(query=self.with_pos_embed(tgt, query_pos),
                                   key=self.with_pos_embed(memory, pos),
                                   value=memory, key_padding_mask=memory_key_padding_mask)[0]
        tgt = self.norm2(tgt + tgt2)
        tgt2 = self.linear2(torch.relu(self.linear1(tgt)))
        return self.norm3(tgt + tgt2)


def main():
    torch.manual_seed(0)
    d_model, nhead, num_queries = 32, 4, 100
    bs, h, w = 2, 8, 8
    src = torch.randn(bs, d_model, h, w)
    # NestedTensor mask: True where the pixel is padding (image 1 is 6x5, padded to 8x8)
    mask = torch.zeros(bs, h, w, dtype=torch.bool)
    mask[1, 6:, :] = True
    mask[1, :, 5:] = True
    pos_embed = torch.randn(bs, d_model, h, w)
    query_embed = nn.Embedding(num_queries, d_model)

    memory = src.flatten(2).permute(2, 0, 1)            # HWxNxC
    pos = pos_embed.flatten(2).permute(2, 0, 1)
    query_pos = query_embed.weight.unsqueeze(1).repeat(1, bs, 1)
    mask = mask.flatten(1)
    tgt = torch.zeros_like(query_pos)

    layers = nn.ModuleList([TransformerDecoderLayer(d_model, nhead) for _ in range(2)]).eval()
    with torch.no_grad():
        out = tgt
        for layer in layers:
            out = layer(out, memory, memory_key_padding_mask=mask, pos=pos, query_pos=query_pos)
    print("hs", tuple(out.transpose(0, 1).shape))


if __name__ == "__main__":
    main()
