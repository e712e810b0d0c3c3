# Citation: microsoft/PhysioPro#11 ("[bug fix] fix contiformer mask issue"), fix commit 8fa0161
#   ("fix bug", physiopro/model/masktimeseries.py), squash-merged into main as 15b2809.
# Upstream: physiopro/model/masktimeseries.py MaskTS.forward (fill_nan_type == 'merge') ->
#   physiopro/network/contiformer.py ContiFormer / Encoder / EncoderLayer / MultiHeadAttention /
#   ScaledDotProductAttention (attn.masked_fill(mask, -1e9)).
# Bug: for irregular series MaskTS drops the NaN rows of every series, left-compacts the observed rows
#   and right-pads them to the longest series, but then hands ContiFormer the ORIGINAL per-timestep
#   NaN mask (B, T_orig) as the attention mask.  After mask.unsqueeze(1) it lines up with the
#   (B, H, T, T) scores as (1, B, 1, T): series b's missing-timestep pattern masks head b of every
#   series, on key positions of the original timeline, and the right padding of short series is not
#   masked at all.  (It broadcasts silently when batch size == n_head and one series is complete.)
# Fix: build a per-series (B, T, T) boolean mask from the merged lengths,
#   attn_mask[i, :length[i], :length[i]] = 1, inverted to True = blocked, and pass that instead.
# Shrunk port: ODELinear / InterpLinear (torchdiffeq / torchcde continuous-time projections) are
#   replaced by plain-torch stand-ins with the same call signature and output layout
#   [B, Q, T, K, D] (one Euler step of the key/value dynamics; query value held at its time).
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class AttrDict(dict):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.__dict__ = self


class InterpLinear(nn.Module):
    """Stand-in: value of the projected input at the query time, laid out [B, Q, T, K=1, D]."""

    def __init__(self, d_model, d_out=None, args_interp=None, norm=True):
        super().__init__()
        self.linear = nn.Linear(d_model, d_out)

    def forward(self, x, t, approximate_method=None):
        B, T, _ = x.shape
        y = self.linear(x)  # [B, Q, D]
        return y.unsqueeze(2).unsqueeze(3).expand(B, T, T, 1, y.shape[-1])


class ODELinear(nn.Module):
    """Stand-in: evolve key/value j from t_j to t_q with one Euler step, laid out [B, Q, T, K=1, D]."""

    def __init__(self, d_model, d_out=None, args_ode=None, norm=True):
        super().__init__()
        self.linear = nn.Linear(d_model, d_out)
        self.dyn = nn.Linear(d_model, d_model)

    def forward(self, x, t, approximate_method=None):
        B, T, D = x.shape
        Q = T
        x0 = x.unsqueeze(-3).repeat(1, Q, 1, 1)  # [B, Q, T, D]
        t0 = t.unsqueeze(-2).repeat(1, Q, 1)  # [B, Q, T]
        t1 = t.unsqueeze(-1).repeat(1, 1, T)  # [B, Q, T]
        y = x0 + (t1 - t0).unsqueeze(-1) * torch.tanh(self.dyn(x0))
        return self.linear(y).unsqueeze(3)  # [B, Q, T, 1, D]


