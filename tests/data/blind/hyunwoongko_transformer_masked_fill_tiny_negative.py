# Reproduces hyunwoongko/transformer#10: ScaleDotProductAttention fills masked scores with -e (e=1e-12),
# i.e. ~0 instead of a large negative value, so padded keys and future positions still get attention weight.
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class ScaleDotProductAttention(nn.Module):
    def __init__(self):
        super(ScaleDotProductAttention, self).__init__()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, q, k, v, mask=None, e=1e-12):
        batch_size, head, length, d_tensor = k.size()
        k_t = k.transpose(2, 3)
        score = (q @ k_t) / math.sqrt(d_tensor)
        if mask is not None:
            if FIXED:
                score = score.masked_fill(mask == 0, -10000)
            else:
                score = score.masked_fill(mask == 0, -e)
        score = self.softmax(score)
        v = score @ v
        return v, score


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super(MultiHeadAttention, self).__init__()
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
        return tensor.view(batch_size, length, self.n_head, d_model // self.n_head).transpose(1, 2)

    def concat(self, tensor):
        batch_size, head, length, d_tensor = tensor.size()
        return tensor.transpose(1, 2).contiguous().view(batch_size, length, head * d_tensor)


class DecoderLayer(nn.Module):
    def __init__(self, d_model, ffn_hidden, n_head):
        super(DecoderLayer, self).__init__()
        self.self_attention = MultiHeadAttention(d_model, n_head)
        self.norm1 = nn.LayerNorm(d_model)
        self.enc_dec_attention = MultiHeadAttention(d_model, n_head)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, ffn_hidden), nn.ReLU(), nn.Linear(ffn_hidden, d_model))
        self.norm3 = nn.LayerNorm(d_model)

    def forward(self, dec, enc, trg_mask, src_mask):
        x = self.norm1(dec + self.self_attention(q=dec, k=dec, v=dec, mask=trg_mask))
        x = self.norm2(x + self.enc_dec_attention(q=x, k=enc, v=enc, mask=src_mask))
        return self.norm3(x + self.ffn(x))


class Transformer(nn.Module):
    def __init__(self, src_pad_idx, trg_pad_idx, voc_size=32, d_model=16, ffn_hidden=32, n_head=2, n_layers=2):
        super().__init__()
        self.src_pad_idx, self.trg_pad_idx = src_pad_idx, trg_pad_idx
        self.src_emb = nn.Embedding(voc_size, d_model, padding_idx=src_pad_idx)
        self.trg_emb = nn.Embedding(voc_size, d_model, padding_idx=trg_pad_idx)
        self.enc_attn = MultiHeadAttention(d_model, n_head)
        self.enc_norm = nn.LayerNorm(d_model)
        self.layers = nn.ModuleList([DecoderLayer(d_model, ffn_hidden, n_head) for _ in range(n_layers)])
        self.linear = nn.Linear(d_model, voc_size)

    def make_src_mask(self, src):
        return (src != self.src_pad_idx).unsqueeze(1).unsqueeze(2)

    def make_trg_mask(self, trg):
        trg_pad_mask = (trg != self.trg_pad_idx).unsqueeze(1).unsqueeze(2)
        trg_len = trg.shape[1]
        trg_sub_mask = torch.tril(torch.ones(trg_len, trg_len)).type(torch.BoolTensor)
        return trg_pad_mask & trg_sub_mask

    def forward(self, src, trg):
        src_mask = self.make_src_mask(src)
        trg_mask = self.make_trg_mask(trg)
        x = self.src_emb(src)
        enc_src = self.enc_norm(x + self.enc_attn(x, x, x, mask=src_mask))
        y = self.trg_emb(trg)
        for layer in self.layers:
            y = layer(y, enc_src, trg_mask, src_mask)
        return self.linear(y)


def main():
    torch.manual_seed(0)
    model = Transformer(src_pad_idx=1, trg_pad_idx=1).eval()
    src = torch.tensor([[5, 6, 7, 1, 1, 1]])
    trg = torch.tensor([[2, 8, 9, 10]])
    with torch.no_grad():
        out = model(src, trg)
        # change only the future target tokens: a causal decoder's first position must not move
        trg2 = trg.clone()
        trg2[0, 1:] = torch.tensor([20, 21, 22])
        out2 = model(src, trg2)
    leak = (out[0, 0] - out2[0, 0]).abs().max().item()
    print(f"{'fixed' if FIXED else 'buggy'}: change of position-0 logits when future targets change = {leak:.4e}")


if __name__ == "__main__":
    main()
