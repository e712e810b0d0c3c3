# pykt-team/pykt-toolkit commit b602c92f492b608e0db85e31007b311456d91899 ("fix sparsekt").
# sparseKT's top-k attention ("qid_sparseattn") ran a second F.softmax over the masked-softmax probabilities of the
# first k_index query rows, so their masked current/future keys (probability 0) got weight exp(0) again: early
# interactions attended to future responses. The fix re-softmaxes only the top-k thresholded rows.
import argparse
import math
import sys
from enum import IntEnum

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import binary_cross_entropy
from torch.nn.init import constant_, xavier_uniform_

FIXED = "--fixed" in sys.argv
device = torch.device("cpu")


class Dim(IntEnum):
    batch = 0
    seq = 1
    feature = 2


class sparseKT(nn.Module):
    def __init__(self, n_question, n_pid, d_model, n_blocks, dropout, d_ff=256, seq_len=200,
                 kq_same=1, final_fc_dim=512, final_fc_dim2=256, num_attn_heads=8, separate_qa=False,
                 l2=1e-5, emb_type="qid", sparse_ratio=0.8, k_index=5, stride=1):
        super().__init__()
        self.model_name = "sparsekt"
        self.n_question = n_question
        self.dropout = dropout
        self.kq_same = kq_same
        self.n_pid = n_pid
        self.l2 = l2
        self.model_type = self.model_name
        self.separate_qa = separate_qa
        self.emb_type = emb_type
        self.sparse_ratio = sparse_ratio
        self.k_index = k_index
        self.stride = stride

        embed_l = d_model
        if self.n_pid > 0:
            self.difficult_param = nn.Embedding(self.n_pid + 1, embed_l)
            self.q_embed_diff = nn.Embedding(self.n_question + 1, embed_l)
            self.qa_embed_diff = nn.Embedding(2 * self.n_question + 1, embed_l)

        if emb_type.startswith("qid"):
            self.q_embed = nn.Embedding(self.n_question, embed_l)
            if self.separate_qa:
                self.qa_embed = nn.Embedding(2 * self.n_question + 1, embed_l)
            else:
                self.qa_embed = nn.Embedding(2, embed_l)
        self.model = Architecture(n_question=n_question, n_blocks=n_blocks, n_heads=num_attn_heads, dropout=dropout,
                                  d_model=d_model, d_feature=d_model / num_attn_heads, d_ff=d_ff, kq_same=self.kq_same,
                                  model_type=self.model_type, seq_len=seq_len)

        self.out = nn.Sequential(
            nn.Linear(d_model + embed_l, final_fc_dim), nn.ReLU(), nn.Dropout(self.dropout),
            nn.Linear(final_fc_dim, final_fc_dim2), nn.ReLU(), nn.Dropout(self.dropout),
            nn.Linear(final_fc_dim2, 1)
        )
        self.reset()

    def reset(self):
        for p in self.parameters():
            if p.size(0) == self.n_pid + 1 and self.n_pid > 0:
                torch.nn.init.constant_(p, 0.)

    def base_emb(self, q_data, target):
        q_embed_data = self.q_embed(q_data)
        if self.separate_qa:
            qa_data = q_data + self.n_question * target
            qa_embed_data = self.qa_embed(qa_data)
        else:
            qa_embed_data = self.qa_embed(target) + q_embed_data
        return q_embed_data, qa_embed_data

    def forward(self, dcur, qtest=False, train=False):
        q, c, r = dcur["qseqs"].long(), dcur["cseqs"].long(), dcur["rseqs"].long()
        qshft, cshft, rshft = dcur["shft_qseqs"].long(), dcur["shft_cseqs"].long(), dcur["shft_rseqs"].long()
        pid_data = torch.cat((q[:, 0:1], qshft), dim=1)
        q_data = torch.cat((c[:, 0:1], cshft), dim=1)
        target = torch.cat((r[:, 0:1], rshft), dim=1)

        emb_type = self.emb_type
        sparse_ratio = self.sparse_ratio
        k_index = self.k_index
        stride = self.stride
        n_question = self.n_question

        if emb_type.startswith("qid"):
            q_embed_data, qa_embed_data = self.base_emb(q_data, target)
        if self.n_pid > 0 and emb_type.find("norasch") == -1:
            q_embed_diff_data = self.q_embed_diff(q_data)
            pid_embed_data = self.difficult_param(pid_data)
            q_embed_data = q_embed_data + pid_embed_data * q_embed_diff_data

        y2, y3 = 0, 0
        if emb_type.find("attn") != -1:
            d_output, attn_weights = self.model(q_embed_data, qa_embed_data, emb_type, sparse_ratio, k_index,
                                                None, stride, q_data=q_data, n_question=n_question)
            self.attn_weights = attn_weights

            concat_q = torch.cat([d_output, q_embed_data], dim=-1)
            output = self.out(concat_q).squeeze(-1)
            m = nn.Sigmoid()
            preds = m(output)

        if train:
            return preds, y2, y3
        else:
            if qtest:
                return preds, concat_q
            else:
                return preds


