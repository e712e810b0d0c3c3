"""A BERT-style encoder over a right-padded batch that runs a varlen kernel (a plain-torch stand-in for
flash_attn_varlen_func: one SDPA call per document, the tokens past the last document left zero) on the batch's
real tokens, unpadded by its attention_mask; its cumulative lengths are made from the first row's length repeated
for every row, so the longer second row's last tokens fall outside every document and attend nothing.
--fixed: the lengths are each row's own (attention_mask.sum(-1))."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def varlen_attention(q, k, v, cu_seqlens):
    """(T, H, D) packed tokens; each document [cu[i], cu[i+1]) attends within itself; tokens past cu[-1] give 0."""
    out = torch.zeros_like(q)
    for i in range(len(cu_seqlens) - 1):
        a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                  v[a:b].transpose(0, 1)).transpose(0, 1)
    return out


class SelfAttention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, hidden, indices, cu_seqlens):
        b, l, d = hidden.shape
        packed = hidden.reshape(b * l, d)[indices]
        q, k, v = self.qkv(packed).view(len(indices), 3, self.heads, d // self.heads).unbind(1)
        attended = varlen_attention(q, k, v, cu_seqlens).reshape(len(indices), d)
        full = torch.zeros(b * l, d)
        full[indices] = self.out(attended)
        return full.view(b, l, d)


class Encoder(torch.nn.Module):
    def __init__(self, vocab=50, dim=16, heads=2, layers=2, pad_token_id=0):
        super().__init__()
        self.pad_token_id = pad_token_id
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=pad_token_id)
        self.layers = torch.nn.ModuleList(SelfAttention(dim, heads) for _ in range(layers))

    def forward(self, input_ids, attention_mask):
        hidden = self.embed(input_ids)
        indices = torch.nonzero(attention_mask.flatten()).flatten()
        if FIXED:
            seqlens = attention_mask.sum(-1)
        else:
            seqlens = attention_mask[0].sum().repeat(input_ids.shape[0])
        cu_seqlens = F.pad(torch.cumsum(seqlens, 0), (1, 0)).to(torch.int32)
        for layer in self.layers:
            hidden = hidden + layer(hidden, indices, cu_seqlens)
        return (hidden * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)


torch.manual_seed(0)
ids = torch.tensor([[5, 9, 13, 0, 0, 0], [7, 3, 22, 41, 8, 30]])
with torch.no_grad():
    pooled = Encoder()(ids, (ids != 0).long())
print("pooled norms:", [round(x, 4) for x in pooled.norm(dim=-1).tolist()])
