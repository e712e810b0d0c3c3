# EduKTM AKT (bigdata-ustc/EduKTM#39, #52, fixed by PR #53): in attention() the line
# `scores.masked_fill(mask == 0, -1e23)` discards its result, so the no-peek mask never reaches the softmax.
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.init import xavier_uniform_

FIXED = "--fixed" in sys.argv
device = torch.device("cpu")


class AKTNet(nn.Module):
    def __init__(self, n_question, d_model, n_blocks, kq_same, dropout, final_fc_dim=32, n_heads=2, d_ff=32):
        super(AKTNet, self).__init__()
        self.n_question = n_question
        self.q_embed = nn.Embedding(self.n_question + 1, d_model)
        self.qa_embed = nn.Embedding(2, d_model)
        self.model = Architecture(n_blocks, d_model, d_model // n_heads, d_ff, n_heads, dropout, kq_same)
        self.out = nn.Sequential(nn.Linear(d_model + d_model, final_fc_dim), nn.ReLU(), nn.Linear(final_fc_dim, 1))

    def forward(self, q_data, qa_data):
        q_embed_data = self.q_embed(q_data)
        qa_data = (qa_data - q_data) // self.n_question
        qa_embed_data = self.qa_embed(qa_data) + q_embed_data
        d_output = self.model(q_embed_data, qa_embed_data)
        concat_q = torch.cat([d_output, q_embed_data], dim=-1)
        return torch.sigmoid(self.out(concat_q)).squeeze(-1)


class Architecture(nn.Module):
    def __init__(self, n_blocks, d_model, d_feature, d_ff, n_heads, dropout, kq_same):
        super(Architecture, self).__init__()
        self.blocks_1 = nn.ModuleList([TransformerLayer(d_model, d_feature, d_ff, n_heads, dropout, kq_same)
                                       for _ in range(n_blocks)])
        self.blocks_2 = nn.ModuleList([TransformerLayer(d_model, d_feature, d_ff, n_heads, dropout, kq_same)
                                       for _ in range(n_blocks * 2)])

    def forward(self, q_embed_data, qa_embed_data):
        x = q_embed_data
        y = qa_embed_data
        for block in self.blocks_1:  # encode qas
            y = block(mask=1, query=y, key=y, values=y)
        flag_first = True
        for block in self.blocks_2:
            if flag_first:  # peek current question
                x = block(mask=1, query=x, key=x, values=x, apply_pos=False)
                flag_first = False
            else:  # dont peek current response
                x = block(mask=0, query=x, key=x, values=y, apply_pos=True)
                flag_first = True
        return x


class TransformerLayer(nn.Module):
    def __init__(self, d_model, d_feature, d_ff, n_heads, dropout, kq_same):
        super(TransformerLayer, self).__init__()
        self.masked_attn_head = MultiHeadAttention(d_model, d_feature, n_heads, dropout, kq_same=kq_same == 1)
        self.layer_norm1 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.layer_norm2 = nn.LayerNorm(d_model)

    def forward(self, mask, query, key, values, apply_pos=True):
        # mask: 0 means it can peek only past values, 1 means current and past values
        seqlen = query.size(1)
        nopeek_mask = np.triu(np.ones((1, 1, seqlen, seqlen)), k=mask).astype('uint8')
        src_mask = (torch.from_numpy(nopeek_mask) == 0).to(device)
        query2 = self.masked_attn_head(query, key, values, mask=src_mask, zero_pad=(mask == 0))
        query = self.layer_norm1(query + query2)
        if apply_pos:
            query = self.layer_norm2(query + self.linear2(F.relu(self.linear1(query))))
        return query


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, d_feature, n_heads, dropout, kq_same, bias=True):
        super(MultiHeadAttention, self).__init__()
        self.d_model, self.d_k, self.h, self.kq_same = d_model, d_feature, n_heads, kq_same
        self.v_linear = nn.Linear(d_model, d_model, bias=bias)
        self.k_linear = nn.Linear(d_model, d_model, bias=bias)
        if kq_same is False:
            self.q_linear = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.gammas = nn.Parameter(torch.zeros(n_heads, 1, 1))
        xavier_uniform_(self.gammas)

    def forward(self, q, k, v, mask, zero_pad):
        bs = q.size(0)
        k = self.k_linear(k).view(bs, -1, self.h, self.d_k).transpose(1, 2)
        q = (self.k_linear(q) if self.kq_same else self.q_linear(q)).view(bs, -1, self.h, self.d_k).transpose(1, 2)
        v = self.v_linear(v).view(bs, -1, self.h, self.d_k).transpose(1, 2)
        scores = attention(q, k, v, self.d_k, mask, self.dropout, zero_pad, self.gammas)
        concat = scores.transpose(1, 2).contiguous().view(bs, -1, self.d_model)
        return self.out_proj(concat)


def attention(q, k, v, d_k, mask, dropout, zero_pad, gamma=None):
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d_k)
    bs, head, seqlen = scores.size(0), scores.size(1), scores.size(2)
    x1 = torch.arange(seqlen).expand(seqlen, -1).to(device)
    x2 = x1.transpose(0, 1).contiguous()
    with torch.no_grad():
        scores_ = scores.masked_fill(mask == 0, -1e32)
        scores_ = F.softmax(scores_, dim=-1)
        scores_ = scores_ * mask.float().to(device)
        distcum_scores = torch.cumsum(scores_, dim=-1)
        disttotal_scores = torch.sum(scores_, dim=-1, keepdim=True)
        position_effect = torch.abs(x1 - x2)[None, None, :, :].type(torch.FloatTensor).to(device)
        dist_scores = torch.clamp((disttotal_scores - distcum_scores) * position_effect, min=0.)
        dist_scores = dist_scores.sqrt().detach()
    m = nn.Softplus()
    gamma = -1. * m(gamma).unsqueeze(0)
    total_effect = torch.clamp(torch.clamp((dist_scores * gamma).exp(), min=1e-5), max=1e5)
    scores = scores * total_effect

    if FIXED:
        scores.masked_fill_(mask == 0, -1e23)
    else:
        scores.masked_fill(mask == 0, -1e23)
    scores = F.softmax(scores, dim=-1)
    if zero_pad:
        pad_zero = torch.zeros(bs, head, 1, seqlen).to(device)
        scores = torch.cat([pad_zero, scores[:, :, 1:, :]], dim=2)
    scores = dropout(scores)
    return torch.matmul(scores, v)


if __name__ == "__main__":
    torch.manual_seed(0)
    n_question, seqlen = 10, 8
    model = AKTNet(n_question, d_model=16, n_blocks=1, kq_same=1, dropout=0.0).eval()
    q_data = torch.randint(1, n_question + 1, (2, seqlen))
    r = torch.randint(0, 2, (2, seqlen))
    qa_data = q_data + r * n_question
    r_flip = r.clone()
    r_flip[:, 4:] = 1 - r_flip[:, 4:]          # change only the responses from step 4 on
    qa_flip = q_data + r_flip * n_question
    with torch.no_grad():
        p = model(q_data, qa_data)
        p_flip = model(q_data, qa_flip)
    # predictions for steps 0..4 must not depend on responses at steps >= 4
    leak = (p[:, :5] - p_flip[:, :5]).abs().max().item()
    print(f"fixed={FIXED} change of predictions at t<=4 after flipping future responses: {leak:.6f}")
