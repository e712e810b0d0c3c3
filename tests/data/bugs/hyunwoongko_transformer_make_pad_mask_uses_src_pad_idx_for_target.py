# hyunwoongko/transformer (PR hyunwoongko/transformer#14, commit 67ccbb0): Transformer.make_pad_mask compared both the
# query and key sequences with self.src_pad_idx, so the target self-attention mask and the query side of the
# encoder-decoder mask were built from the *source* pad id; the fix passes q_pad_idx / k_pad_idx (trg_pad_idx for trg).
import sys
import math

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
device = torch.device("cpu")


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
        out = self.concat(out)
        out = self.w_concat(out)
        return out

    def split(self, tensor):
        batch_size, length, d_model = tensor.size()
        d_tensor = d_model // self.n_head
        return tensor.view(batch_size, length, self.n_head, d_tensor).transpose(1, 2)

    def concat(self, tensor):
        batch_size, head, length, d_tensor = tensor.size()
        d_model = head * d_tensor
        return tensor.transpose(1, 2).contiguous().view(batch_size, length, d_model)


class LayerNorm(nn.Module):
    def __init__(self, d_model, eps=1e-12):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(d_model))
        self.beta = nn.Parameter(torch.zeros(d_model))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, unbiased=False, keepdim=True)
        out = (x - mean) / torch.sqrt(var + self.eps)
        return self.gamma * out + self.beta


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, hidden, drop_prob=0.1):
        super().__init__()
        self.linear1 = nn.Linear(d_model, hidden)
        self.linear2 = nn.Linear(hidden, d_model)
        self.relu = nn.ReLU()
        self.dropout = nn.Dropout(p=drop_prob)

    def forward(self, x):
        return self.linear2(self.dropout(self.relu(self.linear1(x))))


class PostionalEncoding(nn.Module):
    def __init__(self, d_model, max_len, device):
        super().__init__()
        self.encoding = torch.zeros(max_len, d_model, device=device)
        self.encoding.requires_grad = False
        pos = torch.arange(0, max_len, device=device).float().unsqueeze(dim=1)
        _2i = torch.arange(0, d_model, step=2, device=device).float()
        self.encoding[:, 0::2] = torch.sin(pos / (10000 ** (_2i / d_model)))
        self.encoding[:, 1::2] = torch.cos(pos / (10000 ** (_2i / d_model)))

    def forward(self, x):
        batch_size, seq_len = x.size()
        return self.encoding[:seq_len, :]


class TransformerEmbedding(nn.Module):
    def __init__(self, vocab_size, d_model, max_len, drop_prob, device):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model, padding_idx=1)  # TokenEmbedding hard-codes padding_idx=1
        self.pos_emb = PostionalEncoding(d_model, max_len, device)
        self.drop_out = nn.Dropout(p=drop_prob)

    def forward(self, x):
        return self.drop_out(self.tok_emb(x) + self.pos_emb(x))


class EncoderLayer(nn.Module):
    def __init__(self, d_model, ffn_hidden, n_head, drop_prob):
        super().__init__()
        self.attention = MultiHeadAttention(d_model=d_model, n_head=n_head)
        self.norm1 = LayerNorm(d_model=d_model)
        self.dropout1 = nn.Dropout(p=drop_prob)
        self.ffn = PositionwiseFeedForward(d_model=d_model, hidden=ffn_hidden, drop_prob=drop_prob)
        self.norm2 = LayerNorm(d_model=d_model)
        self.dropout2 = nn.Dropout(p=drop_prob)

    def forward(self, x, s_mask):
        _x = x
        x = self.attention(q=x, k=x, v=x, mask=s_mask)
        x = self.norm1(self.dropout1(x) + _x)
        _x = x
        x = self.ffn(x)
        x = self.norm2(self.dropout2(x) + _x)
        return x


class DecoderLayer(nn.Module):
    def __init__(self, d_model, ffn_hidden, n_head, drop_prob):
        super().__init__()
        self.self_attention = MultiHeadAttention(d_model=d_model, n_head=n_head)
        self.norm1 = LayerNorm(d_model=d_model)
        self.dropout1 = nn.Dropout(p=drop_prob)
        self.enc_dec_attention = MultiHeadAttention(d_model=d_model, n_head=n_head)
        self.norm2 = LayerNorm(d_model=d_model)
        self.dropout2 = nn.Dropout(p=drop_prob)
        self.ffn = PositionwiseFeedForward(d_model=d_model, hidden=ffn_hidden, drop_prob=drop_prob)
        self.norm3 = LayerNorm(d_model=d_model)
        self.dropout3 = nn.Dropout(p=drop_prob)

    def forward(self, dec, enc, t_mask, s_mask):
        _x = dec
        x = self.self_attention(q=dec, k=dec, v=dec, mask=t_mask)
        x = self.norm1(self.dropout1(x) + _x)
        if enc is not None:
            _x = x
            x = self.enc_dec_attention(q=x, k=enc, v=enc, mask=s_mask)
            x = self.norm2(self.dropout2(x) + _x)
        _x = x
        x = self.ffn(x)
        x = self.norm3(self.dropout3(x) + _x)
        return x


