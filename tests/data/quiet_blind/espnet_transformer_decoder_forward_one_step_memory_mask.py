"""ESPnet transformer ASR decoder: batch scoring with ``forward_one_step`` (self-attn cache) and memory masks.

Follows espnet/espnet espnet/nets/pytorch_backend/transformer/attention.py (MultiHeadedAttention.forward_attention:
``mask = mask.unsqueeze(1).eq(0)``, ``scores.masked_fill(mask, min_value)``, softmax, then the probabilities are
masked_fill'ed to 0.0), transformer/mask.py (subsequent_mask), nets_utils.py (make_pad_mask, True = pad, used
as ``~make_pad_mask(...)``) and transformer/decoder.py (Decoder.forward_one_step: with a cache only the last
query is computed, tgt_mask[:, -1:, :], memory_mask over the padded encoder frames).
Mask meant: decoder self-attention causal over the hypothesis; source attention over each utterance's real
frames (hlens) only.
"""
import math

import torch
import torch.nn as nn


def make_pad_mask(lengths, maxlen=None):
    """True at padded positions."""
    maxlen = int(max(lengths)) if maxlen is None else maxlen
    seq_range = torch.arange(0, maxlen, dtype=torch.int64)
    seq_length_expand = torch.as_tensor(lengths).unsqueeze(-1)
    return seq_range.unsqueeze(0) >= seq_length_expand


def subsequent_mask(size, device="cpu", dtype=torch.bool):
    ret = torch.ones(size, size, device=device, dtype=dtype)
    return torch.tril(ret, out=ret)


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.attn = None

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2), True = hidden
            min_value = torch.finfo(scores.dtype).min
            scores = scores.masked_fill(mask, min_value)
            self.attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            self.attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(self.attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class DecoderLayer(nn.Module):
    def __init__(self, size, n_head):
        super().__init__()
        self.self_attn = MultiHeadedAttention(n_head, size)
        self.src_attn = MultiHeadedAttention(n_head, size)
        self.feed_forward = nn.Sequential(nn.Linear(size, 2 * size), nn.ReLU(), nn.Linear(2 * size, size))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(size), nn.LayerNorm(size), nn.LayerNorm(size)

    def forward(self, tgt, tgt_mask, memory, memory_mask, cache=None):
        residual = tgt
        tgt = self.norm1(tgt)
        if cache is None:
            tgt_q, tgt_q_mask = tgt, tgt_mask
        else:
            # compute only the last frame query keeping dim: max_time_out -> 1
            tgt_q = tgt[:, -1:, :]
            residual = residual[:, -1:, :]
            tgt_q_mask = None if tgt_mask is None else tgt_mask[:, -1:, :]
        x = residual + self.self_attn(tgt_q, tgt, tgt, tgt_q_mask)
        residual = x
        x = residual + self.src_attn(self.norm2(x), memory, memory, memory_mask)
        residual = x
        x = residual + self.feed_forward(self.norm3(x))
        if cache is not None:
            x = torch.cat([cache, x], dim=1)
        return x, tgt_mask, memory, memory_mask


class Decoder(nn.Module):
    def __init__(self, odim, adim=16, heads=4, num_blocks=2):
        super().__init__()
        self.embed = nn.Embedding(odim, adim)
        self.decoders = nn.ModuleList([DecoderLayer(adim, heads) for _ in range(num_blocks)])
        self.after_norm = nn.LayerNorm(adim)
        self.output_layer = nn.Linear(adim, odim)

    def forward(self, tgt, tgt_mask, memory, memory_mask):
        x = self.embed(tgt)
        for layer in self.decoders:
            x, tgt_mask, memory, memory_mask = layer(x, tgt_mask, memory, memory_mask)
        return self.output_layer(self.after_norm(x)), tgt_mask

    def forward_one_step(self, tgt, tgt_mask, memory, memory_mask=None, cache=None):
        x = self.embed(tgt)
        if cache is None:
            cache = [None] * len(self.decoders)
        new_cache = []
        for c, decoder in zip(cache, self.decoders):
            x, tgt_mask, memory, memory_mask = decoder(x, tgt_mask, memory, memory_mask, cache=c)
            new_cache.append(x)
        y = torch.log_softmax(self.output_layer(self.after_norm(x[:, -1])), dim=-1)
        return y, new_cache


def main():
    torch.manual_seed(0)
    odim, sos = 12, 11
    hlens = torch.tensor([9, 6, 4])
    memory = torch.randn(3, 9, 16)  # encoder output, padded frames after hlens
    memory_mask = (~make_pad_mask(hlens.tolist(), 9)).unsqueeze(-2)  # (B, 1, T), True = real frame
    dec = Decoder(odim).eval()
    ys = torch.full((3, 1), sos, dtype=torch.long)
    cache, steps = None, []
    with torch.no_grad():
        for _ in range(5):  # greedy batch decoding
            ys_mask = subsequent_mask(ys.size(-1)).unsqueeze(0)
            logp, cache = dec.forward_one_step(ys, ys_mask, memory, memory_mask, cache=cache)
            steps.append(logp)
            ys = torch.cat([ys, logp.argmax(-1, keepdim=True)], dim=1)
        # teacher-forced full pass over the same hypothesis must give the same scores
        full, _ = dec(ys[:, :-1], subsequent_mask(5).unsqueeze(0), memory, memory_mask)
        assert torch.allclose(torch.log_softmax(full, -1), torch.stack(steps, 1), atol=1e-5)
        # each utterance alone, unpadded, gives the same scores: pad frames are never attended
        for b, n in enumerate(hlens.tolist()):
            alone, _ = dec(ys[b:b + 1, :-1], subsequent_mask(5).unsqueeze(0), memory[b:b + 1, :n], None)
            assert torch.allclose(alone[0], full[b], atol=1e-5)
    print("espnet forward_one_step ok", ys.tolist())


if __name__ == "__main__":
    main()
