# hirofumi0810/neural_sp commit 60670cc1 ("Fix mask for MMA"), neural_sp/models/modules/mocha.py.
# MoChA's test-time chunkwise attention (hard_chunkwise_attention) builds its window mask as
# mask[..., boundary - chunk_size + 1:boundary + 1] = 1. When the monotonic boundary is closer to the
# first encoder frame than chunk_size - 1, the start index is negative, the slice wraps to the end of
# the frames and selects nothing: only the boundary frame stays visible (the mask was cloned from the
# one-hot alpha), so the chunk collapses to one frame at the start of every utterance.
# Fix: when boundary <= chunk_size - 1, open frames 0..boundary.
# Ported trimmed: MonotonicEnergy / ChunkEnergy / MoChA (hard mode) as mocha.py wrote them at
# 60670cc1^, driven by the LAS decoder's greedy loop (decoders/las.py greedy / decode_step /
# recurrency / generate), one LSTM layer, no LM.
import logging
import math
import sys

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv

NEG_INF = float(np.finfo(np.float32).min)

logger = logging.getLogger(__name__)


def make_pad_mask(seq_lens):
    """Make mask for padding (1 for valid frames)."""
    bs = seq_lens.size(0)
    max_time = max(seq_lens)
    seq_range = torch.arange(0, max_time, dtype=torch.int32)
    seq_range_expand = seq_range.unsqueeze(0).expand(bs, max_time)
    seq_length_expand = seq_range_expand.new(seq_lens).unsqueeze(-1)
    mask = seq_range_expand < seq_length_expand
    return mask


class MonotonicEnergy(nn.Module):
    def __init__(self, kdim, qdim, adim, atype, n_heads, init_r, bias=True, param_init=''):
        super().__init__()
        self.key = None
        self.mask = None

        self.atype = atype
        assert adim % n_heads == 0
        self.d_k = adim // n_heads
        self.n_heads = n_heads
        self.scale = math.sqrt(adim)

        self.w_key = nn.Linear(kdim, adim)
        self.v = nn.Linear(adim, n_heads, bias=False)
        self.w_query = nn.Linear(qdim, adim, bias=False)

        self.r = nn.Parameter(torch.Tensor([init_r]))
        logger.info('init_r is initialized with %d' % init_r)

        self.conv1d = None
        self.v = nn.utils.weight_norm(self.v, name='weight', dim=0)
        # initialization
        self.v.weight_g.data = torch.Tensor([1 / adim]).sqrt()

    def reset(self):
        self.key = None
        self.mask = None

    def forward(self, key, query, mask, cache=False, boundary_leftmost=0):
        bs, klen, kdim = key.size()
        qlen = query.size(1)

        # Pre-computation of encoder-side features for computing scores
        if self.key is None or not cache:
            key = self.w_key(key).view(bs, -1, self.n_heads, self.d_k)
            self.key = key.transpose(2, 1).contiguous()  # `[B, H, klen, d_k]`
            self.mask = mask
            if mask is not None:
                self.mask = self.mask.unsqueeze(1).repeat([1, self.n_heads, 1, 1])  # `[B, H, qlen, klen]`
                assert self.mask.size() == (bs, self.n_heads, qlen, klen), \
                    (self.mask.size(), (bs, self.n_heads, qlen, klen))

        query = self.w_query(query).view(bs, -1, self.n_heads, self.d_k)
        query = query.transpose(2, 1).contiguous()  # `[B, H, qlen, d_k]`
        m = self.mask

        k = self.key.unsqueeze(2)  # `[B, H, 1, klen, d_k]`
        # Truncate encoder memories
        if boundary_leftmost > 0:
            k = k[:, :, :, boundary_leftmost:]
            klen = k.size(3)
            if m is not None:
                m = m[:, :, :, boundary_leftmost:]
        e = torch.relu(k + query.unsqueeze(3))  # `[B, H, qlen, klen, d_k]`
        e = e.permute(0, 2, 3, 1, 4).contiguous().view(bs, qlen, klen, -1)
        e = self.v(e).permute(0, 3, 1, 2)  # `[B, qlen, klen, H]`

        if self.r is not None:
            e = e + self.r
        if m is not None:
            e = e.masked_fill_(m == 0, NEG_INF)
        assert e.size() == (bs, self.n_heads, qlen, klen), \
            (e.size(), (bs, self.n_heads, qlen, klen))
        return e


