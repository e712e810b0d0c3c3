"""fastNLP StarTransformer: the relay node's attention masks the real tokens, not the padding (fastNLP#138).

Citation: FudanNLP/fastNLP#138 ("masked_fill bug in star-transformer!"), fixed by PR
FudanNLP/fastNLP#139, commit b7008cba7800a2140bcbaec14370f36862c3eb7c ("fix mask bug in
star-transformer"). Read from the fastNLP git history (commits 7c7f28f2 and b7008cba).

Bug: ``StarTransformer.forward(data, mask)`` documents ``mask`` as the padding mask "in which
padding pos is 0" (1 for real tokens), and built the star attention's mask straight from it:
``smask = torch.cat([torch.zeros(B, 1).byte().to(mask), mask], 1)``. ``_MSA2`` then does
``pre_a.masked_fill(mask[:, None, None, :], -inf)``, so the relay node's attention over
[relay, nodes] hid every real token and attended only itself and the padding satellites
(and ``nodes.masked_fill_(ex_mask, 0)`` zeroed the real nodes each layer).

Fix: flip the mask first, ``mask = (mask == 0)  # flip the mask for masked_fill_``.

Reproduction: the StarTransformer encoder as fastNLP wrote it (the MSA1 ring attention over
a 3-wide unfold plus the relay, the MSA2 star attention of the relay over all nodes), a batch
of two sequences of lengths 6 and 4 padded to 6, mask from the lengths (1 = token). _MSA2 here
takes v from WV (the later fix 28d3f500 of a separate k/v mix-up), so only the mask differs.
"""
import sys

import numpy as NP
import torch
from torch import nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv


