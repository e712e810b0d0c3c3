# dmlc/dgl#2657 (fixed in dmlc/dgl#2658, commit 174dd18905): MultiHeadAttention in dgl.nn.pytorch.glob pads the
# nodes of each graph and masks with -inf over (query, key) pairs, so the padded node rows of smaller graphs are
# fully masked: softmax gives NaN rows and training the SetTransformer readout gets NaN gradients.
import sys

import numpy as np
import torch as th
import torch.nn as nn

FIXED = "--fixed" in sys.argv
th.manual_seed(0)


def pad_packed_tensor(input, lengths, value):
    """dgl.backend.pytorch.pad_packed_tensor: (sum(lengths), ...) -> (B, max_len, ...)"""
    out = input.new_full((len(lengths), max(lengths)) + tuple(input.shape[1:]), value)
    offset = 0
    for i, n in enumerate(lengths):
        out[i, :n] = input[offset:offset + n]
        offset += n
    return out


def pack_padded_tensor(input, lengths):
    return th.cat([input[i, :n] for i, n in enumerate(lengths)], dim=0)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads, d_head, d_ff, dropouth=0., dropouta=0.):
        super(MultiHeadAttention, self).__init__()
        self.d_model, self.num_heads, self.d_head, self.d_ff = d_model, num_heads, d_head, d_ff
        self.proj_q = nn.Linear(d_model, num_heads * d_head, bias=False)
        self.proj_k = nn.Linear(d_model, num_heads * d_head, bias=False)
        self.proj_v = nn.Linear(d_model, num_heads * d_head, bias=False)
        self.proj_o = nn.Linear(num_heads * d_head, d_model, bias=False)
        self.ffn = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Dropout(dropouth), nn.Linear(d_ff, d_model))
        self.norm_in = nn.LayerNorm(d_model)
        self.norm_inter = nn.LayerNorm(d_model)

    def forward(self, x, mem, lengths_x, lengths_mem):
        batch_size = len(lengths_x)
        max_len_x = max(lengths_x)
        max_len_mem = max(lengths_mem)
        queries = self.proj_q(x).view(-1, self.num_heads, self.d_head)
        keys = self.proj_k(mem).view(-1, self.num_heads, self.d_head)
        values = self.proj_v(mem).view(-1, self.num_heads, self.d_head)
        # padding to (B, max_len_x/mem, num_heads, d_head)
        queries = pad_packed_tensor(queries, lengths_x, 0)
        keys = pad_packed_tensor(keys, lengths_mem, 0)
        values = pad_packed_tensor(values, lengths_mem, 0)
        # attention score with shape (B, num_heads, max_len_x, max_len_mem)
        e = th.einsum('bxhd,byhd->bhxy', queries, keys)
        e = e / np.sqrt(self.d_head)
        # generate mask
        mask = th.zeros(batch_size, max_len_x, max_len_mem).to(e.device)
        for i in range(batch_size):
            mask[i, :lengths_x[i], :lengths_mem[i]].fill_(1)
        mask = mask.unsqueeze(1)
        e.masked_fill_(mask == 0, -float('inf'))
        # apply softmax
        alpha = th.softmax(e, dim=-1)
        if FIXED:
            # the following line addresses the NaN issue, see https://github.com/dmlc/dgl/issues/2657
            alpha = alpha.masked_fill(mask == 0, 0.)
        # sum of value weighted by alpha
        out = th.einsum('bhxy,byhd->bxhd', alpha, values)
        out = self.proj_o(out.contiguous().view(batch_size, max_len_x, self.num_heads * self.d_head))
        out = pack_padded_tensor(out, lengths_x)
        x = self.norm_in(x + out)
        x = self.norm_inter(x + self.ffn(x))
        return x


class SetAttentionBlock(nn.Module):
    def __init__(self, d_model, num_heads, d_head, d_ff):
        super(SetAttentionBlock, self).__init__()
        self.mha = MultiHeadAttention(d_model, num_heads, d_head, d_ff)

    def forward(self, feat, lengths):
        return self.mha(feat, feat, lengths, lengths)


class SetTransformerEncoder(nn.Module):
    def __init__(self, d_model, n_heads, d_head, d_ff, n_layers=2):
        super(SetTransformerEncoder, self).__init__()
        self.layers = nn.ModuleList(SetAttentionBlock(d_model, n_heads, d_head, d_ff) for _ in range(n_layers))

    def forward(self, batch_num_nodes, feat):
        lengths = batch_num_nodes
        for layer in self.layers:
            feat = layer(feat, lengths)
        return feat


class GraphClassifier(nn.Module):
    def __init__(self, in_feats=8, d_model=16):
        super().__init__()
        self.embed = nn.Linear(in_feats, d_model)
        self.encoder = SetTransformerEncoder(d_model, n_heads=2, d_head=8, d_ff=32)
        self.head = nn.Linear(d_model, 1)

    def forward(self, batch_num_nodes, feat):
        h = self.encoder(batch_num_nodes, self.embed(feat))
        hg = th.stack([seg.mean(0) for seg in th.split(h, batch_num_nodes)])  # mean readout per graph
        return self.head(hg).squeeze(-1)


model = GraphClassifier()
# a batched graph of three molecules with 5, 3 and 4 atoms (bg.batch_num_nodes())
batch_num_nodes = [5, 3, 4]
feat = th.randn(sum(batch_num_nodes), 8)
labels = th.tensor([1.0, 0.0, 1.0])
logits = model(batch_num_nodes, feat)
loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
loss.backward()
grad_norm = th.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None)).item()
print(f"fixed={FIXED} loss={loss.item():.4f} grad norm={grad_norm:.4f}")
