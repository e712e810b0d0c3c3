# Citation: espnet/espnet#397 ("Perform explicit value filling for attention", merged 2018-08-31),
# src/nets/e2e_asr_th.py (AttDot / AttAdd / AttLoc, Encoder, Decoder).
#
# Bug: the RNN attention decoder of ESPnet's E2E ASR model computed its attention energies `e`
# over all T_max encoder frames of a padded batch and took `F.softmax(scaling * e, dim=1)` with
# no masking.  The encoder's last projection (a Linear after pad_packed_sequence) gives the
# padded frames a non-zero (bias) value, so shorter utterances spread attention weight onto
# frames that do not exist.
# Fix: build `self.mask = make_mask(enc_hs_len)` once per utterance batch and
# `e.masked_fill_(self.mask, -float('inf'))` before the softmax.
import sys
from argparse import Namespace

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

FIXED = "--fixed" in sys.argv


def to_cuda(m, x):
    device = next(m.parameters()).device
    return x.to(device)


def pad_list(xs, pad_value):
    n_batch = len(xs)
    max_len = max(x.size(0) for x in xs)
    pad = xs[0].new(n_batch, max_len, *xs[0].size()[1:]).fill_(pad_value)
    for i in range(n_batch):
        pad[i, :xs[i].size(0)] = xs[i]
    return pad


def make_mask(lengths):
    bs = int(len(lengths))
    maxlen = int(max(lengths))
    mask = torch.zeros((bs, maxlen), dtype=torch.bool)
    for idx, length in enumerate(lengths):
        mask[idx, length:] = 1
    return mask


