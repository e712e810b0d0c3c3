"""A correct decoder written as OpenNMT-py's fix of #2464 runs it: the decoder's self-attention is handed its
`dec_mask` (target padding or-ed with the future, True = masked, expanded to (B, 1, T, T)) and calls SDPA with
`attn_mask=None, is_causal=True`, which over a RIGHT-padded batch is the same for every real query: no real query has
a padding key before it. Only padding queries differ (their own key, masked in dec_mask, is kept by is_causal), and
their outputs are never read: the loss skips them. Checked against each target run alone, unpadded.
"""
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class SelfAttention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, mask=None):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, None, 0.0, is_causal=mask is not None)
        return x + out.transpose(1, 2).reshape(b, t, -1)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.layers = nn.ModuleList(SelfAttention() for _ in range(2))

    def forward(self, tgt):
        pad = tgt.eq(0)  # [B, T]
        t = tgt.shape[1]
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        dec_mask = (pad[:, None, :] | future[None]).unsqueeze(1).expand(-1, -1, t, -1)  # [B, 1, T, T], True = masked
        x = self.embed(tgt)
        for layer in self.layers:
            x = layer(x, mask=dec_mask)
        return x


def main():
    decoder = Decoder().eval()
    rows = [[3, 5, 7, 9, 11], [4, 6], [8, 2, 13]]
    tgt = torch.zeros(len(rows), 5, dtype=torch.long)
    for i, r in enumerate(rows):
        tgt[i, :len(r)] = torch.tensor(r)
    with torch.no_grad():
        out = decoder(tgt)
        alone = [decoder(torch.tensor([r]))[0] for r in rows]
    print("real tokens as run alone:", all(torch.allclose(out[i, :len(r)], alone[i], atol=1e-5) for i, r in enumerate(rows)))


if __name__ == "__main__":
    main()
