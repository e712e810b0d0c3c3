# Reproduces Kamichanw/SeekDeeper#3: the decoder's cross-attention was given tgt_mask (the causal target mask)
# instead of src_mask, so decoder queries cannot see later source tokens and do see source padding.
import sys

import torch
from torch import nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class ScaledDotProductAttention(nn.Module):
    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, mask)


class MultiheadAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, dropout=0.0):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention = ScaledDotProductAttention()
        self.w_q = nn.Linear(hidden_size, hidden_size)
        self.w_k = nn.Linear(hidden_size, hidden_size)
        self.w_v = nn.Linear(hidden_size, hidden_size)
        self.w_concat = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, q, k, v, mask=None):
        q, k, v = self.w_q(q), self.w_k(k), self.w_v(v)
        q, k, v = self.split(q), self.split(k), self.split(v)
        out = self.attention(q, k, v, mask=mask)
        return self.dropout(self.w_concat(self.concat(out)))

    def split(self, tensor):
        b, length, hidden = tensor.size()
        return tensor.view(b, length, self.num_attention_heads, hidden // self.num_attention_heads).transpose(1, 2)

    def concat(self, tensor):
        b, h, length, d = tensor.size()
        return tensor.transpose(1, 2).contiguous().view(b, length, h * d)


class EncoderLayer(nn.Module):
    def __init__(self, hidden_size, ffn_hidden, num_attention_heads):
        super().__init__()
        self.attention = MultiheadAttention(hidden_size, num_attention_heads)
        self.ln_1 = nn.LayerNorm(hidden_size)
        self.ffn = nn.Sequential(nn.Linear(hidden_size, ffn_hidden), nn.ReLU(), nn.Linear(ffn_hidden, hidden_size))
        self.ln_2 = nn.LayerNorm(hidden_size)

    def forward(self, x, src_mask):
        x = self.ln_1(x + self.attention(q=x, k=x, v=x, mask=src_mask))
        return self.ln_2(x + self.ffn(x))


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size, ffn_hidden, num_attention_heads):
        super().__init__()
        self.self_attn = MultiheadAttention(hidden_size, num_attention_heads)
        self.ln_1 = nn.LayerNorm(hidden_size)
        self.enc_dec_attention = MultiheadAttention(hidden_size, num_attention_heads)
        self.ln_2 = nn.LayerNorm(hidden_size)
        self.ffn = nn.Sequential(nn.Linear(hidden_size, ffn_hidden), nn.ReLU(), nn.Linear(ffn_hidden, hidden_size))
        self.ln_3 = nn.LayerNorm(hidden_size)

    def forward(self, dec, enc, tgt_mask, src_mask):
        residual = dec
        x = self.self_attn(q=dec, k=dec, v=dec, mask=tgt_mask)
        x = self.ln_1(x + residual)
        if enc is not None:
            residual = x
            cross_mask = src_mask if FIXED else tgt_mask
            x = self.enc_dec_attention(q=x, k=enc, v=enc, mask=cross_mask)
            x = self.ln_2(x + residual)
        residual = x
        x = self.ffn(x)
        return self.ln_3(x + residual)


class Transformer(nn.Module):
    def __init__(self, src_pad_idx, tgt_pad_idx, vocab_size=32, hidden_size=16, ffn_hidden=32, heads=2, layers=2):
        super().__init__()
        self.src_pad_idx, self.tgt_pad_idx = src_pad_idx, tgt_pad_idx
        self.src_emb = nn.Embedding(vocab_size, hidden_size)
        self.tgt_emb = nn.Embedding(vocab_size, hidden_size)
        self.encoder = nn.ModuleList([EncoderLayer(hidden_size, ffn_hidden, heads) for _ in range(layers)])
        self.decoder = nn.ModuleList([DecoderLayer(hidden_size, ffn_hidden, heads) for _ in range(layers)])
        self.linear = nn.Linear(hidden_size, vocab_size)

    def make_src_mask(self, src):
        # [batch_size, 1, 1, src_len], True = attend
        return (src != self.src_pad_idx).unsqueeze(1).unsqueeze(2)

    def make_tgt_mask(self, tgt):
        tgt_len = tgt.size(1)
        pad_mask = (tgt != self.tgt_pad_idx).unsqueeze(1).unsqueeze(3)
        causal = torch.tril(torch.ones(tgt_len, tgt_len, dtype=torch.bool))
        return pad_mask & causal  # [batch_size, 1, tgt_len, tgt_len]

    def forward(self, src, tgt):
        src_mask, tgt_mask = self.make_src_mask(src), self.make_tgt_mask(tgt)
        enc = self.src_emb(src)
        for layer in self.encoder:
            enc = layer(enc, src_mask)
        dec = self.tgt_emb(tgt)
        for layer in self.decoder:
            dec = layer(dec, enc, tgt_mask, src_mask)
        return self.linear(dec)


def main():
    torch.manual_seed(0)
    model = Transformer(src_pad_idx=0, tgt_pad_idx=0).eval()
    # teacher-forced training batch; source and target padded to the same length 6
    src = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]])
    tgt = torch.tensor([[1, 14, 15, 16, 17, 18], [1, 19, 20, 21, 0, 0]])
    with torch.no_grad():
        logits = model(src, tgt)
        # reference for the first decoder step: it must depend on the whole (unpadded) source sentence
        logits_alone = model(src[1:, :3], tgt[1:, :1])
    diff = (logits[1, 0] - logits_alone[0, 0]).abs().max().item()
    print(f"{'fixed' if FIXED else 'buggy'}: first-step logits, padded batch vs. unpadded pair: max diff = {diff:.4e}")


if __name__ == "__main__":
    main()
