# Citation: mims-harvard/Raindrop @0b0a19b4ba53c4a1303ef507483e994acffac9b8: code/baselines/models.py
#   (PositionalEncodingTF, TransformerModel, TransformerModel2 with aggreg 'mean').
# Raindrop's Transformer baselines for irregularly sampled clinical time series (P12 / PAM). A batch is laid
# sequence-first, src (T, B, 2 * d_inp) (values then missingness flags), times (T, B) in hours, zero past each
# record's length. TransformerModel puts a static-feature context token in front of the series and hides the
# padded tail with `src_key_padding_mask = arange(maxlen + 1) >= lengths + 1` (True = pad) for a sequence-first
# nn.TransformerEncoder, then averages the real positions (context included) by (1 - mask) / (lengths + 1).
# TransformerModel2 has no context token: `arange(maxlen) >= lengths`, then a masked mean (its 'max' option, where
# padded rows are only scaled by -10, is left out). (The project moves the mask and positional encoding to .cuda(); here they stay on CPU.)
# Self-check: every record run alone at its own length gives the same logits as in the padded batch.
import math

import numpy as np
import torch
import torch.nn as nn

torch.manual_seed(0)


class PositionalEncodingTF(nn.Module):
    def __init__(self, d_model, max_len=500, MAX=10000,):
        super(PositionalEncodingTF, self).__init__()
        self.max_len = max_len
        self.d_model = d_model
        self.MAX = MAX
        self._num_timescales = d_model // 2

    def getPE(self, P_time):
        B = P_time.shape[1]

        P_time = P_time.float()

        timescales = self.max_len ** np.linspace(0, 1, self._num_timescales)

        times = torch.Tensor(P_time.cpu()).unsqueeze(2)

        scaled_time = times / torch.Tensor(timescales[None, None, :])
        pe = torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], axis=-1)  # T x B x d_model
        pe = pe.type(torch.FloatTensor)

        return pe

    def forward(self, P_time):
        pe = self.getPE(P_time)
        return pe


class TransformerModel(nn.Module):
    def __init__(self, d_inp, d_model, nhead, nhid, nlayers, dropout, max_len, d_static, MAX, n_classes):
        super(TransformerModel, self).__init__()
        from torch.nn import TransformerEncoder, TransformerEncoderLayer
        self.model_type = 'Transformer'

        self.pos_encoder = PositionalEncodingTF(d_model, max_len, MAX)

        encoder_layers = TransformerEncoderLayer(d_model, nhead, nhid, dropout)
        self.transformer_encoder = TransformerEncoder(encoder_layers, nlayers)

        self.encoder = nn.Linear(d_inp, d_model)
        self.d_model = d_model

        self.emb = nn.Linear(d_static, d_model)

        self.mlp = nn.Sequential(
            nn.Linear(d_model, d_model),
            nn.ReLU(),
            nn.Linear(d_model, n_classes),
        )

        self.relu = nn.ReLU()

        self.init_weights()

    def init_weights(self):
        initrange = 0.1  # the project uses 1e-10, which makes the values nearly invisible; kept visible here
        self.encoder.weight.data.uniform_(-initrange, initrange)

    def forward(self, src, static, times, lengths):
        maxlen, batch_size = src.shape[0], src.shape[1]

        src = self.encoder(src) * math.sqrt(self.d_model)

        pe = self.pos_encoder(times)

        src = src + pe

        emb = self.emb(static)

        # append context on front
        x = torch.cat([emb.unsqueeze(0), src], dim=0)

        mask = torch.arange(maxlen + 1)[None, :] >= (lengths.cpu()[:, None] + 1)
        mask = mask.squeeze(1)
        output = self.transformer_encoder(x, src_key_padding_mask=mask)

        # masked aggregation
        mask2 = mask.permute(1, 0).unsqueeze(2).long()
        lengths2 = lengths.unsqueeze(1)
        output = torch.sum(output * (1 - mask2), dim=0) / (lengths2 + 1)

        # feed through MLP
        output = self.mlp(output)
        return output


