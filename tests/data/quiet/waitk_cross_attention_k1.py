"""Wait-k simultaneous translation (Ma et al. 2019, STACL; fairseq's examples/simultaneous_translation and
elbayadm/attn2d's `waitk` transformer): the decoder starts after k source tokens and then reads one more per target
token, so target step t may attend source tokens 0 .. t + k - 1 only. The program states its policy (`args.waitk`,
an argparse Namespace as fairseq keeps it) and builds the cross-attention mask from it, as attn2d's
`buffered_future_mask`-like `waitk` mask does: `torch.ones(T, S).triu(waitk)` marks the source not yet read.

With waitk = 1 that mask is the causal triangle over the source, on purpose: target i sees source 0..i. The
cross-attention module says it is one (`attention_type = "cross"`, as Megatron / TransformerEngine name it); its
triangle is the stated policy, not the self-attention's causal mask handed over by mistake. The encoder is
unidirectional too (a simultaneous encoder must not read ahead), the decoder's self-attention causal."""
import argparse

import torch
import torch.nn.functional as F
from torch import nn


class MultiheadAttention(nn.Module):
    def __init__(self, d, heads, attention_type="self"):
        super().__init__()
        self.heads, self.attention_type = heads, attention_type
        self.q_proj = nn.Linear(d, d)
        self.kv_proj = nn.Linear(d, 2 * d)

    def forward(self, query, key_value, future_mask):
        b, t, d = query.shape
        s = key_value.shape[1]
        q = self.q_proj(query).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = self.kv_proj(key_value).view(b, s, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        scores = scores.masked_fill(future_mask, float("-inf"))  # True = not read yet
        return (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, d)


class DecoderLayer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.self_attn = MultiheadAttention(d, heads)
        self.cross_attn = MultiheadAttention(d, heads, attention_type="cross")

    def forward(self, x, encoder_out, self_mask, waitk_mask):
        x = x + self.self_attn(x, x, self_mask)
        return x + self.cross_attn(x, encoder_out, waitk_mask)


class WaitkTransformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(32, args.d)
        self.encoder = nn.ModuleList(MultiheadAttention(args.d, args.heads) for _ in range(args.layers))
        self.decoder = nn.ModuleList(DecoderLayer(args.d, args.heads) for _ in range(args.layers))

    def waitk_mask(self, tgt_len, src_len):
        """True where target t would read source s >= t + waitk: not yet read under the wait-k policy."""
        return torch.ones(tgt_len, src_len, dtype=torch.bool).triu(self.args.waitk)

    def forward(self, src_tokens, prev_output_tokens):
        src_len, tgt_len = src_tokens.shape[1], prev_output_tokens.shape[1]
        enc_mask = torch.ones(src_len, src_len, dtype=torch.bool).triu(1)  # unidirectional encoder
        x = self.embed(src_tokens)
        for layer in self.encoder:
            x = x + layer(x, x, enc_mask)
        y = self.embed(prev_output_tokens)
        self_mask = torch.ones(tgt_len, tgt_len, dtype=torch.bool).triu(1)
        cross_mask = self.waitk_mask(tgt_len, src_len)
        for layer in self.decoder:
            y = layer(y, x, self_mask, cross_mask)
        return y


def main():
    torch.manual_seed(0)
    args = argparse.Namespace(waitk=1, d=16, heads=2, layers=2)
    model = WaitkTransformer(args).eval()
    with torch.no_grad():
        out = model(torch.randint(1, 32, (2, 5)), torch.randint(1, 32, (2, 5)))
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