class ChunkEnergy(nn.Module):
    def __init__(self, kdim, qdim, adim, atype, n_heads=1, bias=True, param_init=''):
        super().__init__()
        self.key = None
        self.mask = None

        self.atype = atype
        assert adim % n_heads == 0
        self.d_k = adim // n_heads
        self.n_heads = n_heads
        self.scale = math.sqrt(adim)

        self.w_key = nn.Linear(kdim, adim)
        self.w_query = nn.Linear(qdim, adim, bias=False)
        self.v = nn.Linear(adim, 1, bias=False)

    def reset(self):
        self.key = None
        self.mask = None

    def forward(self, key, query, mask, cache=False,
                boundary_leftmost=0, boundary_rightmost=10e6):
        bs, klen, kdim = key.size()
        qlen = query.size(1)

        # Pre-computation of encoder-side features for computing scores
        if self.key is None or not cache:
            key = self.w_key(key).view(bs, -1, self.n_heads, self.d_k)
            self.key = key.transpose(2, 1).contiguous()  # `[B, H, klen, d_k]`
            self.mask = mask
            if mask is not None:
                self.mask = self.mask.unsqueeze(1).repeat([1, self.n_heads, 1, 1])  # `[B, H, qlen, klen]`
                assert self.mask.size() == (bs, self.n_heads, qlen, klen), \
                    (self.mask.size(), (bs, self.n_heads, qlen, klen))

        query = self.w_query(query).view(bs, -1, self.n_heads, self.d_k)
        query = query.transpose(2, 1).contiguous()  # `[B, H, qlen, d_k]`
        m = self.mask

        k = self.key.unsqueeze(2)  # `[B, 1, 1, klen, d_k]`
        # Truncate
        k = k[:, :, :, boundary_leftmost:int(boundary_rightmost)]
        klen = k.size(3)
        if m is not None:
            m = m[:, :, :, boundary_leftmost:int(boundary_rightmost)]

        r = torch.relu(k + query.unsqueeze(3))  # `[B, 1, klen, qlen, d_k]`
        r = self.v(r).squeeze(4)  # `[B, 1, qlen, klen]`

        if m is not None:
            r = r.masked_fill_(m == 0, NEG_INF)
        assert r.size() == (bs, self.n_heads, qlen, klen), \
            (r.size(), (bs, self.n_heads, qlen, klen))
        return r


def exclusive_cumprod(x):
    """Exclusive cumulative product [a, b, c] => [1, a, a * b]."""
    return torch.cumprod(torch.cat([x.new_ones(x.size(0), x.size(1), x.size(2), 1),
                                    x[:, :, :, :-1]], dim=-1), dim=-1)


def hard_chunkwise_attention(alpha, u, mask, chunk_size, n_heads_chunk,
                             sharpening_factor, share_chunkwise_attention):
    """Compute chunkwise attention over hard attention at test time.

    Args:
        alpha (FloatTensor): `[B, H_ma, qlen, klen]`
        u (FloatTensor): `[B, (H_ma*)H_ca, qlen, klen]`
        mask (ByteTensor): `[B, qlen, klen]`
    Returns:
        beta (FloatTensor): `[B, H_ma * H_ca, qlen, klen]`

    """
    bs, n_heads_mono, qlen, klen = alpha.size()
    alpha = alpha.unsqueeze(2)   # `[B, H_ma, 1, qlen, klen]`
    u = u.unsqueeze(1)  # `[B, 1, (H_ma*)H_ca, qlen, klen]`
    if n_heads_chunk > 1:
        alpha = alpha.repeat([1, 1, n_heads_chunk, 1, 1])
    if n_heads_mono > 1:
        if share_chunkwise_attention:
            u = u.repeat([1, n_heads_mono, 1, 1, 1])
        else:
            u = u.view(bs, n_heads_mono, n_heads_chunk, qlen, klen)

    mask = alpha.clone().byte()  # `[B, H_ma, H_ca, qlen, klen]`
    for b in range(bs):
        for h in range(n_heads_mono):
            if FIXED:
                if alpha[b, h, 0, 0].sum() > 0:
                    boundary = alpha[b, h, 0, 0].nonzero()[:, -1].min().item()
                    if chunk_size == -1:
                        # infinite lookback attention
                        mask[b, h, :, 0, 0:boundary + 1] = 1
                    elif boundary <= chunk_size - 1:
                        mask[b, h, :, 0, 0:boundary + 1] = 1
                    else:
                        mask[b, h, :, 0, boundary - chunk_size + 1:boundary + 1] = 1
            else:
                if alpha[b, h, 0].sum() > 0:
                    boundary = alpha[b, h, 0, 0].nonzero()[:, -1].min().item()
                    if chunk_size == -1:
                        # infinite lookback attention
                        mask[b, h, :, 0, 0:boundary + 1] = 1
                    else:
                        mask[b, h, :, 0, boundary - chunk_size + 1:boundary + 1] = 1

    u = u.masked_fill(mask == 0, NEG_INF)
    beta = torch.softmax(u, dim=-1)
    return beta.view(bs, -1, qlen, klen)


