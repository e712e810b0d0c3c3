"""Encoder-decoder attention as harvardnlp/annotated-transformer writes it (the_annotated_transformer.py).

`attention()` fills masked scores with -1e9, softmaxes, keeps `p_attn` on the module (`self.attn`) for
visualisation and applies attention dropout to the weights it multiplies with V. Masks: src_mask [B, 1, S] from
`src != pad` (key padding only); tgt_mask [B, T, T] = `(tgt != pad).unsqueeze(-2) & subsequent_mask(T)`; the
decoder's cross-attention uses src_mask. Pad query rows are computed but dropped by the loss (pad targets ignored).
"""
import copy
import math

import torch
import torch.nn as nn


def subsequent_mask(size):
    attn_shape = (1, size, size)
    subsequent = torch.triu(torch.ones(attn_shape), diagonal=1).type(torch.uint8)
    return subsequent == 0


def attention(query, key, value, mask=None, dropout=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        self.d_k = d_model // h
        self.h = h
        self.linears = nn.ModuleList([copy.deepcopy(nn.Linear(d_model, d_model)) for _ in range(4)])
        self.attn = None
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)  # same mask for all heads
        nbatches = query.size(0)
        query, key, value = [
            lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
            for lin, x in zip(self.linears, (query, key, value))
        ]
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        return self.linears[-1](x)


class Batch:
    """Object for holding a batch of data with mask during training."""

    def __init__(self, src, tgt=None, pad=2):
        self.src = src
        self.src_mask = (src != pad).unsqueeze(-2)
        if tgt is not None:
            self.tgt = tgt[:, :-1]
            self.tgt_y = tgt[:, 1:]
            self.tgt_mask = self.make_std_mask(self.tgt, pad)
            self.ntokens = (self.tgt_y != pad).data.sum()

    @staticmethod
    def make_std_mask(tgt, pad):
        tgt_mask = (tgt != pad).unsqueeze(-2)
        tgt_mask = tgt_mask & subsequent_mask(tgt.size(-1)).type_as(tgt_mask.data)
        return tgt_mask


def main():
    torch.manual_seed(0)
    pad, d_model, h, vocab = 2, 32, 4, 11
    src = torch.tensor([[0, 5, 6, 7, 8, 1], [0, 9, 4, 1, pad, pad]])
    tgt = torch.tensor([[0, 7, 3, 4, 1, pad, pad], [0, 3, 1, pad, pad, pad, pad]])
    batch = Batch(src, tgt, pad)
    emb = nn.Embedding(vocab, d_model)
    self_attn = MultiHeadedAttention(h, d_model)
    enc_attn = MultiHeadedAttention(h, d_model)
    dec_self = MultiHeadedAttention(h, d_model)
    dec_src = MultiHeadedAttention(h, d_model)
    proj = nn.Linear(d_model, vocab)
    for m in (self_attn, enc_attn, dec_self, dec_src, proj):
        m.train()
    x = emb(batch.src)
    memory = x + self_attn(x, x, x, batch.src_mask)
    memory = memory + enc_attn(memory, memory, memory, batch.src_mask)
    y = emb(batch.tgt)
    y = y + dec_self(y, y, y, batch.tgt_mask)
    y = y + dec_src(y, memory, memory, batch.src_mask)
    logits = proj(y)
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), batch.tgt_y.reshape(-1), ignore_index=pad)
    loss.backward()
    # the saved weights give zero mass to masked keys (dropout scales kept entries only)
    assert float(dec_src.attn.detach()[1][..., 4:].abs().sum()) == 0.0
    assert float(dec_self.attn.detach()[0, :, 0, 1:].abs().sum()) == 0.0
    print(f"loss {loss.item():.4f} ntokens {int(batch.ntokens)}")


if __name__ == "__main__":
    main()
