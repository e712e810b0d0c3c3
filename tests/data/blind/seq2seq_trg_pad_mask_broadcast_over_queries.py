"""hyunwoongko/transformer: the target padding mask is broadcast over query rows, not key columns.

Citation: hyunwoongko/transformer PR #40 ("fix(model): attention pad mask", open; description
read).  Source read: models/model/transformer.py (stored commit 2162327), i.e. the code after
PR #14 — this is a different bug from #11/#14 (which compared targets with `src_pad_idx`).

Bug: `make_trg_mask` builds `trg_pad_mask = (trg != trg_pad_idx).unsqueeze(1).unsqueeze(3)`,
shape (batch, 1, trg_len, 1).  Broadcast against the (trg_len, trg_len) no-peak mask it blanks
whole *query rows* of pad positions instead of pad *key columns*.  Every key of a pad query is
then filled with -10000 and softmax spreads it uniformly over all keys, future ones included;
the PR notes it only stays finite because of the -10000 fill (with -inf the rows are NaN).
Fix (PR #40): `.unsqueeze(1).unsqueeze(2)` -> (batch, 1, 1, trg_len), a key-padding mask, as
`make_src_mask` already does.

Reproduction: a 1-layer encoder-decoder with the project's ScaleDotProductAttention
(masked_fill(mask == 0, -10000)); a right-padded target batch of lengths 6 and 3 (pad 1).
"""
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class ScaleDotProductAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, q, k, v, mask=None, e=1e-12):
        batch_size, head, length, d_tensor = k.size()
        k_t = k.transpose(2, 3)
        score = (q @ k_t) / math.sqrt(d_tensor)
        if mask is not None:
            score = score.masked_fill(mask == 0, -10000)
        score = self.softmax(score)
        v = score @ v
        return v, score


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.attention = ScaleDotProductAttention()
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_concat = nn.Linear(d_model, d_model)

    def forward(self, q, k, v, mask=None):
        q, k, v = self.w_q(q), self.w_k(k), self.w_v(v)
        q, k, v = self.split(q), self.split(k), self.split(v)
        out, attention = self.attention(q, k, v, mask=mask)
        return self.w_concat(self.concat(out))

    def split(self, tensor):
        batch_size, length, d_model = tensor.size()
        d_tensor = d_model // self.n_head
        return tensor.view(batch_size, length, self.n_head, d_tensor).transpose(1, 2)

    def concat(self, tensor):
        batch_size, head, length, d_tensor = tensor.size()
        return tensor.transpose(1, 2).contiguous().view(batch_size, length, head * d_tensor)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, hidden, drop_prob=0.1):
        super().__init__()
        self.linear1 = nn.Linear(d_model, hidden)
        self.linear2 = nn.Linear(hidden, d_model)
        self.relu = nn.ReLU()
        self.dropout = nn.Dropout(p=drop_prob)

    def forward(self, x):
        return self.linear2(self.dropout(self.relu(self.linear1(x))))


class EncoderLayer(nn.Module):
    def __init__(self, d_model, ffn_hidden, n_head, drop_prob):
        super().__init__()
        self.attention = MultiHeadAttention(d_model=d_model, n_head=n_head)
        self.norm1 = nn.LayerNorm(d_model)
        self.ffn = PositionwiseFeedForward(d_model=d_model, hidden=ffn_hidden, drop_prob=drop_prob)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x, src_mask):
        x = self.norm1(self.attention(q=x, k=x, v=x, mask=src_mask) + x)
        return self.norm2(self.ffn(x) + x)


class DecoderLayer(nn.Module):
    def __init__(self, d_model, ffn_hidden, n_head, drop_prob):
        super().__init__()
        self.self_attention = MultiHeadAttention(d_model=d_model, n_head=n_head)
        self.norm1 = nn.LayerNorm(d_model)
        self.enc_dec_attention = MultiHeadAttention(d_model=d_model, n_head=n_head)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = PositionwiseFeedForward(d_model=d_model, hidden=ffn_hidden, drop_prob=drop_prob)
        self.norm3 = nn.LayerNorm(d_model)

    def forward(self, dec, enc, trg_mask, src_mask):
        x = self.norm1(self.self_attention(q=dec, k=dec, v=dec, mask=trg_mask) + dec)
        if enc is not None:
            x = self.norm2(self.enc_dec_attention(q=x, k=enc, v=enc, mask=src_mask) + x)
        return self.norm3(self.ffn(x) + x)


class Transformer(nn.Module):
    def __init__(self, src_pad_idx, trg_pad_idx, trg_sos_idx, enc_voc_size, dec_voc_size, d_model, n_head,
                 max_len, ffn_hidden, n_layers, drop_prob, device):
        super().__init__()
        self.src_pad_idx = src_pad_idx
        self.trg_pad_idx = trg_pad_idx
        self.trg_sos_idx = trg_sos_idx
        self.device = device
        self.enc_emb = nn.Embedding(enc_voc_size, d_model, padding_idx=src_pad_idx)
        self.dec_emb = nn.Embedding(dec_voc_size, d_model, padding_idx=trg_pad_idx)
        self.pos = nn.Parameter(torch.randn(max_len, d_model) * 0.1)
        self.encoder = nn.ModuleList([EncoderLayer(d_model, ffn_hidden, n_head, drop_prob) for _ in range(n_layers)])
        self.decoder = nn.ModuleList([DecoderLayer(d_model, ffn_hidden, n_head, drop_prob) for _ in range(n_layers)])
        self.linear = nn.Linear(d_model, dec_voc_size)

    def forward(self, src, trg):
        src_mask = self.make_src_mask(src)
        trg_mask = self.make_trg_mask(trg)
        enc_src = self.enc_emb(src) + self.pos[: src.shape[1]]
        for layer in self.encoder:
            enc_src = layer(enc_src, src_mask)
        out = self.dec_emb(trg) + self.pos[: trg.shape[1]]
        for layer in self.decoder:
            out = layer(out, enc_src, trg_mask, src_mask)
        return self.linear(out)

    def make_src_mask(self, src):
        src_mask = (src != self.src_pad_idx).unsqueeze(1).unsqueeze(2)
        return src_mask

    def make_trg_mask(self, trg):
        if FIXED:
            trg_pad_mask = (trg != self.trg_pad_idx).unsqueeze(1).unsqueeze(2)
        else:
            trg_pad_mask = (trg != self.trg_pad_idx).unsqueeze(1).unsqueeze(3)
        trg_len = trg.shape[1]
        trg_sub_mask = torch.tril(torch.ones(trg_len, trg_len)).type(torch.ByteTensor).to(self.device)
        trg_mask = trg_pad_mask & trg_sub_mask
        return trg_mask


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Transformer(src_pad_idx=1, trg_pad_idx=1, trg_sos_idx=2, enc_voc_size=40, dec_voc_size=40,
                        d_model=32, n_head=4, max_len=16, ffn_hidden=64, n_layers=1, drop_prob=0.1,
                        device="cpu").eval()
    src = torch.tensor([[2, 7, 9, 11, 13, 3, 1], [2, 8, 10, 3, 1, 1, 1]])
    trg = torch.tensor([[2, 5, 6, 7, 8, 3], [2, 5, 3, 1, 1, 1]])
    with torch.no_grad():
        logits = model(src, trg)
    print(f"trg_mask shape {tuple(model.make_trg_mask(trg).shape)}, logits sum {logits.sum().item():.4f}")
