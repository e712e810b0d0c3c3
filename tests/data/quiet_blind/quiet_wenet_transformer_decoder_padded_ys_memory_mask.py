"""Correct program (quiet batch quiet-r81b).

Ported from wenet-e2e/wenet: wenet/transformer/decoder.py @a9a9ed45c2c4e636f2a2237782ea74355f803388
(TransformerDecoder.forward: tgt_mask = ~make_pad_mask(ys_in_lens, maxlen).unsqueeze(1) & subsequent_mask),
wenet/transformer/decoder_layer.py @ccd1a6184a69d736ec964200e85f7b62bb8c7a72 (DecoderLayer.forward, pre-norm),
wenet/transformer/attention.py @7469e6c59a6356816dffc648bd09f01cdfa4ef85 (MultiHeadedAttention.forward_qkv /
forward_attention: mask.unsqueeze(1).eq(0), -inf fill, softmax, zero fill), wenet/utils/mask.py (make_pad_mask,
subsequent_mask), wenet/utils/common.py (add_sos_eos, IGNORE_ID) and wenet/transformer/asr_model.py
(ASRModel._calc_att_loss, attention rescoring's batched hypotheses), trimmed to the attention decoder.

The encoder output `memory` (B, T, D) is right-padded with non-zero frames (as a conformer leaves them) and comes
with `memory_mask = ~make_pad_mask(encoder_out_lens, T).unsqueeze(1)` (B, 1, T). The padded transcripts are
`ys_pad` filled with IGNORE_ID; add_sos_eos pads ys_in_pad with eos and ys_out_pad with IGNORE_ID, and
ys_in_lens = ys_pad_lens + 1. The decoder's self-attention mask is (B, L, L) padding & causal; the source
attention takes memory_mask. The label-smoothing loss skips IGNORE_ID targets.

Self-check (eval mode): decoder log-probs at each real target position equal each utterance decoded alone
(no padding in memory or targets); the summed loss equals a double loop over utterance x target position;
attention rescoring of N padded hypotheses of one utterance (memory repeated, as _forward_attention_rescoring does)
scores each hypothesis as it scores alone.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_ID = -1


def make_pad_mask(lengths: torch.Tensor, max_len: int = 0) -> torch.Tensor:
    batch_size = lengths.size(0)
    max_len = max_len if max_len > 0 else lengths.max().item()
    seq_range = torch.arange(0, max_len, dtype=torch.int64, device=lengths.device)
    seq_range_expand = seq_range.unsqueeze(0).expand(batch_size, max_len)
    seq_length_expand = lengths.unsqueeze(-1)
    mask = seq_range_expand >= seq_length_expand
    return mask


def subsequent_mask(size: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    arange = torch.arange(size, device=device)
    mask = arange.expand(size, size)
    arange = arange.unsqueeze(-1)
    mask = mask <= arange
    return mask


def pad_list(xs, pad_value):
    max_len = max([len(item) for item in xs])
    batchs = len(xs)
    pad_res = torch.full((batchs, max_len), pad_value, dtype=xs[0].dtype)
    for i in range(batchs):
        pad_res[i, : len(xs[i])] = xs[i]
    return pad_res


def add_sos_eos(ys_pad: torch.Tensor, sos: int, eos: int, ignore_id: int):
    _sos = torch.tensor([sos], dtype=torch.long, requires_grad=False, device=ys_pad.device)
    _eos = torch.tensor([eos], dtype=torch.long, requires_grad=False, device=ys_pad.device)
    ys = [y[y != ignore_id] for y in ys_pad]  # parse padded ys
    ys_in = [torch.cat([_sos, y], dim=0) for y in ys]
    ys_out = [torch.cat([y, _eos], dim=0) for y in ys]
    return pad_list(ys_in, eos), pad_list(ys_out, ignore_id)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, dropout_rate: float, max_len: int = 5000):
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(self.d_model)
        self.dropout = nn.Dropout(p=dropout_rate)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x: torch.Tensor, offset: int = 0):
        pos_emb = self.pe[:, offset : offset + x.size(1)]
        x = x * self.xscale + pos_emb
        return self.dropout(x), self.dropout(pos_emb)


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head: int, n_feat: int, dropout_rate: float):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask.size(2) > 0:  # time2 > 0
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            mask = mask[:, :, :, : scores.size(-1)]
            scores = scores.masked_fill(mask, -float("inf"))
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        p_attn = self.dropout(attn)
        x = torch.matmul(p_attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim: int, hidden_units: int, dropout_rate: float):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.activation = nn.ReLU()
        self.dropout = nn.Dropout(dropout_rate)
        self.w_2 = nn.Linear(hidden_units, idim)

    def forward(self, xs):
        return self.w_2(self.dropout(self.activation(self.w_1(xs))))


class DecoderLayer(nn.Module):
    def __init__(self, size, self_attn, src_attn, feed_forward, dropout_rate, normalize_before=True):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size, eps=1e-5)
        self.norm2 = nn.LayerNorm(size, eps=1e-5)
        self.norm3 = nn.LayerNorm(size, eps=1e-5)
        self.dropout = nn.Dropout(dropout_rate)
        self.normalize_before = normalize_before

    def forward(self, tgt, tgt_mask, memory, memory_mask):
        residual = tgt
        if self.normalize_before:
            tgt = self.norm1(tgt)
        tgt_q = tgt
        tgt_q_mask = tgt_mask
        x = residual + self.dropout(self.self_attn(tgt_q, tgt, tgt, tgt_q_mask))
        if not self.normalize_before:
            x = self.norm1(x)

        residual = x
        if self.normalize_before:
            x = self.norm2(x)
        x = residual + self.dropout(self.src_attn(x, memory, memory, memory_mask))
        if not self.normalize_before:
            x = self.norm2(x)

        residual = x
        if self.normalize_before:
            x = self.norm3(x)
        x = residual + self.dropout(self.feed_forward(x))
        if not self.normalize_before:
            x = self.norm3(x)
        return x, tgt_mask, memory, memory_mask


class TransformerDecoder(nn.Module):
    def __init__(self, vocab_size, encoder_output_size, attention_heads=4, linear_units=64, num_blocks=2,
                 dropout_rate=0.1, positional_dropout_rate=0.1, self_attention_dropout_rate=0.0,
                 src_attention_dropout_rate=0.0, normalize_before=True):
        super().__init__()
        attention_dim = encoder_output_size
        self.embed = nn.Sequential(
            nn.Embedding(vocab_size, attention_dim),
            PositionalEncoding(attention_dim, positional_dropout_rate),
        )
        self.normalize_before = normalize_before
        self.after_norm = nn.LayerNorm(attention_dim, eps=1e-5)
        self.output_layer = nn.Linear(attention_dim, vocab_size)
        self.decoders = nn.ModuleList([
            DecoderLayer(
                attention_dim,
                MultiHeadedAttention(attention_heads, attention_dim, self_attention_dropout_rate),
                MultiHeadedAttention(attention_heads, attention_dim, src_attention_dropout_rate),
                PositionwiseFeedForward(attention_dim, linear_units, dropout_rate),
                dropout_rate,
                normalize_before,
            ) for _ in range(num_blocks)
        ])

    def forward(self, memory, memory_mask, ys_in_pad, ys_in_lens):
        tgt = ys_in_pad
        maxlen = tgt.size(1)
        # tgt_mask: (B, 1, L)
        tgt_mask = ~make_pad_mask(ys_in_lens, maxlen).unsqueeze(1)
        tgt_mask = tgt_mask.to(tgt.device)
        # m: (1, L, L)
        m = subsequent_mask(tgt_mask.size(-1), device=tgt_mask.device).unsqueeze(0)
        # tgt_mask: (B, L, L)
        tgt_mask = tgt_mask & m
        x, _ = self.embed(tgt)
        for layer in self.decoders:
            x, tgt_mask, memory, memory_mask = layer(x, tgt_mask, memory, memory_mask)
        if self.normalize_before:
            x = self.after_norm(x)
        x = self.output_layer(x)
        olens = tgt_mask.sum(1)
        return x, torch.tensor(0.0), olens


class LabelSmoothingLoss(nn.Module):
    def __init__(self, size, padding_idx, smoothing, normalize_length=False):
        super().__init__()
        self.criterion = nn.KLDivLoss(reduction="none")
        self.padding_idx = padding_idx
        self.confidence = 1.0 - smoothing
        self.smoothing = smoothing
        self.size = size
        self.normalize_length = normalize_length

    def forward(self, x, target):
        batch_size = x.size(0)
        x = x.view(-1, self.size)
        target = target.view(-1)
        true_dist = torch.zeros_like(x)
        true_dist.fill_(self.smoothing / (self.size - 1))
        ignore = target == self.padding_idx  # (B,)
        total = len(target) - ignore.sum().item()
        target = target.masked_fill(ignore, 0)  # avoid -1 index
        true_dist.scatter_(1, target.unsqueeze(1), self.confidence)
        kl = self.criterion(torch.log_softmax(x, dim=1), true_dist)
        denom = total if self.normalize_length else batch_size
        return kl.masked_fill(ignore.unsqueeze(1), 0).sum() / denom


def calc_att_loss(decoder, criterion, encoder_out, encoder_mask, ys_pad, ys_pad_lens, sos, eos):
    """ASRModel._calc_att_loss, left-to-right decoder only (reverse_weight = 0)."""
    ys_in_pad, ys_out_pad = add_sos_eos(ys_pad, sos, eos, IGNORE_ID)
    ys_in_lens = ys_pad_lens + 1
    decoder_out, _, _ = decoder(encoder_out, encoder_mask, ys_in_pad, ys_in_lens)
    loss_att = criterion(decoder_out, ys_out_pad)
    return loss_att, decoder_out, ys_out_pad


torch.manual_seed(0)
vocab_size, D = 10, 32
sos = eos = vocab_size - 1
decoder = TransformerDecoder(vocab_size, D, attention_heads=4, linear_units=64, num_blocks=2).eval()
criterion = LabelSmoothingLoss(vocab_size, IGNORE_ID, smoothing=0.1, normalize_length=False)

# Encoder output of three utterances, right-padded with non-zero frames.
encoder_out_lens = torch.tensor([9, 5, 7])
B, T = 3, int(encoder_out_lens.max())
encoder_out = torch.randn(B, T, D) * 3.0
encoder_mask = ~make_pad_mask(encoder_out_lens, T).unsqueeze(1)  # (B, 1, T)

texts = [[1, 2, 3, 4], [5, 6], [7, 1, 8]]
ys_pad = pad_list([torch.tensor(t) for t in texts], IGNORE_ID)
ys_pad_lens = torch.tensor([len(t) for t in texts])

with torch.no_grad():
    loss_att, decoder_out, ys_out_pad = calc_att_loss(
        decoder, criterion, encoder_out, encoder_mask, ys_pad, ys_pad_lens, sos, eos)
    logp = torch.log_softmax(decoder_out, dim=-1)

    # Reference 1: each utterance decoded alone, no padding anywhere.
    ref_loss_sum = 0.0
    for i, t in enumerate(texts):
        n = int(encoder_out_lens[i])
        mem = encoder_out[i : i + 1, :n]
        mem_mask = torch.ones(1, 1, n, dtype=torch.bool)
        ys_in = torch.tensor([[sos] + t])
        out_i, _, _ = decoder(mem, mem_mask, ys_in, torch.tensor([len(t) + 1]))
        logp_i = torch.log_softmax(out_i, dim=-1)
        torch.testing.assert_close(logp[i, : len(t) + 1], logp_i[0], rtol=1e-5, atol=1e-5)
        # Reference 2: the label-smoothed KL, one target position at a time.
        for j, y in enumerate(t + [eos]):
            true_dist = torch.full((vocab_size,), 0.1 / (vocab_size - 1))
            true_dist[y] = 0.9
            ref_loss_sum = ref_loss_sum + (true_dist * (true_dist.log() - logp_i[0, j])).sum()
    torch.testing.assert_close(loss_att * B, ref_loss_sum, rtol=1e-5, atol=1e-5)

    # Attention rescoring: N hypotheses of utterance 0, padded, memory repeated N times.
    hyps = [[1, 2, 3, 4], [1, 2], [4, 3, 2, 1, 5], [6]]
    N = len(hyps)
    n0 = int(encoder_out_lens[0])
    enc_rep = encoder_out[0:1].repeat(N, 1, 1)
    mask_rep = encoder_mask[0:1].repeat(N, 1, 1)
    hyps_pad = pad_list([torch.tensor(h) for h in hyps], IGNORE_ID)
    hyps_lens = torch.tensor([len(h) for h in hyps])
    hyps_in, _ = add_sos_eos(hyps_pad, sos, eos, IGNORE_ID)
    out_r, _, _ = decoder(enc_rep, mask_rep, hyps_in, hyps_lens + 1)
    logp_r = torch.log_softmax(out_r, dim=-1)
    for k, h in enumerate(hyps):
        score = sum(logp_r[k, j, w] for j, w in enumerate(h)) + logp_r[k, len(h), eos]
        alone, _, _ = decoder(encoder_out[0:1, :n0], torch.ones(1, 1, n0, dtype=torch.bool),
                              torch.tensor([[sos] + h]), torch.tensor([len(h) + 1]))
        la = torch.log_softmax(alone, dim=-1)[0]
        score_alone = sum(la[j, w] for j, w in enumerate(h)) + la[len(h), eos]
        torch.testing.assert_close(score, score_alone, rtol=1e-5, atol=1e-5)

print("wenet decoder: padded batch == per-utterance runs; loss_att", round(float(loss_att), 4))
