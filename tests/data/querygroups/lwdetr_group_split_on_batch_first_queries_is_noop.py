# Group DETR written the LW-DETR / RF-DETR way (a decoder layer holding `group_detr`, batch-first queries,
# nn.MultiheadAttention), in a port that copied the sequence-first split of detrex: in training the layer splits the
# queries along dim 0 and concatenates them along dim 1, but its queries are (batch, queries, dim), so the split cuts
# the batch of 2 images into one chunk and the concatenation is the tensor itself: the 4 groups stay in one sequence
# and every group attends to every other. The fix splits along the query axis (dim 1) into the batch (dim 0).
# The cross-attention reads a padded memory (two images of different sizes, a key padding mask).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class DecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, group_detr=1):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.ReLU(), nn.Linear(2 * d_model, d_model))
        self.group_detr = group_detr

    def forward(self, tgt, query_pos, memory, memory_key_padding_mask):
        bs, num_queries, _ = tgt.shape
        q = k = tgt + query_pos
        v = tgt
        if self.training:
            if FIXED:
                q = torch.cat(q.split(num_queries // self.group_detr, dim=1), dim=0)
                k = torch.cat(k.split(num_queries // self.group_detr, dim=1), dim=0)
                v = torch.cat(v.split(num_queries // self.group_detr, dim=1), dim=0)
            else:  # (the sequence-first split of detrex, on batch-first tensors)
                q = torch.cat(q.split(num_queries // self.group_detr, dim=0), dim=1)
                k = torch.cat(k.split(num_queries // self.group_detr, dim=0), dim=1)
                v = torch.cat(v.split(num_queries // self.group_detr, dim=0), dim=1)
        tgt2 = self.self_attn(q, k, v, need_weights=False)[0]
        if self.training and FIXED:
            tgt2 = torch.cat(tgt2.split(bs, dim=0), dim=1)
        tgt = self.norm1(tgt + tgt2)
        tgt2 = self.cross_attn(tgt + query_pos, memory, memory, key_padding_mask=memory_key_padding_mask,
                               need_weights=False)[0]
        tgt = self.norm2(tgt + tgt2)
        return tgt + self.ffn(tgt)


def main():
    torch.manual_seed(0)
    d_model, n_heads, num_queries, group_detr, bs = 32, 4, 3, 4, 2
    layer = DecoderLayer(d_model, n_heads, group_detr=group_detr)
    query_feat = nn.Embedding(num_queries * group_detr, d_model)
    query_pos = nn.Embedding(num_queries * group_detr, d_model)
    lengths = [20, 13]  # the two images' memory tokens; the second padded to 20
    memory = torch.randn(bs, max(lengths), d_model)
    pad = torch.arange(max(lengths))[None, :] >= torch.tensor(lengths)[:, None]  # True = padding
    tgt = query_feat.weight[None].repeat(bs, 1, 1)
    pos = query_pos.weight[None].repeat(bs, 1, 1)
    layer.train()
    with torch.no_grad():
        out = layer(tgt, pos, memory, pad)
        # each group decoded on its own: change the last group only, group 0 must not move
        tgt2 = tgt.clone()
        tgt2[:, -num_queries:] += torch.randn_like(tgt2[:, -num_queries:])
        out2 = layer(tgt2, pos, memory, pad)
    leak = (out2[:, :num_queries] - out[:, :num_queries]).abs().max().item()
    print(f"fixed={FIXED} group 0 output change when only the last group changes: {leak:.3e}")


if __name__ == "__main__":
    main()
