# The same bug as karpathy/nanochat#805, written another way: a sentence encoder's attention layer calls the
# project's shared `attention()` helper with is_causal=False, over a right-padded batch; the helper (written for the
# decoder) builds its mask from the lengths and always ANDs in the causal triangle, so the encoder runs causal.
# Fixed: the triangle only where the caller asks for it.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def attention(q, k, v, lengths, is_causal=True, dropout_p=0.0):
    """Hand-written softmax attention; lengths: (B,) real tokens of each row."""
    L = q.size(-2)
    keep = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, L) real keys
    if is_causal or not FIXED:
        keep = keep & torch.ones(L, L, dtype=torch.bool).tril()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class EncoderLayer(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))

    def forward(self, x, lengths):
        B, L, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = attention(q, k, v, lengths, is_causal=False)
        x = x + self.out(y.transpose(1, 2).reshape(B, L, D))
        return x + self.ff(self.ln2(x))


class SentenceEncoder(nn.Module):
    def __init__(self, vocab=100, d=32, n_layers=2, max_len=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList([EncoderLayer(d) for _ in range(n_layers)])

    def forward(self, input_ids, attention_mask):
        lengths = attention_mask.sum(-1)
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.size(1)))[None]
        for layer in self.layers:
            x = layer(x, lengths)
        m = attention_mask[..., None].float()
        return (x * m).sum(1) / m.sum(1)  # mean pooling over real tokens


def main():
    torch.manual_seed(0)
    model = SentenceEncoder().eval()
    sentences = [[5, 17, 9, 33, 2, 41, 8, 12], [7, 3, 19, 4, 0, 0, 0, 0]]  # 0 = pad, right-padded
    input_ids = torch.tensor(sentences)
    attention_mask = (input_ids != 0).long()
    with torch.no_grad():
        emb = model(input_ids, attention_mask)
    print(f"embedding norms: {emb.norm(dim=-1).tolist()}")


if __name__ == "__main__":
    main()
