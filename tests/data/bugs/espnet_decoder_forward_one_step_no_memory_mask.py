"""ESPnet TransformerDecoder.forward_one_step: incremental decoding cannot mask padded encoder frames.

Citation: espnet/espnet PR #5679 "TransformerDecoder forward_one_step with memory_mask" (merged
2024-02-26, by albertz). From the PR description: `BaseTransformerDecoder.forward_one_step` had no
`memory_mask` argument and called every `DecoderLayer` with `memory_mask=None`; doing batched beam
search over several utterances (memory batch > 1, padded to the longest) therefore let the
source-attention attend to the padded encoder frames. The fix adds `memory_mask` (batch, 1, maxlen_in)
to `forward_one_step` and passes it to the layers (and makes `cache` keyword-only). The reviewer notes
ESPnet's own beam search decoded one utterance at a time, so only batched callers were affected. I read
the PR description and the post-fix source, not the diff.

This program keeps espnet's `DecoderLayer` (cache: only the last position is a query; the new output is
concatenated to the cache), `MultiHeadedAttention.forward_attention` (mask `.eq(0)`, `finfo.min`,
softmax, zero fill), `subsequent_mask`, `make_pad_mask`, and `forward_one_step`. A batched greedy decode
over two utterances with encoder lengths 9 and 5 runs 3 incremental steps; the caller has the
`memory_mask` from `make_pad_mask(hlens)` but before the fix has no way to pass it. `--fixed` uses the
post-fix signature.
"""
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def make_pad_mask(lengths, maxlen=None):
    maxlen = int(lengths.max()) if maxlen is None else maxlen
    return torch.arange(maxlen)[None, :] >= lengths[:, None]


def subsequent_mask(size, device="cpu", dtype=torch.bool):
    ret = torch.ones(size, size, device=device, dtype=dtype)
    return torch.tril(ret, out=ret)


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            min_value = torch.finfo(scores.dtype).min
            scores = scores.masked_fill(mask, min_value)
            self.attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            self.attn = torch.softmax(scores, dim=-1)  # (batch, head, time1, time2)
        p_attn = self.dropout(self.attn)
        x = torch.matmul(p_attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class DecoderLayer(nn.Module):
    def __init__(self, size, self_attn, src_attn, feed_forward, dropout_rate, normalize_before=True):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size)
        self.norm2 = nn.LayerNorm(size)
        self.norm3 = nn.LayerNorm(size)
        self.dropout = nn.Dropout(dropout_rate)
        self.normalize_before = normalize_before

    def forward(self, tgt, tgt_mask, memory, memory_mask, cache=None):
        residual = tgt
        if self.normalize_before:
            tgt = self.norm1(tgt)
        if cache is None:
            tgt_q = tgt
            tgt_q_mask = tgt_mask
        else:
            # compute only the last frame query keeping dim: max_time_out -> 1
            tgt_q = tgt[:, -1:, :]
            residual = residual[:, -1:, :]
            tgt_q_mask = None
            if tgt_mask is not None:
                tgt_q_mask = tgt_mask[:, -1:, :]
        x = residual + self.dropout(self.self_attn(tgt_q, tgt, tgt, tgt_q_mask))
        residual = x
        if self.normalize_before:
            x = self.norm2(x)
        x = residual + self.dropout(self.src_attn(x, memory, memory, memory_mask))
        residual = x
        if self.normalize_before:
            x = self.norm3(x)
        x = residual + self.dropout(self.feed_forward(x))
        if cache is not None:
            x = torch.cat([cache, x], dim=1)
        return x, tgt_mask, memory, memory_mask


class TransformerDecoder(nn.Module):
    def __init__(self, vocab_size, encoder_output_size, attention_heads=2, linear_units=64, num_blocks=2):
        super().__init__()
        d = encoder_output_size
        self.embed = nn.Embedding(vocab_size, d)
        self.decoders = nn.ModuleList(
            DecoderLayer(d, MultiHeadedAttention(attention_heads, d, 0.0), MultiHeadedAttention(attention_heads, d, 0.0),
                         nn.Sequential(nn.Linear(d, linear_units), nn.ReLU(), nn.Linear(linear_units, d)), 0.0)
            for _ in range(num_blocks))
        self.after_norm = nn.LayerNorm(d)
        self.output_layer = nn.Linear(d, vocab_size)

    if FIXED:
        def forward_one_step(self, tgt, tgt_mask, memory, memory_mask=None, *, cache=None):
            x = self.embed(tgt)
            if cache is None:
                cache = [None] * len(self.decoders)
            new_cache = []
            for c, decoder in zip(cache, self.decoders):
                x, tgt_mask, memory, memory_mask = decoder(x, tgt_mask, memory, memory_mask, cache=c)
                new_cache.append(x)
            y = self.after_norm(x[:, -1])
            y = torch.log_softmax(self.output_layer(y), dim=-1)
            return y, new_cache
    else:
        def forward_one_step(self, tgt, tgt_mask, memory, cache=None):
            x = self.embed(tgt)
            if cache is None:
                cache = [None] * len(self.decoders)
            new_cache = []
            for c, decoder in zip(cache, self.decoders):
                x, tgt_mask, memory, memory_mask = decoder(x, tgt_mask, memory, None, cache=c)
                new_cache.append(x)
            y = self.after_norm(x[:, -1])
            y = torch.log_softmax(self.output_layer(y), dim=-1)
            return y, new_cache


def main():
    torch.manual_seed(0)
    sos = 1
    decoder = TransformerDecoder(vocab_size=20, encoder_output_size=16).eval()
    hlens = torch.tensor([9, 5])
    memory = torch.randn(2, 9, 16)  # encoder output, utterance 2 padded after frame 5
    memory_mask = (~make_pad_mask(hlens, maxlen=memory.size(1)))[:, None, :]
    ys = torch.full((2, 1), sos)
    cache = None
    with torch.no_grad():
        for _ in range(3):
            ys_mask = subsequent_mask(ys.size(-1)).unsqueeze(0)
            if FIXED:
                logp, cache = decoder.forward_one_step(ys, ys_mask, memory, memory_mask, cache=cache)
            else:
                logp, cache = decoder.forward_one_step(ys, ys_mask, memory, cache=cache)
            ys = torch.cat([ys, logp.argmax(-1, keepdim=True)], dim=1)
    print("fixed" if FIXED else "buggy", ys.tolist(), round(float(logp[1].sum()), 3))


if __name__ == "__main__":
    main()