class Architecture(nn.Module):
    def __init__(self, n_question, n_blocks, d_model, d_feature, d_ff, n_heads, dropout, kq_same, model_type, seq_len):
        super().__init__()
        self.d_model = d_model
        self.model_type = model_type

        if model_type in {'sparsekt'}:
            self.blocks_2 = nn.ModuleList([
                TransformerLayer(d_model=d_model, d_feature=d_model // n_heads,
                                 d_ff=d_ff, dropout=dropout, n_heads=n_heads, kq_same=kq_same)
                for _ in range(n_blocks)
            ])
        self.position_emb = CosinePositionalEmbedding(d_model=self.d_model, max_len=seq_len)

    def forward(self, q_embed_data, qa_embed_data, emb_type="qid", sparse_ratio=0.8, k_index=5, attn_grads=None,
                stride=1, q_data=None, n_question=None):
        q_posemb = self.position_emb(q_embed_data)
        q_embed_data = q_embed_data + q_posemb
        qa_posemb = self.position_emb(qa_embed_data)
        qa_embed_data = qa_embed_data + qa_posemb

        qa_pos_embed = qa_embed_data
        q_pos_embed = q_embed_data

        y = qa_pos_embed
        x = q_pos_embed

        for block in self.blocks_2:
            x, attn_weights = block(mask=0, query=x, key=x, values=y, apply_pos=True, emb_type=emb_type,
                                    sparse_ratio=sparse_ratio, k_index=k_index, attn_grads=attn_grads, stride=stride,
                                    q_data=q_data, n_question=n_question)
        return x, attn_weights


