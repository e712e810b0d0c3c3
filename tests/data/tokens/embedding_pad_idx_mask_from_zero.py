"""A left-padded batch whose model's embedding states padding_idx=1, but whose attention_mask is built as
`ids != 0` (the pad id taken for 0): the mask is all ones and the real tokens after the pad run attend it (python FILE;
--fixed: the mask from the model's own pad id)."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
PAD = 1


class TinyLM(nn.Module):
    def __init__(self, vocab=20, dim=16, heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.heads = heads

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def main():
    torch.manual_seed(0)
    ids = torch.tensor([[4, 9, 7, 12, 5, 6], [PAD, PAD, PAD, 8, 3, 11]])
    attention_mask = (ids != PAD) if FIXED else (ids != 0)
    with torch.no_grad():
        out = TinyLM()(ids, attention_mask.long())
    print("out[1,0,-1,:3] =", [round(v, 4) for v in out[1, 0, -1, :3].tolist()])


if __name__ == "__main__":
    main()