class BLSTMP(torch.nn.Module):
    def __init__(self, idim, elayers, cdim, hdim, subsample):
        super(BLSTMP, self).__init__()
        for i in range(elayers):
            inputdim = idim if i == 0 else hdim
            setattr(self, "bilstm%d" % i, torch.nn.LSTM(inputdim, cdim, dropout=0, num_layers=1,
                                                        bidirectional=True, batch_first=True))
            setattr(self, "bt%d" % i, torch.nn.Linear(2 * cdim, hdim))
        self.elayers = elayers
        self.cdim = cdim
        self.subsample = subsample

    def forward(self, xs_pad, ilens):
        for layer in range(self.elayers):
            xs_pack = pack_padded_sequence(xs_pad, ilens, batch_first=True)
            bilstm = getattr(self, 'bilstm' + str(layer))
            ys, _ = bilstm(xs_pack)
            ys_pad, ilens = pad_packed_sequence(ys, batch_first=True)
            sub = self.subsample[layer + 1]
            if sub > 1:
                ys_pad = ys_pad[:, ::sub]
                ilens = [int(i + 1) // sub for i in ilens]
            else:
                ilens = [int(i) for i in ilens]
            projected = getattr(self, 'bt' + str(layer))(ys_pad.contiguous().view(-1, ys_pad.size(2)))
            xs_pad = torch.tanh(projected.view(ys_pad.size(0), ys_pad.size(1), -1))
        return xs_pad, ilens


class Encoder(torch.nn.Module):
    def __init__(self, etype, idim, elayers, eunits, eprojs, subsample, dropout):
        super(Encoder, self).__init__()
        assert etype == 'blstmp'
        self.enc1 = BLSTMP(idim, elayers, eunits, eprojs, subsample)

    def forward(self, xs_pad, ilens):
        return self.enc1(xs_pad, ilens)


class AttLoc(torch.nn.Module):
    def __init__(self, eprojs, dunits, att_dim, aconv_chans, aconv_filts):
        super(AttLoc, self).__init__()
        self.mlp_enc = torch.nn.Linear(eprojs, att_dim)
        self.mlp_dec = torch.nn.Linear(dunits, att_dim, bias=False)
        self.mlp_att = torch.nn.Linear(aconv_chans, att_dim, bias=False)
        self.loc_conv = torch.nn.Conv2d(
            1, aconv_chans, (1, 2 * aconv_filts + 1), padding=(0, aconv_filts), bias=False)
        self.gvec = torch.nn.Linear(att_dim, 1)
        self.dunits = dunits
        self.eprojs = eprojs
        self.att_dim = att_dim
        self.h_length = None
        self.enc_h = None
        self.pre_compute_enc_h = None
        self.mask = None
        self.aconv_chans = aconv_chans

    def reset(self):
        self.h_length = None
        self.enc_h = None
        self.pre_compute_enc_h = None
        self.mask = None

    def forward(self, enc_hs_pad, enc_hs_len, dec_z, att_prev, scaling=2.0):
        batch = len(enc_hs_pad)
        # pre-compute all h outside the decoder loop
        if self.pre_compute_enc_h is None:
            self.enc_h = enc_hs_pad  # utt x frame x hdim
            self.h_length = self.enc_h.size(1)
            self.pre_compute_enc_h = self.mlp_enc(self.enc_h)

        if dec_z is None:
            dec_z = enc_hs_pad.new_zeros(batch, self.dunits)
        else:
            dec_z = dec_z.view(batch, self.dunits)

        # initialize attention weight with uniform dist.
        if att_prev is None:
            att_prev = [enc_hs_pad.new(l).fill_(1.0 / l) for l in enc_hs_len]
            att_prev = pad_list(att_prev, 0)

        att_conv = self.loc_conv(att_prev.view(batch, 1, 1, self.h_length))
        att_conv = att_conv.squeeze(2).transpose(1, 2)
        att_conv = self.mlp_att(att_conv)

        dec_z_tiled = self.mlp_dec(dec_z).view(batch, 1, self.att_dim)

        e = self.gvec(torch.tanh(att_conv + self.pre_compute_enc_h + dec_z_tiled)).squeeze(2)

        if FIXED:
            # NOTE consider zero padding when compute w.
            if self.mask is None:
                self.mask = to_cuda(self, make_mask(enc_hs_len))
            e.masked_fill_(self.mask, -float('inf'))
        w = F.softmax(scaling * e, dim=1)

        # weighted sum over flames
        c = torch.sum(self.enc_h * w.view(batch, self.h_length, 1), dim=1)
        return c, w


class Decoder(torch.nn.Module):
    def __init__(self, eprojs, odim, dlayers, dunits, sos, eos, att):
        super(Decoder, self).__init__()
        self.dunits = dunits
        self.dlayers = dlayers
        self.embed = torch.nn.Embedding(odim, dunits)
        self.decoder = torch.nn.ModuleList()
        self.decoder += [torch.nn.LSTMCell(dunits + eprojs, dunits)]
        for _ in range(1, self.dlayers):
            self.decoder += [torch.nn.LSTMCell(dunits, dunits)]
        self.ignore_id = -1
        self.output = torch.nn.Linear(dunits, odim)
        self.sos = sos
        self.eos = eos
        self.att = att

    def zero_state(self, hs_pad):
        return hs_pad.new_zeros(hs_pad.size(0), self.dunits)

    def forward(self, hs_pad, hlens, ys_pad):
        ys = [y[y != self.ignore_id] for y in ys_pad]
        eos = ys[0].new([self.eos])
        sos = ys[0].new([self.sos])
        ys_in = [torch.cat([sos, y], dim=0) for y in ys]
        ys_out = [torch.cat([y, eos], dim=0) for y in ys]
        pad_ys_in = pad_list(ys_in, self.eos)
        pad_ys_out = pad_list(ys_out, self.ignore_id)

        batch = pad_ys_out.size(0)
        olength = pad_ys_out.size(1)

        c_list = [self.zero_state(hs_pad)]
        z_list = [self.zero_state(hs_pad)]
        for _ in range(1, self.dlayers):
            c_list.append(self.zero_state(hs_pad))
            z_list.append(self.zero_state(hs_pad))
        att_w = None
        z_all = []
        self.att.reset()  # reset pre-computation of h

        eys = self.embed(pad_ys_in)  # utt x olen x zdim
        for i in range(olength):
            att_c, att_w = self.att(hs_pad, hlens, z_list[0], att_w)
            ey = torch.cat((eys[:, i, :], att_c), dim=1)  # utt x (zdim + hdim)
            z_list[0], c_list[0] = self.decoder[0](ey, (z_list[0], c_list[0]))
            for l in range(1, self.dlayers):
                z_list[l], c_list[l] = self.decoder[l](z_list[l - 1], (z_list[l], c_list[l]))
            z_all.append(z_list[-1])

        z_all = torch.stack(z_all, dim=1).view(batch * olength, self.dunits)
        y_all = self.output(z_all)
        self.loss = F.cross_entropy(y_all, pad_ys_out.view(-1), ignore_index=self.ignore_id,
                                    reduction='mean')
        return self.loss, y_all.view(batch, olength, -1)


class E2E(torch.nn.Module):
    def __init__(self, idim, odim, args):
        super(E2E, self).__init__()
        self.sos = odim - 1
        self.eos = odim - 1
        subsample = [1] * (args.elayers + 1)
        for j, s in enumerate(args.subsample.split("_")[:args.elayers + 1]):
            subsample[j] = int(s)
        self.subsample = subsample
        self.enc = Encoder(args.etype, idim, args.elayers, args.eunits, args.eprojs,
                           self.subsample, args.dropout_rate)
        self.att = AttLoc(args.eprojs, args.dunits, args.adim, args.aconv_chans, args.aconv_filts)
        self.dec = Decoder(args.eprojs, odim, args.dlayers, args.dunits, self.sos, self.eos, self.att)

    def forward(self, xs_pad, ilens, ys_pad):
        hs_pad, hlens = self.enc(xs_pad, ilens)
        loss_att, logits = self.dec(hs_pad, hlens, ys_pad)
        return loss_att, logits


def main():
    torch.manual_seed(0)
    args = Namespace(etype='blstmp', elayers=2, eunits=16, eprojs=16, subsample="1_2_1",
                     dropout_rate=0.0, atype='location', adim=16, aconv_chans=4, aconv_filts=3,
                     dlayers=1, dunits=16)
    idim, odim = 8, 10
    model = E2E(idim, odim, args)
    model.eval()

    # a batch of two utterances sorted by length (as ESPnet's batchfy does), zero padded
    ilens = [20, 9]
    xs = [torch.randn(l, idim) for l in ilens]
    xs_pad = pad_list(xs, 0)
    ys_pad = pad_list([torch.tensor([1, 4, 2, 7]), torch.tensor([3, 5])], -1)

    with torch.no_grad():
        loss, logits = model(xs_pad, ilens, ys_pad)
    print("loss_att %.6f" % loss.item())
    print("short utterance logits[1, 0]:", [round(v, 4) for v in logits[1, 0].tolist()])


if __name__ == "__main__":
    main()