class Encoder(nn.Module):
    def __init__(self, enc_voc_size, max_len, d_model, ffn_hidden, n_head, n_layers, drop_prob, device):
        super().__init__()
        self.emb = TransformerEmbedding(enc_voc_size, d_model, max_len, drop_prob, device)
        self.layers = nn.ModuleList([EncoderLayer(d_model, ffn_hidden, n_head, drop_prob) for _ in range(n_layers)])

    def forward(self, x, s_mask):
        x = self.emb(x)
        for layer in self.layers:
            x = layer(x, s_mask)
        return x


class Decoder(nn.Module):
    def __init__(self, dec_voc_size, max_len, d_model, ffn_hidden, n_head, n_layers, drop_prob, device):
        super().__init__()
        self.emb = TransformerEmbedding(dec_voc_size, d_model, max_len, drop_prob, device)
        self.layers = nn.ModuleList([DecoderLayer(d_model, ffn_hidden, n_head, drop_prob) for _ in range(n_layers)])
        self.linear = nn.Linear(d_model, dec_voc_size)

    def forward(self, trg, enc_src, trg_mask, src_mask):
        trg = self.emb(trg)
        for layer in self.layers:
            trg = layer(trg, enc_src, trg_mask, src_mask)
        return self.linear(trg)


class Transformer(nn.Module):
    def __init__(self, src_pad_idx, trg_pad_idx, trg_sos_idx, enc_voc_size, dec_voc_size, d_model, n_head, max_len,
                 ffn_hidden, n_layers, drop_prob, device):
        super().__init__()
        self.src_pad_idx = src_pad_idx
        self.trg_pad_idx = trg_pad_idx
        self.trg_sos_idx = trg_sos_idx
        self.device = device
        self.encoder = Encoder(enc_voc_size, max_len, d_model, ffn_hidden, n_head, n_layers, drop_prob, device)
        self.decoder = Decoder(dec_voc_size, max_len, d_model, ffn_hidden, n_head, n_layers, drop_prob, device)

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
        enc_src = self.encoder(src, src_mask)
        output = self.decoder(trg, enc_src, trg_mask, src_trg_mask)
        return output

    def make_pad_mask(self, q, k, q_pad_idx=None, k_pad_idx=None):
        len_q, len_k = q.size(1), k.size(1)
        if FIXED:
            # batch_size x 1 x 1 x len_k
            k = k.ne(k_pad_idx).unsqueeze(1).unsqueeze(2)
        else:
            k = k.ne(self.src_pad_idx).unsqueeze(1).unsqueeze(2)
        # batch_size x 1 x len_q x len_k
        k = k.repeat(1, 1, len_q, 1)
        if FIXED:
            # batch_size x 1 x len_q x 1
            q = q.ne(q_pad_idx).unsqueeze(1).unsqueeze(3)
        else:
            q = q.ne(self.src_pad_idx).unsqueeze(1).unsqueeze(3)
        # batch_size x 1 x len_q x len_k
        q = q.repeat(1, 1, 1, len_k)
        mask = k & q
        return mask

    def make_no_peak_mask(self, q, k):
        len_q, len_k = q.size(1), k.size(1)
        mask = torch.tril(torch.ones(len_q, len_k)).type(torch.BoolTensor).to(self.device)
        return mask


# Source and target vocabularies are built separately (src_pad_idx and trg_pad_idx are separate constructor
# arguments); here the target vocabulary puts <pad> at 0 and <unk> at 1, the source one puts <pad> at 1.
SRC_PAD = 1
TRG_PAD, TRG_UNK, TRG_SOS, TRG_EOS = 0, 1, 2, 3
model = Transformer(src_pad_idx=SRC_PAD, trg_pad_idx=TRG_PAD, trg_sos_idx=TRG_SOS, enc_voc_size=24, dec_voc_size=24,
                    d_model=32, n_head=4, max_len=64, ffn_hidden=64, n_layers=2, drop_prob=0.1, device=device).eval()

src_lens = [8, 5]
trg_lens = [7, 5]
src = torch.randint(4, 24, (2, 8))
trg = torch.randint(4, 24, (2, 7))
trg[:, 0] = TRG_SOS
trg[0, 3] = TRG_UNK  # an out-of-vocabulary target word
trg[1, 2] = TRG_UNK
for b in range(2):
    src[b, src_lens[b]:] = SRC_PAD
    trg[b, trg_lens[b]:] = TRG_PAD

with torch.no_grad():
    # teacher-forced batched forward, as in train.py: model(src, trg[:, :-1])
    out = model(src, trg)
    # reference: each sentence alone (no padding), greedy-decode style, one growing prefix at a time
    diff = 0.0
    for b in range(2):
        s = src[b:b + 1, :src_lens[b]]
        for t in range(trg_lens[b]):
            ref = model(s, trg[b:b + 1, :t + 1])[0, -1]
            diff = max(diff, (out[b, t] - ref).abs().max().item())
print(f"max |batched teacher-forced logits - per-sentence prefix logits| = {diff:.6f}")