class StarTransformer(nn.Module):
    """Star-Transformer Encoder part. paper: https://arxiv.org/abs/1902.09113"""

    def __init__(self, hidden_size, num_layers, num_head, head_dim, dropout=0.1, max_len=None):
        super(StarTransformer, self).__init__()
        self.iters = num_layers
        self.norm = nn.ModuleList([nn.LayerNorm(hidden_size) for _ in range(self.iters)])
        self.ring_att = nn.ModuleList(
            [MSA1(hidden_size, nhead=num_head, head_dim=head_dim, dropout=dropout) for _ in range(self.iters)])
        self.star_att = nn.ModuleList(
            [MSA2(hidden_size, nhead=num_head, head_dim=head_dim, dropout=dropout) for _ in range(self.iters)])
        if max_len is not None:
            self.pos_emb = nn.Embedding(max_len, hidden_size)
        else:
            self.pos_emb = None

    def forward(self, data, mask):
        """
        :param FloatTensor data: [batch, length, hidden] the input sequence
        :param mask: [batch, length] the padding mask for input, in which padding pos is 0
        :return: [batch, length, hidden] the output sequence, [batch, hidden] the global relay node
        """
        def norm_func(f, x):
            # B, H, L, 1
            return f(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

        B, L, H = data.size()
        if FIXED:
            mask = (mask == 0)  # flip the mask for masked_fill_
        smask = torch.cat([torch.zeros(B, 1, ).byte().to(mask), mask], 1)

        embs = data.permute(0, 2, 1)[:, :, :, None]  # B H L 1
        if self.pos_emb:
            P = self.pos_emb(torch.arange(L, dtype=torch.long, device=embs.device)
                             .view(1, L)).permute(0, 2, 1).contiguous()[:, :, :, None]  # 1 H L 1
            embs = embs + P

        nodes = embs
        relay = embs.mean(2, keepdim=True)
        ex_mask = mask[:, None, :, None].expand(B, H, L, 1)
        r_embs = embs.view(B, H, 1, L)
        for i in range(self.iters):
            ax = torch.cat([r_embs, relay.expand(B, H, 1, L)], 2)
            nodes = nodes + F.leaky_relu(self.ring_att[i](norm_func(self.norm[i], nodes), ax=ax))
            relay = F.leaky_relu(self.star_att[i](relay, torch.cat([relay, nodes], 2), smask))
            nodes = nodes.masked_fill_(ex_mask, 0)

        nodes = nodes.view(B, H, L).permute(0, 2, 1)
        return nodes, relay.view(B, H)


class MSA1(nn.Module):
    def __init__(self, nhid, nhead=10, head_dim=10, dropout=0.1):
        super(MSA1, self).__init__()
        # Multi-head Self Attention Case 1, doing self-attention for small regions
        self.WQ = nn.Conv2d(nhid, nhead * head_dim, 1)
        self.WK = nn.Conv2d(nhid, nhead * head_dim, 1)
        self.WV = nn.Conv2d(nhid, nhead * head_dim, 1)
        self.WO = nn.Conv2d(nhead * head_dim, nhid, 1)
        self.drop = nn.Dropout(dropout)
        self.nhid, self.nhead, self.head_dim, self.unfold_size = nhid, nhead, head_dim, 3

    def forward(self, x, ax=None):
        # x: B, H, L, 1, ax : B, H, X, L append features
        nhid, nhead, head_dim, unfold_size = self.nhid, self.nhead, self.head_dim, self.unfold_size
        B, H, L, _ = x.shape
        q, k, v = self.WQ(x), self.WK(x), self.WV(x)  # x: (B,H,L,1)
        if ax is not None:
            aL = ax.shape[2]
            ak = self.WK(ax).view(B, nhead, head_dim, aL, L)
            av = self.WV(ax).view(B, nhead, head_dim, aL, L)
        q = q.view(B, nhead, head_dim, 1, L)
        k = F.unfold(k.view(B, nhead * head_dim, L, 1), (unfold_size, 1), padding=(unfold_size // 2, 0)) \
            .view(B, nhead, head_dim, unfold_size, L)
        v = F.unfold(v.view(B, nhead * head_dim, L, 1), (unfold_size, 1), padding=(unfold_size // 2, 0)) \
            .view(B, nhead, head_dim, unfold_size, L)
        if ax is not None:
            k = torch.cat([k, ak], 3)
            v = torch.cat([v, av], 3)
        alphas = self.drop(F.softmax((q * k).sum(2, keepdim=True) / NP.sqrt(head_dim), 3))  # B N L 1 U
        att = (alphas * v).sum(3).view(B, nhead * head_dim, L, 1)
        return self.WO(att)


class MSA2(nn.Module):
    def __init__(self, nhid, nhead=10, head_dim=10, dropout=0.1):
        # Multi-head Self Attention Case 2, a broadcastable query for a sequence key and value
        super(MSA2, self).__init__()
        self.WQ = nn.Conv2d(nhid, nhead * head_dim, 1)
        self.WK = nn.Conv2d(nhid, nhead * head_dim, 1)
        self.WV = nn.Conv2d(nhid, nhead * head_dim, 1)
        self.WO = nn.Conv2d(nhead * head_dim, nhid, 1)
        self.drop = nn.Dropout(dropout)
        self.nhid, self.nhead, self.head_dim, self.unfold_size = nhid, nhead, head_dim, 3

    def forward(self, x, y, mask=None):
        # x: B, H, 1, 1, 1 y: B H L 1
        nhid, nhead, head_dim, unfold_size = self.nhid, self.nhead, self.head_dim, self.unfold_size
        B, H, L, _ = y.shape
        q, k, v = self.WQ(x), self.WK(y), self.WV(y)
        q = q.view(B, nhead, 1, head_dim)  # B, H, 1, 1 -> B, N, 1, h
        k = k.view(B, nhead, head_dim, L)  # B, H, L, 1 -> B, N, h, L
        v = v.view(B, nhead, head_dim, L).permute(0, 1, 3, 2)  # B, H, L, 1 -> B, N, L, h
        pre_a = torch.matmul(q, k) / NP.sqrt(head_dim)
        if mask is not None:
            pre_a = pre_a.masked_fill(mask[:, None, None, :], -float('inf'))
        alphas = self.drop(F.softmax(pre_a, 3))  # B, N, 1, L
        att = torch.matmul(alphas, v).view(B, -1, 1, 1)  # B, N, 1, h -> B, N*h, 1, 1
        return self.WO(att)


def seq_len_to_mask(seq_len, max_len=None):
    max_len = int(max_len) if max_len else int(seq_len.max())
    broad_cast_seq_len = torch.arange(max_len).expand(seq_len.size(0), -1).to(seq_len)
    return broad_cast_seq_len.lt(seq_len.unsqueeze(1))


def main():
    torch.manual_seed(0)
    hidden = 16
    embed = nn.Embedding(20, hidden, padding_idx=0)
    encoder = StarTransformer(hidden_size=hidden, num_layers=2, num_head=2, head_dim=8, dropout=0.0, max_len=8)
    encoder.eval()
    words = torch.tensor([[3, 5, 7, 2, 9, 4], [6, 8, 1, 11, 0, 0]])
    seq_len = torch.tensor([6, 4])
    mask = seq_len_to_mask(seq_len, max_len=words.size(1))
    with torch.no_grad():
        nodes, relay = encoder(embed(words), mask)
    print("nodes", tuple(nodes.shape), "relay norm", [round(float(r), 3) for r in relay.norm(dim=-1)])


if __name__ == "__main__":
    main()
