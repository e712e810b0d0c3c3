"""One model: a bidirectional encoder layer, then a causal decoder layer. forward() builds both masks first and
holds the causal one as `mask` while the encoder is handed the padding alone (correct)."""
import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d=16, h=2):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, attn_mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).transpose(1, 2).reshape(b, t, d)


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = SelfAttention()
        self.decoder = SelfAttention()

    def forward(self, src, tgt, src_lengths):
        s, t = src.shape[1], tgt.shape[1]
        attention_mask = (torch.arange(s)[None, :] < src_lengths[:, None])[:, None, None, :]
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        memory = self.encoder(src, attention_mask)
        real = attention_mask[:, 0, 0, :, None]  # (the memory pooled over its real positions)
        pooled = (memory * real).sum(1, keepdim=True) / real.sum(1, keepdim=True)
        return pooled + self.decoder(tgt, mask)


def main():
    torch.manual_seed(0)
    with torch.no_grad():
        out = EncoderDecoder().eval()(torch.randn(2, 6, 16), torch.randn(2, 6, 16), torch.tensor([6, 4]))
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
