"""Temporal Fusion Transformer attention over series with different encoder lengths.

Follows sktime/pytorch-forecasting:
  pytorch_forecasting/data/timeseries.py  TimeSeriesDataSet._collate_fn: encoder and decoder parts each
      right-padded with rnn.pad_sequence, returned with encoder_lengths / decoder_lengths
  pytorch_forecasting/models/temporal_fusion_transformer/__init__.py
      TemporalFusionTransformer.forward: lstm_encoder over pack_padded (rnn.LSTM with lengths),
      lstm_decoder started from the encoder state, attention over cat(encoder, decoder)
      get_attention_mask(encoder_lengths, decoder_lengths): decoder_mask = attend_step >= predict_step (True = hidden:
      a decoder step sees earlier decoder steps only, not itself),
      encoder_mask = create_mask(encoder_lengths.max(), encoder_lengths) (True where index >= length),
      mask = cat(encoder_mask expanded over decoder queries, decoder_mask)
  .../sub_modules.py  InterpretableMultiHeadAttention / ScaledDotProductAttention: masked_fill(mask, -1e9),
      softmax, one value projection shared by all heads, heads averaged
Reduced: 3 series with encoder lengths 9, 5, 3 and decoder length 4, hidden 16, 4 heads.
Reference: each series alone, no padding at all. Only the decoder rows (queries) are used, as in TFT.
"""
import torch
import torch.nn as nn
from torch.nn.utils import rnn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

H, HEADS, DEC = 16, 4, 4


def create_mask(size, lengths):
    return torch.arange(size).unsqueeze(0) >= lengths.unsqueeze(-1)


class InterpretableMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.d = H // HEADS
        self.v_layer = nn.Linear(H, self.d)
        self.q_layers = nn.ModuleList([nn.Linear(H, self.d) for _ in range(HEADS)])
        self.k_layers = nn.ModuleList([nn.Linear(H, self.d) for _ in range(HEADS)])
        self.w_h = nn.Linear(self.d, H, bias=False)

    def forward(self, q, k, v, mask):
        vs = self.v_layer(v)
        heads, attns = [], []
        for i in range(HEADS):
            attn = torch.bmm(self.q_layers[i](q), self.k_layers[i](k).permute(0, 2, 1)) / self.d ** 0.5
            attn = attn.masked_fill(mask, -1e9)
            attn = torch.softmax(attn, dim=2)
            heads.append(torch.bmm(attn, vs))
            attns.append(attn)
        return self.w_h(torch.stack(heads, 2).mean(2)), torch.stack(attns, 2)


class TinyTFT(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(2, H)
        self.lstm_encoder = nn.LSTM(H, H, batch_first=True)
        self.lstm_decoder = nn.LSTM(H, H, batch_first=True)
        self.attn = InterpretableMHA()
        self.norm = nn.LayerNorm(H)
        self.out = nn.Linear(H, 1)

    def get_attention_mask(self, encoder_lengths, decoder_lengths):
        decoder_length = int(decoder_lengths.max())
        attend_step = torch.arange(decoder_length)
        predict_step = torch.arange(decoder_length)[:, None]
        # do not attend to the step itself or to steps after it (True = hidden)
        decoder_mask = (attend_step >= predict_step).unsqueeze(0).expand(encoder_lengths.size(0), -1, -1)
        encoder_mask = create_mask(int(encoder_lengths.max()), encoder_lengths).unsqueeze(1)
        encoder_mask = encoder_mask.expand(-1, decoder_length, -1)
        return torch.cat((encoder_mask, decoder_mask), dim=2)

    def forward(self, x_enc, x_dec, encoder_lengths, decoder_lengths):
        e, d = self.inp(x_enc), self.inp(x_dec)
        packed = rnn.pack_padded_sequence(e, encoder_lengths, batch_first=True, enforce_sorted=False)
        enc_out, (hn, cn) = self.lstm_encoder(packed)
        enc_out, _ = rnn.pad_packed_sequence(enc_out, batch_first=True, total_length=e.size(1))
        packed_d = rnn.pack_padded_sequence(d, decoder_lengths, batch_first=True, enforce_sorted=False)
        dec_out, _ = self.lstm_decoder(packed_d, (hn, cn))
        dec_out, _ = rnn.pad_packed_sequence(dec_out, batch_first=True, total_length=d.size(1))
        seq = torch.cat([enc_out + e, dec_out + d], dim=1)
        q = seq[:, e.size(1):]
        a, w = self.attn(q, seq, seq, self.get_attention_mask(encoder_lengths, decoder_lengths))
        return self.out(self.norm(a + q)).squeeze(-1), w


enc_lengths = torch.tensor([9, 5, 3])
dec_lengths = torch.tensor([DEC, DEC, DEC])
series = [torch.randn(int(n) + DEC, 2) for n in enc_lengths]
x_enc = rnn.pad_sequence([s[: int(n)] for s, n in zip(series, enc_lengths)], batch_first=True)
x_dec = rnn.pad_sequence([s[int(n):] for s, n in zip(series, enc_lengths)], batch_first=True)

model = TinyTFT().eval()
with torch.no_grad():
    pred, weights = model(x_enc, x_dec, enc_lengths, dec_lengths)
    max_diff = 0.0
    for i, (s, n) in enumerate(zip(series, enc_lengths.tolist())):
        p1, w1 = model(s[:n].unsqueeze(0), s[n:].unsqueeze(0), enc_lengths[i:i + 1], dec_lengths[i:i + 1])
        max_diff = max(max_diff, (pred[i] - p1[0]).abs().max().item())
        # the attention over padded encoder steps is exactly zero (exp(-1e9) underflows)
        if n < int(enc_lengths.max()):
            assert weights[i, :, :, n:int(enc_lengths.max())].abs().max().item() == 0.0

print("predictions", pred.shape, "weights", weights.shape)
print("max |batched - alone|:", max_diff)
assert max_diff < 1e-10