class MultiHeadAttention(nn.Module):
    """Multi-Head Attention module"""

    def __init__(self, n_head, d_model, d_k, d_v, dropout=0.1, normalize_before=True, args_ode=None):
        super().__init__()
        self.normalize_before = normalize_before
        self.n_head = n_head
        self.d_k = d_k
        self.d_v = d_v
        assert d_model == n_head * d_k
        assert d_model == n_head * d_v

        self.w_qs = InterpLinear(d_model, n_head * d_k, args_ode)
        self.w_ks = ODELinear(d_model, n_head * d_k, args_ode)
        self.w_vs = ODELinear(d_model, n_head * d_v, args_ode)

        self.fc = nn.Linear(d_v * n_head, d_model)
        nn.init.xavier_uniform_(self.fc.weight)

        self.attention = ScaledDotProductAttention(temperature=d_k**0.5, attn_dropout=dropout)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, t, mask=None):
        d_k, n_head = self.d_k, self.n_head
        sz_b, len_q, len_k, len_v = q.size(0), q.size(1), k.size(1), v.size(1)

        residual = q
        if self.normalize_before:
            q = self.layer_norm(q)

        q = self.w_qs(q, t).reshape(sz_b, len_q, len_q, -1, n_head, d_k)
        k = self.w_ks(k, t).reshape(sz_b, len_k, len_k, -1, n_head, d_k)
        v = self.w_vs(v, t).reshape(sz_b, len_v, len_v, -1, n_head, d_k)

        q, k, v = q.permute(0, 4, 1, 2, 3, 5), k.permute(0, 4, 1, 2, 3, 5), v.permute(0, 4, 1, 2, 3, 5)

        if mask is not None:
            mask = mask.unsqueeze(1)  # For head axis broadcasting.

        output, attn = self.attention(q, k, v, mask=mask)

        output = output.transpose(1, 2).contiguous().view(sz_b, len_q, -1)
        output = self.dropout(self.fc(output))
        output += residual

        if not self.normalize_before:
            output = self.layer_norm(output)
        return output, attn


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_in, d_hid, dropout=0.1, normalize_before=True):
        super().__init__()
        self.normalize_before = normalize_before
        self.w_1 = nn.Linear(d_in, d_hid)
        self.w_2 = nn.Linear(d_hid, d_in)
        self.layer_norm = nn.LayerNorm(d_in, eps=1e-6)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        residual = x
        if self.normalize_before:
            x = self.layer_norm(x)
        x = F.gelu(self.w_1(x))
        x = self.dropout(x)
        x = self.w_2(x)
        x = self.dropout(x)
        x = x + residual
        if not self.normalize_before:
            x = self.layer_norm(x)
        return x


class ScaledDotProductAttention(nn.Module):
    def __init__(self, temperature, attn_dropout=0.2):
        super().__init__()
        self.temperature = temperature
        self.dropout = nn.Dropout(attn_dropout)

    def forward(self, q, k, v, mask=None):
        attn = (q / self.temperature * k).sum(dim=-1).sum(dim=-1)

        if mask is not None:
            attn = attn.masked_fill(mask, -1e9)

        attn = self.dropout(F.softmax(attn, dim=-1))

        output = (attn.unsqueeze(-1) * v.sum(dim=-2)).sum(dim=-2)
        return output, attn


