"""AKT (Ghosh et al. 2020) as pykt-toolkit writes it: pykt/models/akt.py, Architecture.forward,
TransformerLayer.forward and attention().

Intent kept as the project keeps it:
  * blocks_1 (question-response encoder) and the first block of each blocks_2 pair use
    nopeek_mask = np.triu(ones, k=1): a position sees itself and the past;
  * the knowledge retriever block uses np.triu(ones, k=0) ("dont peek current response"):
    a question at t sees the responses strictly before t. Row 0 then has no key at all;
    AKT fills that row's weights with zeros (zero_pad=True) after the softmax, so the
    first question is predicted from its own embedding only.
  * pykt pads interaction sequences on the right and masks padded steps out of the loss only.

Checks: (1) the prediction at t does not change when the response at t (or later) changes;
(2) each padded row equals that learner's sequence run alone, unpadded;
(3) the prediction at position 0 equals the retriever fed no attention output (out_proj(0)).
"""
import math
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
NQ, D, H, DFF = 12, 32, 4, 64


def attention(q, k, v, d_k, mask, zero_pad, gamma):
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d_k)
    bs, head, seqlen = scores.size(0), scores.size(1), scores.size(2)
    x1 = torch.arange(seqlen).expand(seqlen, -1)
    x2 = x1.transpose(0, 1).contiguous()
    with torch.no_grad():
        scores_ = scores.masked_fill(mask == 0, -1e32)
        scores_ = F.softmax(scores_, dim=-1)
        scores_ = scores_ * mask.double()
        distcum_scores = torch.cumsum(scores_, dim=-1)
        disttotal_scores = torch.sum(scores_, dim=-1, keepdim=True)
        position_effect = torch.abs(x1 - x2)[None, None, :, :].double()
        dist_scores = torch.clamp((disttotal_scores - distcum_scores) * position_effect, min=0.)
        dist_scores = dist_scores.sqrt().detach()
    gamma = -1. * F.softplus(gamma).unsqueeze(0)
    total_effect = torch.clamp(torch.clamp((dist_scores * gamma).exp(), min=1e-5), max=1e5)
    scores = scores * total_effect
    scores = scores.masked_fill(mask == 0, -1e32)
    scores = F.softmax(scores, dim=-1)
    if zero_pad:
        pad_zero = torch.zeros(bs, head, 1, seqlen)
        scores = torch.cat([pad_zero, scores[:, :, 1:, :]], dim=2)
    return torch.matmul(scores, v)


class MultiHeadAttention(nn.Module):  # kq_same=1
    def __init__(self):
        super().__init__()
        self.k_linear, self.v_linear, self.out_proj = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.gammas = nn.Parameter(torch.randn(H, 1, 1))

    def forward(self, q, k, v, mask, zero_pad):
        bs = q.size(0)
        k = self.k_linear(k).view(bs, -1, H, D // H).transpose(1, 2)
        q = self.k_linear(q).view(bs, -1, H, D // H).transpose(1, 2)
        v = self.v_linear(v).view(bs, -1, H, D // H).transpose(1, 2)
        out = attention(q, k, v, D // H, mask, zero_pad, self.gammas)
        return self.out_proj(out.transpose(1, 2).contiguous().view(bs, -1, D))


class TransformerLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.masked_attn_head = MultiHeadAttention()
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.linear1, self.linear2 = nn.Linear(D, DFF), nn.Linear(DFF, D)
        self.zero_attn = False  # for check (3) only

    def forward(self, mask, query, key, values, apply_pos=True):
        seqlen = query.size(1)
        nopeek_mask = np.triu(np.ones((1, 1, seqlen, seqlen)), k=mask).astype('uint8')
        src_mask = (torch.from_numpy(nopeek_mask) == 0)
        query2 = self.masked_attn_head(query, key, values, mask=src_mask, zero_pad=(mask == 0))
        if self.zero_attn:
            # all-zero weights: the head outputs 0, so only out_proj's bias remains
            query2 = self.masked_attn_head.out_proj.bias.expand_as(query2)
        query = self.layer_norm1(query + query2)
        if apply_pos:
            query = self.layer_norm2(query + self.linear2(F.relu(self.linear1(query))))
        return query


class AKT(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_embed, self.qa_embed = nn.Embedding(NQ, D), nn.Embedding(2 * NQ, D)
        self.blocks_1 = nn.ModuleList([TransformerLayer()])
        self.blocks_2 = nn.ModuleList([TransformerLayer(), TransformerLayer()])
        self.out = nn.Sequential(nn.Linear(2 * D, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, q, r):
        x = q_embed = self.q_embed(q)
        y = self.qa_embed(q + NQ * r)
        for block in self.blocks_1:
            y = block(mask=1, query=y, key=y, values=y)
        flag_first = True
        for block in self.blocks_2:
            if flag_first:
                x = block(mask=1, query=x, key=x, values=x, apply_pos=False)
                flag_first = False
            else:
                x = block(mask=0, query=x, key=x, values=y, apply_pos=True)
                flag_first = True
        return torch.sigmoid(self.out(torch.cat([x, q_embed], -1))).squeeze(-1)


model = AKT().eval()
lens = [11, 7, 4]
L = max(lens)
q = torch.zeros(3, L, dtype=torch.long)
r = torch.zeros(3, L, dtype=torch.long)
sm = torch.zeros(3, L, dtype=torch.bool)  # pykt's "masks" / sm: which steps are real
seqs = []
for b, n in enumerate(lens):
    qs, rs = torch.randint(0, NQ, (n,)), torch.randint(0, 2, (n,))
    q[b, :n], r[b, :n], sm[b, :n] = qs, rs, True
    seqs.append((qs, rs))

with torch.no_grad():
    pred = model(q, r)
    # (1) strictly past responses: flipping r_t changes nothing at steps <= t
    d1 = 0.0
    for t in range(L):
        r2 = r.clone()
        r2[:, t:] = 1 - r2[:, t:]
        d1 = max(d1, (model(q, r2)[:, :t + 1] - pred[:, :t + 1]).abs().max().item())
    # (2) each learner alone, unpadded
    d2 = max((model(qs[None], rs[None])[0] - pred[b, :len(qs)]).abs().max().item()
             for b, (qs, rs) in enumerate(seqs))
    # (3) first question: the retriever's zero-padded row behaves as "no attention output"
    model.blocks_2[1].zero_attn = True
    p0 = model(q, r)[:, 0]
    model.blocks_2[1].zero_attn = False
    d3 = (p0 - pred[:, 0]).abs().max().item()
    # the loss pykt computes, over real steps only
    y = torch.randint(0, 2, (3, L)).double()
    loss = F.binary_cross_entropy(torch.masked_select(pred, sm), torch.masked_select(y, sm))

print(f"strict past: max change at steps <= t when r[t:] flips = {d1:.3e}")
print(f"padded batch vs each learner alone: max diff = {d2:.3e}")
print(f"row 0 vs zero attention output: max diff = {d3:.3e}; masked loss = {loss.item():.4f}")
assert d1 < 1e-12 and d2 < 1e-9 and d3 < 1e-12
