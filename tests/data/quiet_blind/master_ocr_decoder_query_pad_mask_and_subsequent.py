"""MASTER scene-text recogniser decoder: target mask = query-row pad mask & lower-triangular mask.

Follows wenwenyu/MASTER-pytorch model/transformer.py (Decoder._generate_target_mask: ``trg_pad_mask = (target != padding_symbol)
.unsqueeze(1).unsqueeze(3)`` -- a mask over QUERY rows, (b, 1, len, 1) -- and'ed with torch.tril; decode with
src_mask None over the flattened CNN feature map; greedy_decode re-running the decoder on the growing prefix)
and its dot_product_attention (``scores.masked_fill(mask == 0, -1e9)`` then softmax; MultiHeadAttention).
Mask meant: each real target character sees itself and earlier characters; padded target rows are blanked (their
outputs are ignored by the loss, which uses ignore_index=padding_symbol); the image memory is fully visible
(fixed-size images have no padding).
"""
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def clones(module, N):
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


def attention(query, key, value, mask=None, dropout=None):
    d_k = query.size(-1)
    score = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        score = score.masked_fill(mask == 0, -1e9)
    p_attn = F.softmax(score, dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadAttention(nn.Module):
    def __init__(self, headers, d_model, dropout=0.0):
        super().__init__()
        self.d_k = d_model // headers
        self.headers = headers
        self.linears = clones(nn.Linear(d_model, d_model), 4)
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        nbatches = query.size(0)
        query, key, value = [l(x).view(nbatches, -1, self.headers, self.d_k).transpose(1, 2)
                             for l, x in zip(self.linears, (query, key, value))]
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.headers * self.d_k)
        return self.linears[-1](x)


class DecoderLayer(nn.Module):
    def __init__(self, d_model=32, headers=4):
        super().__init__()
        self.self_attn = MultiHeadAttention(headers, d_model)
        self.src_attn = MultiHeadAttention(headers, d_model)
        self.feed_forward = nn.Sequential(nn.Linear(d_model, 64), nn.ReLU(), nn.Linear(64, d_model))
        self.norms = clones(nn.LayerNorm(d_model), 3)

    def forward(self, x, memory, src_mask, tgt_mask):
        x = x + self.self_attn(self.norms[0](x), self.norms[0](x), self.norms[0](x), tgt_mask)
        x = x + self.src_attn(self.norms[1](x), memory, memory, src_mask)
        return x + self.feed_forward(self.norms[2](x))


class MASTER(nn.Module):
    def __init__(self, n_class=12, d_model=32, padding_symbol=0, max_len=16):
        super().__init__()
        self.padding_symbol = padding_symbol
        self.conv_embedding_gc = nn.Sequential(nn.Conv2d(3, d_model, 3, stride=2, padding=1), nn.ReLU(),
                                               nn.Conv2d(d_model, d_model, 3, stride=2, padding=1))
        self.embedding = nn.Embedding(n_class, d_model)
        self.pe = nn.Parameter(torch.randn(1, max_len, d_model) * 0.02)
        self.layers = clones(DecoderLayer(d_model), 2)
        self.norm = nn.LayerNorm(d_model)
        self.generator = nn.Linear(d_model, n_class)

    def make_mask(self, target):
        trg_pad_mask = (target != self.padding_symbol).unsqueeze(1).unsqueeze(3)  # (b, 1, len_src, 1)
        tgt_len = target.size(1)
        trg_sub_mask = torch.tril(torch.ones((tgt_len, tgt_len), dtype=torch.uint8, device=target.device))
        tgt_mask = trg_pad_mask & trg_sub_mask.bool()
        return None, tgt_mask

    def encode(self, src):
        feature = self.conv_embedding_gc(src)
        b, c, h, w = feature.shape
        return feature.view(b, c, h * w).permute(0, 2, 1)

    def decode(self, memory, src_mask, target, target_mask):
        x = self.embedding(target) + self.pe[:, :target.size(1)]
        for layer in self.layers:
            x = layer(x, memory, src_mask, target_mask)
        return self.norm(x)

    def forward(self, src, target):
        src_mask, target_mask = self.make_mask(target)
        return self.generator(self.decode(self.encode(src), src_mask, target, target_mask))


def greedy_decode(model, src, max_len, start_symbol):
    memory = model.encode(src)
    ys = torch.full((src.size(0), 1), start_symbol, dtype=torch.long)
    for _ in range(max_len - 1):
        _, target_mask = model.make_mask(ys)
        out = model.decode(memory, None, ys, target_mask)
        prob = model.generator(out[:, -1])
        # an untrained model may rank PAD first; a PAD inside the prefix would blank its own query row
        prob[:, model.padding_symbol] = float("-inf")
        next_word = prob.argmax(-1, keepdim=True)
        ys = torch.cat([ys, next_word], dim=1)
    return ys


def main():
    torch.manual_seed(0)
    model = MASTER().eval()
    images = torch.randn(2, 3, 16, 32)
    sos, eos, pad = 1, 2, 0
    target = torch.tensor([[sos, 5, 7, 9, 4, eos, pad, pad],
                           [sos, 3, eos, pad, pad, pad, pad, pad]])
    lengths = [6, 3]
    with torch.no_grad():
        logits = model(images, target)
        for b, n in enumerate(lengths):
            alone = model(images[b:b + 1], target[b:b + 1, :n])
            assert torch.allclose(logits[b, :n], alone[0], atol=1e-5)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 12), target[:, 1:].reshape(-1), ignore_index=pad)
        ys = greedy_decode(model, images, 6, sos)
        assert not torch.any(ys == pad)
        full = model(images, ys)[:, :-1]
        full[..., pad] = float("-inf")
        assert torch.equal(full.argmax(-1), ys[:, 1:])
    print("master decoder ok loss=%.3f" % loss.item(), ys.tolist())


if __name__ == "__main__":
    main()