class Encoder(nn.Module):
    def __init__(self, d_model, d_inner, n_layers, n_head, d_k, d_v, dropout, args, add_pe=False,
                 normalize_before=False):
        super().__init__()
        self.d_model = d_model
        self.add_pe = add_pe
        self.position_vec = torch.tensor(
            [math.pow(10000.0, 2.0 * (i // 2) / d_model) for i in range(d_model)])
        self.layer_stack = nn.ModuleList([
            EncoderLayer(d_model, d_inner, n_head, d_k, d_v, dropout=dropout,
                         normalize_before=normalize_before, args=args)
            for _ in range(n_layers)
        ])

    def temporal_enc(self, time):
        result = time.unsqueeze(-1) / self.position_vec.to(time.device)
        result[:, :, 0::2] = torch.sin(result[:, :, 0::2])
        result[:, :, 1::2] = torch.cos(result[:, :, 1::2])
        return result

    def forward(self, x, t, mask):
        tem_enc = self.temporal_enc(t)
        enc_output = x
        for enc_layer in self.layer_stack:
            enc_output += tem_enc
            enc_output, _ = enc_layer(enc_output, t, mask=mask)
        return enc_output


class EncoderLayer(nn.Module):
    def __init__(self, d_model, d_inner, n_head, d_k, d_v, dropout=0.1, normalize_before=True, args=None):
        super().__init__()
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k, d_v, dropout=dropout,
                                           normalize_before=normalize_before, args_ode=args)
        self.pos_ffn = PositionwiseFeedForward(d_model, d_inner, dropout=dropout,
                                               normalize_before=normalize_before)

    def forward(self, x, t, mask=None):
        enc_output, enc_slf_attn = self.slf_attn(x, x, x, t, mask=mask)
        enc_output = self.pos_ffn(enc_output)
        return enc_output, enc_slf_attn


class ContiFormer(nn.Module):
    def __init__(self, input_size, d_model=32, d_inner=128, n_layers=1, n_head=4, d_k=8, d_v=8,
                 dropout=0.1, normalize_before=False):
        super().__init__()
        args_ode = AttrDict({"nlinspace": 1, "approximate_method": "bilinear"})
        self.encoder = Encoder(d_model=d_model, d_inner=d_inner, n_layers=n_layers, n_head=n_head,
                               d_k=d_k, d_v=d_v, dropout=dropout, args=args_ode,
                               normalize_before=normalize_before)
        self.linear = nn.Linear(input_size, d_model)
        self.output_size = d_model

    def forward(self, x, t=None, mask=None):
        if t is None:
            t = torch.linspace(0, 1, x.shape[1]).to(x.device)
            t = t.unsqueeze(0).repeat(x.shape[0], 1)
        x = self.linear(x)
        enc_output = self.encoder(x, t, mask)
        return enc_output, enc_output[:, -1, :]


class MaskTS(nn.Module):
    """physiopro/model/masktimeseries.py, fill_nan_type='merge', aggregate=True, multiclassification."""

    def __init__(self, network, out_size, norm_time_flg=True):
        super().__init__()
        self.network = network
        self.fc_out = nn.Linear(network.output_size, out_size)
        self.act_out = nn.Identity()
        self.norm_time_flg = norm_time_flg

    @staticmethod
    def merge(sequences, pad_value=0.0, pad=False):
        device = sequences[0].device
        lengths = [len(seq) for seq in sequences]
        dim = sequences[0].size(1)
        if not pad:
            padded_seqs = torch.zeros(len(sequences), max(lengths), dim).to(device)
        else:
            padded_seqs = torch.zeros(len(sequences), max(lengths), dim).to(device) + pad_value
        for i, seq in enumerate(sequences):
            end = lengths[i]
            padded_seqs[i, :end] = seq[:end]
        return padded_seqs, lengths

    def forward(self, inputs):
        mask = inputs.isnan()
        tmp_mask = mask[..., 0]
        for i in range(1, mask.shape[-1]):
            tmp_mask = torch.bitwise_or(tmp_mask, mask[..., i])
        mask = tmp_mask

        X = []
        times = []
        for i in range(inputs.shape[0]):
            idx = torch.where(mask[i] == 0)
            X.append(inputs[i, idx[0].long(), :])
            times.append(idx[0].long().to(inputs.device).reshape(-1, 1))

        inputs, length = self.merge(X)
        times, _ = self.merge(times)
        times = times.squeeze(-1)

        if self.norm_time_flg:
            times = times / inputs.shape[1]

        if FIXED:
            attn_mask = torch.zeros(inputs.shape[0], inputs.shape[1], inputs.shape[1]).to(inputs.device)
            for i in range(inputs.shape[0]):
                attn_mask[i, :length[i], :length[i]] = torch.ones(length[i], length[i])
            attn_mask = (1 - attn_mask).bool()
            seq_out, _ = self.network(inputs, times, mask=attn_mask)  # [B, T, H]
        else:
            seq_out, _ = self.network(inputs, times, mask=mask)  # [B, T, H]

        length = [_ - 1 for _ in length]
        emb_outs = seq_out[np.arange(inputs.shape[0]), length, :]
        out = emb_outs
        preds = self.act_out(self.fc_out(out).squeeze(-1))
        return preds


# Irregularly sampled multivariate series (Heartbeat-like, 3 channels, 10 timesteps), batch of 4
# (= n_head in the shipped contiformer config).  Series 0 is fully observed; the others miss rows.
B, T, C, NCLS = 4, 10, 3, 2
series = torch.randn(B, T, C)
missing = {1: [1, 4, 5, 8], 2: [0, 2, 3, 6, 7, 9], 3: [5]}
for b, rows in missing.items():
    series[b, rows, :] = float("nan")
labels = torch.tensor([0, 1, 1, 0])

net = ContiFormer(input_size=C, d_model=32, d_inner=128, n_layers=1, n_head=4, d_k=8, d_v=8)
model = MaskTS(net, out_size=NCLS)
model.eval()
with torch.no_grad():
    preds = model(series)
    loss = F.cross_entropy(preds, labels)

torch.set_printoptions(precision=4, sci_mode=False)
print("logits:", preds)
print("probs :", preds.softmax(-1)[:, 1])
print("loss  : %.6f" % loss.item())