class MoChA(nn.Module):
    def __init__(self, kdim, qdim, adim, atype, chunk_size,
                 n_heads_mono=1, n_heads_chunk=1, init_r=-4, sharpening_factor=1.0,
                 dropout=0., bias=True, param_init='', share_chunkwise_attention=True):
        super().__init__()
        self.atype = atype
        assert adim % (n_heads_mono * n_heads_chunk) == 0
        self.d_k = adim // (n_heads_mono * n_heads_chunk)

        self.w = chunk_size
        self.milk = (chunk_size == -1)
        self.n_heads = n_heads_mono
        self.n_heads_mono = n_heads_mono
        self.n_heads_chunk = n_heads_chunk
        self.sharpening_factor = sharpening_factor
        self.share_chunkwise_attention = share_chunkwise_attention

        self.monotonic_energy = MonotonicEnergy(kdim, qdim, adim, atype, n_heads_mono, init_r,
                                                bias, param_init)
        self.chunk_energy = ChunkEnergy(kdim, qdim, adim, atype,
                                        n_heads_chunk if share_chunkwise_attention else n_heads_mono * n_heads_chunk,
                                        bias, param_init) if chunk_size > 1 or self.milk else None

        # attention dropout
        self.dropout_attn = nn.Dropout(p=dropout)  # for beta
        self.bd_offset = 0

    def reset(self):
        self.monotonic_energy.reset()
        if self.chunk_energy is not None:
            self.chunk_energy.reset()
        self.bd_offset = 0

    def forward(self, key, value, query, mask=None, aw_prev=None,
                mode='hard', cache=False, trigger_point=None,
                eps_wait=-1, efficient_decoding=False):
        bs, klen = key.size()[:2]
        qlen = query.size(1)

        if aw_prev is None:
            # aw_prev = [1, 0, 0 ... 0]
            aw_prev = key.new_zeros(bs, self.n_heads_mono, 1, klen)
            aw_prev[:, :, :, 0:1] = key.new_ones(bs, self.n_heads_mono, 1, 1)

        # Compute monotonic energy
        e_mono = self.monotonic_energy(key, query, mask, cache=cache,
                                       boundary_leftmost=self.bd_offset)  # `[B, H_ma, qlen, klen]`
        assert e_mono.size(3) + self.bd_offset == key.size(1)

        assert mode == 'hard'  # inference
        assert qlen == 1
        assert not self.training
        # assert aw_prev.sum() > 0
        p_choose_i = (torch.sigmoid(e_mono) >= 0.5).float()[:, :, 0:1]
        # Attend when monotonic energy is above threshold (Sigmoid > 0.5)
        # Remove any probabilities before the index chosen at the last time step
        p_choose_i *= torch.cumsum(
            aw_prev[:, :, 0:1, -e_mono.size(3):], dim=-1)  # `[B, H_ma, 1 (qlen), klen]`
        # Now, use exclusive cumprod to remove probabilities after the first chosen index
        alpha = p_choose_i * exclusive_cumprod(1 - p_choose_i)  # `[B, H_ma, 1 (qlen), klen]`
        alpha_masked = alpha.clone()

        # Compute chunk energy
        beta = None
        if self.w > 1 or self.milk:
            bd_leftmost = 0
            bd_rightmost = klen - 1 - self.bd_offset
            e_chunk = self.chunk_energy(key, query, mask, cache=cache,
                                        boundary_leftmost=max(0, self.bd_offset + bd_leftmost - self.w + 1),
                                        boundary_rightmost=self.bd_offset + bd_rightmost + 1)  # `[B, H_ca, qlen, ken]`
            beta = hard_chunkwise_attention(alpha_masked, e_chunk, mask, self.w,
                                            self.n_heads_chunk, self.sharpening_factor,
                                            self.share_chunkwise_attention)
            beta = self.dropout_attn(beta)  # `[B, H_ma * H_ca, qlen, klen]`

        # Compute context vector
        if self.w == 1:
            cv = torch.bmm(alpha.squeeze(1), value)  # `[B, 1, adim]`
        else:
            cv = torch.bmm(beta.squeeze(1), value)  # `[B, 1, adim]`
        return cv, alpha, beta