class TransformerLayer(nn.Module):
    def __init__(self, d_model, d_feature, d_ff, n_heads, dropout, kq_same):
        super().__init__()
        kq_same = kq_same == 1
        self.masked_attn_head = MultiHeadAttention(d_model, d_feature, n_heads, dropout, kq_same=kq_same)

        self.layer_norm1 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)

        self.linear1 = nn.Linear(d_model, d_ff)
        self.activation = nn.ReLU()
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ff, d_model)

        self.layer_norm2 = nn.LayerNorm(d_model)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, mask, query, key, values, apply_pos=True, emb_type="qid", sparse_ratio=0.8, k_index=5,
                attn_grads=None, stride=1, q_data=None, n_question=None):
        seqlen, batch_size = query.size(1), query.size(0)
        nopeek_mask = np.triu(np.ones((1, 1, seqlen, seqlen)), k=mask).astype('uint8')
        src_mask = (torch.from_numpy(nopeek_mask) == 0).to(device)
        if mask == 0:
            query2, _ = self.masked_attn_head(
                query, key, values, mask=src_mask, zero_pad=True, emb_type=emb_type, sparse_ratio=sparse_ratio,
                k_index=k_index, attn_grads=attn_grads, stride=stride, q_data=q_data, n_question=n_question)
        else:
            query2, _ = self.masked_attn_head(
                query, key, values, mask=src_mask, zero_pad=False, emb_type=emb_type, sparse_ratio=sparse_ratio,
                k_index=k_index, attn_grads=attn_grads, stride=stride, q_data=q_data, n_question=n_question)

        query = query + self.dropout1((query2))
        query = self.layer_norm1(query)
        if apply_pos:
            query2 = self.linear2(self.dropout(self.activation(self.linear1(query))))
            query = query + self.dropout2((query2))
            query = self.layer_norm2(query)
        return query, _


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, d_feature, n_heads, dropout, kq_same, bias=True):
        super().__init__()
        self.d_model = d_model
        self.d_k = d_feature
        self.h = n_heads
        self.kq_same = kq_same

        self.v_linear = nn.Linear(d_model, d_model, bias=bias)
        self.k_linear = nn.Linear(d_model, d_model, bias=bias)
        if kq_same is False:
            self.q_linear = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.proj_bias = bias
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

        self._reset_parameters()

    def _reset_parameters(self):
        xavier_uniform_(self.k_linear.weight)
        xavier_uniform_(self.v_linear.weight)
        if self.kq_same is False:
            xavier_uniform_(self.q_linear.weight)

        if self.proj_bias:
            constant_(self.k_linear.bias, 0.)
            constant_(self.v_linear.bias, 0.)
            if self.kq_same is False:
                constant_(self.q_linear.bias, 0.)
            constant_(self.out_proj.bias, 0.)

    def forward(self, q, k, v, mask, zero_pad, emb_type="qid", sparse_ratio=0.8, k_index=5, attn_grads=None,
                stride=1, q_data=None, n_question=None):
        bs = q.size(0)

        k = self.k_linear(k).view(bs, -1, self.h, self.d_k)
        if self.kq_same is False:
            q = self.q_linear(q).view(bs, -1, self.h, self.d_k)
        else:
            q = self.k_linear(q).view(bs, -1, self.h, self.d_k)
        v = self.v_linear(v).view(bs, -1, self.h, self.d_k)

        k = k.transpose(1, 2)
        q = q.transpose(1, 2)
        v = v.transpose(1, 2)
        scores, attn_weights = attention(q, k, v, self.d_k, mask, self.dropout, zero_pad, emb_type,
                                         sparse_ratio=sparse_ratio, k_index=k_index, attn_grads=attn_grads,
                                         stride=stride, q_data=q_data, n_question=n_question)

        concat = scores.transpose(1, 2).contiguous().view(bs, -1, self.d_model)

        output = self.out_proj(concat)

        return output, attn_weights


def attention(q, k, v, d_k, mask, dropout, zero_pad, emb_type="qid", sparse_ratio=0.8, k_index=5, attn_grads=None,
              stride=1, q_data=None, n_question=None):
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d_k)  # BS, 8, seqlen, seqlen
    bs, head, seqlen = scores.size(0), scores.size(1), scores.size(2)
    scores.masked_fill_(mask == 0, -1e32)
    scores = F.softmax(scores, dim=-1)  # BS,8,seqlen,seqlen

    if emb_type.find("sparseattn") != -1:
        if k_index >= seqlen:
            scores = scores
        elif FIXED:
            scores_a = scores[:, :, : k_index + 1, :]
            scores_b = scores[:, :, k_index + 1:, :].reshape(
                bs * head * (seqlen - k_index - 1), -1
            )
            sorted_scores, sorted_idx = torch.sort(scores_b, descending=True)
            scores_t = sorted_scores[:, k_index - 1: k_index].repeat(1, seqlen)
            scores_b = torch.where(
                scores_b - scores_t >= torch.tensor(0), scores_b, torch.tensor(-1e32)
            ).reshape(bs, head, seqlen - k_index - 1, -1)
            scores_b = F.softmax(scores_b, dim=-1)  # BS,8,seqlen,seqlen
            scores = torch.cat([scores_a, scores_b], dim=2)
        else:
            scores_a = scores[:, :, :k_index, :]
            scores_b = scores[:, :, k_index:, :].reshape(bs * head * (seqlen - k_index), -1)
            sorted_scores, sorted_idx = torch.sort(scores_b, descending=True)
            scores_t = sorted_scores[:, k_index - 1:k_index].repeat(1, seqlen)
            scores_b = torch.where(scores_b - scores_t >= torch.tensor(0).to(device), scores_b,
                                   torch.tensor(-1e32).to(device)).reshape(bs, head, seqlen - k_index, -1)
            scores = torch.cat([scores_a, scores_b], dim=2)
            scores = F.softmax(scores, dim=-1)  # BS,8,seqlen,seqlen
    else:
        before_dropout_scores = scores

    if zero_pad:
        pad_zero = torch.zeros(bs, head, 1, seqlen).to(device)
        scores = torch.cat([pad_zero, scores[:bs, :, 1:, :]], dim=2)

    scores = dropout(scores)
    output = torch.matmul(scores, v)
    if emb_type != "qid":
        return output, scores
    else:
        return output, before_dropout_scores