class TransformerModel2(nn.Module):
    def __init__(self, d_inp, d_model, nhead, nhid, nlayers, dropout, max_len, d_static, MAX, perc, aggreg, n_classes):
        super(TransformerModel2, self).__init__()
        from torch.nn import TransformerEncoder, TransformerEncoderLayer
        self.model_type = 'Transformer'

        d_pe = 16
        d_enc = d_inp

        self.pos_encoder = PositionalEncodingTF(d_pe, max_len, MAX)

        encoder_layers = TransformerEncoderLayer(d_pe+d_enc, nhead, nhid, dropout)
        self.transformer_encoder = TransformerEncoder(encoder_layers, nlayers)

        self.encoder = nn.Linear(d_inp, d_enc)

        self.emb = nn.Linear(d_static, d_inp)

        d_fi = d_pe+d_enc  + d_inp
        self.mlp = nn.Sequential(
            nn.Linear(d_fi, d_fi),
            nn.ReLU(),
            nn.Linear(d_fi, n_classes),
        )

        self.aggreg = aggreg

        self.relu = nn.ReLU()
        self.dropout = nn.Dropout(dropout)
        self.init_weights()

    def init_weights(self):
        initrange = 0.1  # the project uses 1e-10; kept visible here
        self.encoder.weight.data.uniform_(-initrange, initrange)
        self.emb.weight.data.uniform_(-initrange, initrange)

    def forward(self, src, static, times, lengths):
        maxlen, batch_size = src.shape[0], src.shape[1]

        src = self.encoder(src)

        pe = self.pos_encoder(times)
        src = torch.cat([pe, src], axis=2)

        src = self.dropout(src)

        emb = self.emb(static)

        x = src

        mask = torch.arange(maxlen)[None, :] >= (lengths.cpu()[:, None])
        mask = mask.squeeze(1)

        output = self.transformer_encoder(x, src_key_padding_mask=mask)

        mask2 = mask.permute(1, 0).unsqueeze(2).long()
        if self.aggreg == 'mean':
            lengths2 = lengths.unsqueeze(1)
            output = torch.sum(output * (1 - mask2), dim=0) / (lengths2 + 1)
        elif self.aggreg == 'max':
            output, _ = torch.max(output * ((mask2 == 0) * 1.0 + (mask2 == 1) * -10.0), dim=0)

        output = torch.cat([output, emb], dim=1)
        output = self.mlp(output)
        return output


# ---- a P12-like batch: (T, B, 2 * d_inp) values + missingness flags, times in hours, static features ----
d_inp, d_static, n_classes = 6, 4, 2
lengths = torch.tensor([11, 4, 8, 2])
T, B = int(lengths.max()), len(lengths)
src = torch.zeros(T, B, 2 * d_inp)
times = torch.zeros(T, B)
for b in range(B):
    L = int(lengths[b])
    m = (torch.rand(L, d_inp) < 0.6).float()
    src[:L, b, :d_inp] = torch.randn(L, d_inp) * m
    src[:L, b, d_inp:] = m
    times[:L, b] = torch.sort(torch.rand(L) * 48.).values
static = torch.randn(B, d_static)

models = {
    "TransformerModel": TransformerModel(2 * d_inp, 32, 4, 64, 2, 0.3, 215, d_static, 100, n_classes),
    "TransformerModel2/mean": TransformerModel2(2 * d_inp, 32, 2, 64, 2, 0.3, 215, d_static, 100, 0.5, 'mean', n_classes),
}
with torch.no_grad():
    for name, model in models.items():
        model.eval()
        out = model(src, static, times, lengths)
        worst = 0.
        for b in range(B):
            L = int(lengths[b])
            ref = model(src[:L, b:b + 1], static[b:b + 1], times[:L, b:b + 1], lengths[b:b + 1])
            worst = max(worst, (ref[0] - out[b]).abs().max().item())
        print("%-24s logits %s  max |batch - alone| = %.2e" % (name, out[:, 1].numpy().round(4), worst))
        assert worst < 1e-5, (name, worst)
print("ok")
