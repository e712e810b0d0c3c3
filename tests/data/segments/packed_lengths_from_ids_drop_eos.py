"""A padding-free causal LM whose sequence lengths are counted from the ids, with the pad id equal to EOS.

Written for maskcli's tests, as padding-free training loops write it: the collator pads with the EOS id (a tokenizer
with no pad token) and returns `attention_mask` (1 = real, the closing EOS included); the model unpads the batch and
attends one sequence at a time, as a varlen kernel would. Bug: the lengths are `input_ids.ne(pad_id).sum(-1)`, which
drops every sequence's real closing EOS, so each segment is one token short. Fixed: the lengths are the mask's sums.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
EOS = 2


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, packed, seq_lens):
        out, start = torch.zeros_like(packed), 0
        q, k, v = self.qkv(packed).unflatten(-1, (3, self.heads, -1)).permute(1, 2, 0, 3).unbind(0)  # (h, T, d) each
        for n in seq_lens.tolist():
            piece = F.scaled_dot_product_attention(q[None, :, start:start + n], k[None, :, start:start + n],
                                                   v[None, :, start:start + n], is_causal=True)
            out[start:start + n] = piece[0].transpose(0, 1).flatten(1)
            start += n
        return out


class Model(nn.Module):
    def __init__(self, vocab=16, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = Attention(dim)

    def forward(self, input_ids, attention_mask):
        seq_lens = attention_mask.sum(-1) if FIXED else input_ids.ne(EOS).sum(-1)
        real = torch.arange(input_ids.shape[1])[None, :] < seq_lens[:, None]
        packed = self.embed(input_ids[real])  # (T, dim): every row's first seq_lens tokens
        return self.attn(packed, seq_lens)


if __name__ == "__main__":
    torch.manual_seed(0)
    input_ids = torch.tensor([[5, 6, 7, 8, 9, EOS], [5, 7, 9, EOS, EOS, EOS], [6, 8, EOS, EOS, EOS, EOS]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        out = Model().eval()(input_ids, attention_mask)
    print("packed tokens", tuple(out.shape))
