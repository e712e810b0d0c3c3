"""A BART-style decoder layer (eager, its scores laid (bsz * num_heads, tgt_len, src_len)) over a left-padded decoder
prefix: the causal bias (-1e8 above the diagonal) and the padding bias (-1e8 on the pads) are added to the scores, so a
padded query's row is lowered everywhere and its weight goes to the keys lowered least (its own pad and the later real
tokens). The model states `is_decoder=True`. Correct: those rows are padding (the decoder's attention_mask says so),
and no real query sees a later key."""

import torch


class DecoderAttention(torch.nn.Module):
    def __init__(self, dim=16, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim, self.is_decoder = num_heads, dim // num_heads, True
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))

    def forward(self, hidden, bias):
        bsz, tgt, dim = hidden.shape
        shape = (bsz, tgt, self.num_heads, self.head_dim)
        q, k, v = (p(hidden).view(shape).transpose(1, 2).reshape(bsz * self.num_heads, tgt, self.head_dim)
                   for p in (self.q, self.k, self.v))
        scores = torch.bmm(q, k.transpose(1, 2)) * self.head_dim ** -0.5
        scores = scores.view(bsz, self.num_heads, tgt, tgt) + bias
        weights = scores.view(bsz * self.num_heads, tgt, tgt).softmax(-1)
        out = torch.bmm(weights, v).view(bsz, self.num_heads, tgt, self.head_dim).transpose(1, 2).reshape(bsz, tgt, dim)
        return hidden + out


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(30, 16)
        self.layers = torch.nn.ModuleList(DecoderAttention() for _ in range(2))

    def forward(self, input_ids, attention_mask):
        tgt = input_ids.shape[1]
        causal = torch.triu(torch.full((tgt, tgt), -1e8), diagonal=1)
        bias = causal[None, None] + (1.0 - attention_mask[:, None, None, :].float()) * -1e8
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, bias)
        return x


torch.manual_seed(0)
ids = torch.tensor([[2, 11, 12, 13, 14, 15], [1, 1, 2, 21, 22, 23]])
mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
with torch.no_grad():
    out = Decoder()(ids, mask)
print("real rows' norm:", round(out[mask.bool()].norm().item(), 4))
