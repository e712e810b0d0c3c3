# Citation: pykt-team/pykt-toolkit pykt/models/sakt.py (SAKT, Blocks, ut_mask) and pykt/models/train_model.py (loss on sm).
# SAKT: queries are the NEXT exercise embeddings (qshft), keys/values the past interactions (q + num_c*r). The bool
# attn_mask (True = blocked) is torch.triu(ones, diagonal=1): query t (about exercise t+1) sees interactions 0..t,
# the diagonal included on purpose because interaction t happened before exercise t+1. Right-padded sequences are
# zero-filled and dropped by the shifted mask sm in the loss.
import torch
from torch import nn
from torch.nn import Dropout, LayerNorm, Linear, MultiheadAttention, ReLU, Sequential, Embedding

torch.manual_seed(0)
device = "cpu"


def ut_mask(seq_len):
    return torch.triu(torch.ones(seq_len, seq_len), diagonal=1).to(dtype=torch.bool).to(device)


def pos_encode(seq_len):
    return torch.arange(seq_len).unsqueeze(0).to(device)


class transformer_FFN(nn.Module):
    def __init__(self, emb_size, dropout):
        super().__init__()
        self.FFN = Sequential(Linear(emb_size, emb_size), ReLU(), Dropout(dropout), Linear(emb_size, emb_size))

    def forward(self, in_fea):
        return self.FFN(in_fea)


class Blocks(nn.Module):
    def __init__(self, emb_size, num_attn_heads, dropout):
        super().__init__()
        self.attn = MultiheadAttention(emb_size, num_attn_heads, dropout=dropout)
        self.attn_dropout = Dropout(dropout)
        self.attn_layer_norm = LayerNorm(emb_size)
        self.FFN = transformer_FFN(emb_size, dropout)
        self.FFN_dropout = Dropout(dropout)
        self.FFN_layer_norm = LayerNorm(emb_size)

    def forward(self, q=None, k=None, v=None):
        q, k, v = q.permute(1, 0, 2), k.permute(1, 0, 2), v.permute(1, 0, 2)
        causal_mask = ut_mask(seq_len=k.shape[0])
        attn_emb, _ = self.attn(q, k, v, attn_mask=causal_mask)
        attn_emb = self.attn_dropout(attn_emb)
        attn_emb, q = attn_emb.permute(1, 0, 2), q.permute(1, 0, 2)
        attn_emb = self.attn_layer_norm(q + attn_emb)
        emb = self.FFN(attn_emb)
        emb = self.FFN_dropout(emb)
        emb = self.FFN_layer_norm(attn_emb + emb)
        return emb


class SAKT(nn.Module):
    def __init__(self, num_c, seq_len, emb_size, num_attn_heads, dropout, num_en=2):
        super().__init__()
        self.model_name = "sakt"
        self.num_c, self.seq_len, self.emb_size, self.num_en = num_c, seq_len, emb_size, num_en
        self.interaction_emb = Embedding(num_c * 2, emb_size)
        self.exercise_emb = Embedding(num_c, emb_size)
        self.position_emb = Embedding(seq_len, emb_size)
        self.blocks = nn.ModuleList([Blocks(emb_size, num_attn_heads, dropout) for _ in range(num_en)])
        self.dropout_layer = Dropout(dropout)
        self.pred = Linear(self.emb_size, 1)

    def base_emb(self, q, r, qry):
        x = q + self.num_c * r
        qshftemb, xemb = self.exercise_emb(qry), self.interaction_emb(x)
        posemb = self.position_emb(pos_encode(xemb.shape[1]))
        xemb = xemb + posemb
        return qshftemb, xemb

    def forward(self, q, r, qry, qtest=False):
        qemb, xemb = self.base_emb(q, r, qry)
        for i in range(self.num_en):
            xemb = self.blocks[i](qemb, xemb, xemb)
        p = torch.sigmoid(self.pred(self.dropout_layer(xemb))).squeeze(-1)
        return p


num_c, seqlen = 20, 16
model = SAKT(num_c, seqlen - 1, 32, 4, 0.1)
opt = torch.optim.Adam(model.parameters(), 1e-3)
# dataset: concept ids / responses, -1 padded on the right, masks as in pykt KTDataset
lens = [16, 11, 6]
c = torch.full((3, seqlen), -1)
r = torch.full((3, seqlen), -1)
for i, L in enumerate(lens):
    c[i, :L] = torch.randint(0, num_c, (L,))
    r[i, :L] = torch.randint(0, 2, (L,))
mask = (c != -1)
cseqs, rseqs = (c[:, :-1] * mask[:, :-1]), (r[:, :-1] * mask[:, :-1])
cshft, rshft = (c[:, 1:] * mask[:, 1:]), (r[:, 1:] * mask[:, 1:])
sm = mask[:, :-1] & mask[:, 1:]
model.train()
for step in range(3):
    y = model(cseqs.long(), rseqs.long(), cshft.long())
    loss = nn.functional.binary_cross_entropy(torch.masked_select(y, sm), torch.masked_select(rshft, sm).double().float())
    opt.zero_grad()
    loss.backward()
    opt.step()
print("sakt loss %.4f" % loss.item())
