"""Seq2seq Transformer whose padding masks use the source pad index for the target too.

Citation: hyunwoongko/transformer#11 ("Potential bug in the pad mask"), fixed by PR #14
(commit 67ccbb0 "fix pad bug"). Upstream file: models/model/transformer.py.

Bug: `Transformer.make_pad_mask(q, k)` compared both the query and the key sequence with
`self.src_pad_idx`, so the target self-attention mask and the target->source cross-attention
mask were built with the *source* vocabulary's pad id. When the two vocabularies put `<pad>` at
different ids, target padding is not masked and real target tokens whose id equals the source
pad id are masked instead.

Fix: `make_pad_mask(q, k, q_pad_idx, k_pad_idx)` takes the pad id of each side, and forward()
passes `trg_pad_idx` for the target side.

Reproduction: the model is written as upstream (MultiHeadAttention split/concat, the
ScaleDotProductAttention that does `masked_fill(mask == 0, -10000)` then softmax), one encoder
and one decoder layer, random weights. The source vocabulary has `<pad>` at 1 and the target
vocabulary at 0 (as two separately built vocabularies can); the target batch is right padded
and contains token id 1, a real target word. Run with --fixed for the code after the fix.
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


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len):
        super().__init__()
        pos = torch.arange(0, max_len).float().unsqueeze(1)
        _2i = torch.arange(0, d_model, step=2).float()
        enc = torch.zeros(max_len, d_model)
        enc[:, 0::2] = torch.sin(pos / (10000 ** (_2i / d_model)))
        enc[:, 1::2] = torch.cos(pos / (10000 ** (_2i / d_model)))
        self.register_buffer("encoding", enc)

    def forward(self, x):
        return self.encoding[: x.size(1), :]


class TransformerEmbedding(nn.Module):
    def __init__(self, vocab_size, d_model, max_len):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model, padding_idx=1)
        self.pos_emb = PositionalEncoding(d_model, max_len)

    def forward(self, x):
        return self.tok_emb(x) + self.pos_emb(x)


class EncoderLayer(nn.Module):
    def __init__(self, d_model, ffn_hidden, n_head):
        super().__init__()
        self.attention = MultiHeadAttention(d_model=d_model, n_head=n_head)
        self.norm1 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, ffn_hidden), nn.ReLU(), nn.Linear(ffn_hidden, d_model))
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x, s_mask):
        x = self.norm1(x + self.attention(q=x, k=x, v=x, mask=s_mask))
        return self.norm2(x + self.ffn(x))


class DecoderLayer(nn.Module):
    def __init__(self, d_model, ffn_hidden, n_head):
        super().__init__()
        self.self_attention = MultiHeadAttention(d_model=d_model, n_head=n_head)
        self.norm1 = nn.LayerNorm(d_model)
        self.enc_dec_attention = MultiHeadAttention(d_model=d_model, n_head=n_head)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, ffn_hidden), nn.ReLU(), nn.Linear(ffn_hidden, d_model))
        self.norm3 = nn.LayerNorm(d_model)

    def forward(self, dec, enc, t_mask, s_mask):
        x = self.norm1(dec + self.self_attention(q=dec, k=dec, v=dec, mask=t_mask))
        x = self.norm2(x + self.enc_dec_attention(q=x, k=enc, v=enc, mask=s_mask))
        return self.norm3(x + self.ffn(x))


class Transformer(nn.Module):
    def __init__(self, src_pad_idx, trg_pad_idx, trg_sos_idx, enc_voc_size, dec_voc_size, d_model, n_head,
                 max_len, ffn_hidden, n_layers, drop_prob, device):
        super().__init__()
        self.src_pad_idx = src_pad_idx
        self.trg_pad_idx = trg_pad_idx
        self.trg_sos_idx = trg_sos_idx
        self.device = device
        self.enc_emb = TransformerEmbedding(enc_voc_size, d_model, max_len)
        self.dec_emb = TransformerEmbedding(dec_voc_size, d_model, max_len)
        self.enc_layers = nn.ModuleList([EncoderLayer(d_model, ffn_hidden, n_head) for _ in range(n_layers)])
        self.dec_layers = nn.ModuleList([DecoderLayer(d_model, ffn_hidden, n_head) for _ in range(n_layers)])
        self.linear = nn.Linear(d_model, dec_voc_size)

    def forward(self, src, trg):
        if FIXED:
            src_mask = self.make_pad_mask(src, src, self.src_pad_idx, self.src_pad_idx)
            src_trg_mask = self.make_pad_mask(trg, src, self.trg_pad_idx, self.src_pad_idx)
            trg_mask = self.make_pad_mask(trg, trg, self.trg_pad_idx, self.trg_pad_idx) * \
                self.make_no_peak_mask(trg, trg)
        else:
            src_mask = self.make_pad_mask(src, src)
            src_trg_mask = self.make_pad_mask(trg, src)
            trg_mask = self.make_pad_mask(trg, trg) * \
                self.make_no_peak_mask(trg, trg)

        enc = self.enc_emb(src)
        for layer in self.enc_layers:
            enc = layer(enc, src_mask)
        dec = self.dec_emb(trg)
        for layer in self.dec_layers:
            dec = layer(dec, enc, trg_mask, src_trg_mask)
        return self.linear(dec)

    def make_pad_mask(self, q, k, q_pad_idx=None, k_pad_idx=None):
        if not FIXED:
            q_pad_idx = k_pad_idx = self.src_pad_idx
        len_q, len_k = q.size(1), k.size(1)

        # batch_size x 1 x 1 x len_k
        k = k.ne(k_pad_idx).unsqueeze(1).unsqueeze(2)
        # batch_size x 1 x len_q x len_k
        k = k.repeat(1, 1, len_q, 1)

        # batch_size x 1 x len_q x 1
        q = q.ne(q_pad_idx).unsqueeze(1).unsqueeze(3)
        # batch_size x 1 x len_q x len_k
        q = q.repeat(1, 1, 1, len_k)

        mask = k & q
        return mask

    def make_no_peak_mask(self, q, k):
        len_q, len_k = q.size(1), k.size(1)
        mask = torch.tril(torch.ones(len_q, len_k)).type(torch.BoolTensor).to(self.device)
        return mask


def main():
    torch.manual_seed(0)
    # Separately built vocabularies: source '<pad>' is id 1, target '<pad>' is id 0.
    src_pad_idx, trg_pad_idx, trg_sos_idx = 1, 0, 2
    model = Transformer(src_pad_idx=src_pad_idx, trg_pad_idx=trg_pad_idx, trg_sos_idx=trg_sos_idx,
                        enc_voc_size=40, dec_voc_size=40, d_model=32, n_head=4, max_len=64,
                        ffn_hidden=64, n_layers=1, drop_prob=0.1, device="cpu").eval()
    src = torch.tensor([[5, 9, 12, 7, 8, 1, 1],
                        [6, 4, 11, 13, 3, 10, 15]])
    # target row 0: <sos> w w w(id 1, a real word) w <pad> <pad>; row 1 has 2 pads
    trg = torch.tensor([[2, 17, 23, 1, 19, 0, 0],
                        [2, 21, 1, 30, 0, 0, 0]])
    with torch.no_grad():
        out = model(src, trg)
    print("logits", tuple(out.shape), "checksum %.4f" % out.sum().item())


if __name__ == "__main__":
    main()