class CosinePositionalEmbedding(nn.Module):
    def __init__(self, d_model, max_len=512):
        super().__init__()
        pe = 0.1 * torch.randn(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1).float()
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0)
        self.weight = nn.Parameter(pe, requires_grad=False)

    def forward(self, x):
        return self.weight[:, :x.size(Dim.seq), :]


def cal_loss(model, ys, r, rshft, sm, preloss=[]):
    y = torch.masked_select(ys[0], sm)
    t = torch.masked_select(rshft, sm)
    loss1 = binary_cross_entropy(y.double(), t.double())
    loss = loss1
    return loss


def model_forward(model, data):
    dcur = data
    q, c, r = dcur["qseqs"], dcur["cseqs"], dcur["rseqs"]
    qshft, cshft, rshft = dcur["shft_qseqs"], dcur["shft_cseqs"], dcur["shft_rseqs"]
    sm = dcur["smasks"]
    y, y2, y3 = model(dcur, train=True)
    ys = [y[:, 1:], y2, y3]
    loss = cal_loss(model, ys, r, rshft, sm)
    return loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--emb_type", type=str, default="qid_sparseattn")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--final_fc_dim", type=int, default=64)
    parser.add_argument("--final_fc_dim2", type=int, default=64)
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--d_ff", type=int, default=64)
    parser.add_argument("--num_attn_heads", type=int, default=4)
    parser.add_argument("--n_blocks", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--sparse_ratio", type=float, default=0.8)
    parser.add_argument("--k_index", type=int, default=5)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--fixed", action="store_true")
    params = vars(parser.parse_args())

    torch.manual_seed(0)
    num_c, num_q, bs, seq_len = 20, 50, 4, 24
    model = sparseKT(num_c, num_q, d_model=params["d_model"], n_blocks=params["n_blocks"],
                     dropout=params["dropout"], d_ff=params["d_ff"], seq_len=seq_len,
                     final_fc_dim=params["final_fc_dim"], final_fc_dim2=params["final_fc_dim2"],
                     num_attn_heads=params["num_attn_heads"], emb_type=params["emb_type"],
                     sparse_ratio=params["sparse_ratio"], k_index=params["k_index"], stride=params["stride"])
    opt = torch.optim.Adam(model.parameters(), params["learning_rate"])

    # a padded batch of interaction sequences in pykt's KTDataset layout (right-padded, smasks marks real steps)
    lengths = [24, 18, 12, 7]
    q = torch.randint(0, num_q, (bs, seq_len))
    c = torch.randint(0, num_c, (bs, seq_len))
    r = torch.randint(0, 2, (bs, seq_len))
    for i, n in enumerate(lengths):
        q[i, n:] = 0
        c[i, n:] = 0
        r[i, n:] = 0
    sm = torch.arange(1, seq_len)[None, :] < torch.tensor(lengths)[:, None]
    data = {"qseqs": q[:, :-1], "cseqs": c[:, :-1], "rseqs": r[:, :-1],
            "shft_qseqs": q[:, 1:], "shft_cseqs": c[:, 1:], "shft_rseqs": r[:, 1:], "smasks": sm}

    model.train()
    loss = model_forward(model, data)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