class RNNDecoder(nn.Module):
    """LAS-style decoder of neural_sp (decoders/las.py), one LSTM layer, MoChA as `self.score`."""

    def __init__(self, enc_n_units=16, vocab=12, emb_dim=8, dec_n_units=16, attn_dim=16, chunk_size=4,
                 init_r=-1):
        super().__init__()
        self.eos = 2
        self.enc_n_units = enc_n_units
        self.dec_n_units = dec_n_units
        self.n_layers = 1
        self.rnn_type = 'lstm'
        self.embed = nn.Embedding(vocab, emb_dim)
        self.dropout_emb = nn.Dropout(0.)
        self.rnn = nn.ModuleList([nn.LSTMCell(emb_dim + enc_n_units, dec_n_units)])
        self.dropout = nn.Dropout(0.)
        self.score = MoChA(enc_n_units, dec_n_units, attn_dim, 'add', chunk_size, init_r=init_r)
        self.output_bn = nn.Linear(dec_n_units + enc_n_units, dec_n_units)
        self.output = nn.Linear(dec_n_units, vocab)

    def zero_state(self, bs):
        w = next(self.parameters())
        hxs = w.new_zeros(self.n_layers, bs, self.dec_n_units)
        cxs = w.new_zeros(self.n_layers, bs, self.dec_n_units)
        return {'dstate': (hxs, cxs)}

    def recurrency(self, inputs, dstate):
        hxs, cxs = dstate
        dout = inputs.squeeze(1)
        new_dstates = {'dout_score': None, 'dout_gen': None, 'dstate': None}
        new_hxs, new_cxs = [], []
        for lth in range(self.n_layers):
            h, c = self.rnn[lth](dout, (hxs[lth], cxs[lth]))
            new_cxs.append(c)
            new_hxs.append(h)
            dout = self.dropout(h)
            # use output in the first layer for attention scoring
            if lth == 0:
                new_dstates['dout_score'] = dout.unsqueeze(1)
        new_dstates['dout_gen'] = dout.unsqueeze(1)
        new_dstates['dstate'] = (torch.stack(new_hxs, dim=0), torch.stack(new_cxs, dim=0))
        return new_dstates

    def generate(self, cv, dout, lmout):
        out = self.output_bn(torch.cat([dout, cv], dim=-1))
        return torch.tanh(out)

    def decode_step(self, eouts, dstates, cv, y_emb, mask, aw, lmout, mode='hard', cache=True):
        dstates = self.recurrency(torch.cat([y_emb, cv], dim=-1), dstates['dstate'])
        cv, aw, beta = self.score(eouts, eouts, dstates['dout_score'], mask, aw, cache=cache, mode=mode)
        attn_v = self.generate(cv, dstates['dout_gen'], lmout)
        return dstates, cv, aw, attn_v, beta

    def greedy(self, eouts, elens, max_len_ratio):
        bs, xmax = eouts.size()[:2]
        dstates = self.zero_state(bs)
        cv = eouts.new_zeros(bs, 1, self.enc_n_units)
        self.score.reset()
        aw = None
        lmout = None
        y = eouts.new_zeros(bs, 1).fill_(self.eos).long()

        # Create the attention mask
        src_mask = make_pad_mask(elens).unsqueeze(1)  # `[B, 1, T]`

        hyps_batch, betas = [], []
        ylens = torch.zeros(bs).int()
        eos_flags = [False] * bs
        ymax = int(math.floor(xmax * max_len_ratio)) + 1
        for t in range(ymax):
            y_emb = self.dropout_emb(self.embed(y))
            dstates, cv, aw, attn_v, beta = self.decode_step(eouts, dstates, cv, y_emb, src_mask, aw, lmout)
            betas.append(beta)
            y = self.output(attn_v).argmax(-1)
            hyps_batch += [y]
            for b in range(bs):
                if not eos_flags[b]:
                    if y[b].item() == self.eos:
                        eos_flags[b] = True
                    ylens[b] += 1  # include <eos>
            if sum(eos_flags) == bs:
                break
        hyps_batch = torch.cat(hyps_batch, dim=1)
        hyps = [hyps_batch[b, :ylens[b]].tolist() for b in range(bs)]
        return hyps, betas


def main():
    torch.manual_seed(0)
    enc_n_units = 16
    dec = RNNDecoder(enc_n_units=enc_n_units, chunk_size=4, init_r=0).eval()  # mocha_init_r=0

    eouts = torch.randn(2, 14, enc_n_units)  # encoder outputs of a right-padded batch
    elens = torch.IntTensor([14, 10])
    with torch.no_grad():
        hyps, betas = dec.greedy(eouts, elens, max_len_ratio=1.0)
    for b in range(2):
        print(f"fixed={FIXED} utt{b} hyp: {hyps[b]}")
    print(f"fixed={FIXED} first-step chunkwise weights utt0: "
          f"{[round(v, 3) for v in betas[0][0, 0, 0, :6].tolist()]}")


if __name__ == "__main__":
    main()
