# BorgwardtLab/multicenter-sepsis commit 7574e45 ("Fix leakage of future information (closes #4)").
# The AttentionModel predicts a sepsis score for every hour of an ICU stay (online prediction), over a
# batch of stays right-padded to the longest one by variable_length_collate. Its forward built the
# padding mask from `lengths` and then called every layer as `layer(out)`: the encoder layers' self
# attention got neither a causal mask nor a key padding mask, so the score at hour t read later hours
# and the zero-filled padding hours of shorter stays.
# Fix: pass `src_key_padding_mask=~length_to_mask(lengths)` and `src_mask=~get_subsequent_mask(x)` (now
# an (L, L) mask) to each TransformerEncoderLayer.
# Ported from src/torch/models/attention_model.py, src/torch/models/base_model.py (training_step) and
# src/torch/torch_utils.py (variable_length_collate, PositionalEncoding, to_observation_tuples).
import math
import sys
from argparse import Namespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)
np.random.seed(0)


# ---- src/torch/torch_utils.py ----
def variable_length_collate(batch):
    """Combine multiple instances of irregular lengths into a batch."""
    transposed_items = {key: list(map(lambda a: a[key], batch)) for key in batch[0].keys()}
    lengths = np.array(list(map(len, transposed_items['labels'])))
    transposed_items['lengths'] = lengths
    max_len = max(lengths)
    transposed_items['labels'] = np.stack(
        [np.pad(instance, ((0, max_len - len(instance)),), mode='constant', constant_values=np.nan)
         for instance in transposed_items['labels']], axis=0)
    for key in ['times', 'ts']:
        dims = len(transposed_items[key][0].shape)
        if dims == 1:
            padded_instances = [np.pad(instance, ((0, max_len - len(instance)),), mode='constant')
                                for instance in transposed_items[key]]
        elif dims == 2:
            padded_instances = [np.pad(instance, ((0, max_len - len(instance)), (0, 0)), mode='constant')
                                for instance in transposed_items[key]]
        else:
            raise ValueError(f'Unexpected dimensionality of instance data: {dims}')
        transposed_items[key] = np.stack(padded_instances, axis=0)
    transposed_items['times'] = transposed_items['times'].astype(np.float32)
    transposed_items['ts'] = transposed_items['ts'].astype(np.float32)
    transposed_items['lengths'] = transposed_items['lengths'].astype(np.int64)
    transposed_items['labels'] = transposed_items['labels'].astype(np.float32)
    return {key: torch.from_numpy(data) for key, data in transposed_items.items()}


class PositionalEncoding():
    """Apply positional encoding to instances."""

    def __init__(self, min_timescale, max_timescale, n_channels, positions_key='times'):
        self.min_timescale = min_timescale
        self.max_timescale = max_timescale
        self.n_channels = n_channels
        self.positions_key = positions_key
        self._num_timescales = self.n_channels // 2
        self._inv_timescales = self._compute_inv_timescales()

    def _compute_inv_timescales(self):
        log_timescale_increment = (
            math.log(float(self.max_timescale) / float(self.min_timescale)) / (float(self._num_timescales) - 1))
        return self.min_timescale * np.exp(np.arange(self._num_timescales) * -log_timescale_increment)

    def __call__(self, instance):
        instance = instance.copy()
        positions = instance[self.positions_key]
        scaled_time = positions[:, np.newaxis] * self._inv_timescales[np.newaxis, :]
        signal = np.concatenate((np.sin(scaled_time), np.cos(scaled_time)), axis=1)
        instance[self.positions_key] = np.reshape(signal, (-1, self.n_channels))
        return instance


def to_observation_tuples(instance_dict):
    """Replace NaNs in ts with zeros, add a measurement indicator and the time encoding."""
    instance_dict = instance_dict.copy()
    time = instance_dict['times']
    if len(time.shape) != 2:
        time = time[:, np.newaxis]
    ts_data = instance_dict['ts']
    invalid_measurements = ~np.isfinite(ts_data)
    ts_data = np.nan_to_num(ts_data)
    instance_dict['ts'] = np.concatenate((time, ts_data, invalid_measurements), axis=-1)
    return instance_dict


# ---- src/torch/models/attention_model.py ----
def get_subsequent_mask(seq):
    ''' For masking out the subsequent info. '''
    sz_b, len_s, n_features = seq.size()
    if FIXED:
        shape = (len_s, len_s)
    else:
        shape = (1, len_s, len_s)
    subsequent_mask = (1 - torch.triu(torch.ones(shape, device=seq.device), diagonal=1)).bool()
    return subsequent_mask


def length_to_mask(length, max_len=None, dtype=None):
    assert len(length.shape) == 1, 'Length shape should be 1 dimensional.'
    max_len = max_len or length.max().item()
    mask = torch.arange(max_len, device=length.device,
                        dtype=length.dtype).expand(len(length), max_len) < length.unsqueeze(1)
    if dtype is not None:
        mask = torch.as_tensor(mask, dtype=dtype, device=length.device)
    return mask


class ReZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.resweight = nn.Parameter(torch.Tensor([0]))

    def forward(self, x1, x2):
        return x1 + self.resweight * x2


class PositionwiseLinear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.w_1 = nn.Conv1d(d_in, d_out, 1)  # position-wise

    def forward(self, x):
        x = x.permute(1, 2, 0)
        x = self.w_1(x).permute(2, 0, 1)
        return x


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation="relu", norm='layer'):
        super(TransformerEncoderLayer, self).__init__()
        if norm == 'layer':
            def get_residual():
                def residual(x1, x2):
                    return x1 + x2
                return residual

            def get_norm():
                return nn.LayerNorm(d_model)
        elif norm == 'rezero':
            def get_residual():
                return ReZero()

            def get_norm():
                return nn.Identity()
        else:
            raise ValueError('Invalid normalization: {}'.format(norm))

        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = get_norm()
        self.norm2 = get_norm()
        self.residual1 = get_residual()
        self.residual2 = get_residual()
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = F.relu

    def forward(self, src, src_mask=None, src_key_padding_mask=None):
        src2 = self.self_attn(src, src, src, attn_mask=src_mask, key_padding_mask=src_key_padding_mask)[0]
        src = self.residual1(src, self.dropout1(src2))
        src = self.norm1(src)
        src2 = self.linear2(self.dropout(self.activation(self.linear1(src))))
        src = self.residual2(src, self.dropout2(src2))
        src = self.norm2(src)
        return src


# ---- src/torch/models/base_model.py (the parts the model's forward and loss use) ----
class BaseModel(nn.Module):
    def __init__(self, hparams):
        super().__init__()
        self.hparams = hparams
        self.loss = torch.nn.BCEWithLogitsLoss(reduction='none', pos_weight=torch.Tensor([hparams.pos_weight]))

    def _get_input_dim(self):
        return self.hparams.input_dim

    def training_step(self, batch, batch_idx):
        data, lengths, labels = batch['ts'], batch['lengths'], batch['labels']
        output = self.forward(data, lengths).squeeze(-1)
        invalid_indices = torch.isnan(labels)
        labels[invalid_indices] = 0.
        loss = self.loss(output, labels)
        loss[invalid_indices] = 0.
        n_tp = labels.shape[-1] - invalid_indices.sum(-1, keepdim=True)
        per_instance_loss = loss.sum(-1) / n_tp.float()
        return {'loss': per_instance_loss.mean(), 'n_samples': data.shape[0]}


class AttentionModel(BaseModel):
    """Sequence to sequence model based on MultiHeadAttention."""

    def __init__(self, hparams):
        super().__init__(hparams)
        d_model = hparams.d_model
        n_layers = hparams.n_layers
        n_heads = hparams.n_heads
        ff_dim = hparams.ff_dim
        dropout = hparams.dropout
        norm = hparams.norm
        d_in = self._get_input_dim()
        self.layers = nn.ModuleList(
            [PositionwiseLinear(d_in, d_model)]
            + [TransformerEncoderLayer(d_model, n_heads, ff_dim, dropout, norm=norm) for n in range(n_layers)]
            + [PositionwiseLinear(d_model, 1)]
        )

    @property
    def transforms(self):
        return [
            PositionalEncoding(1, 500, 10),  # apply positional encoding
            to_observation_tuples            # mask nan with zero add indicator
        ]

    def forward(self, x, lengths):
        """Apply attention model to input x."""
        # Invert mask as multi head attention ignores values which are true
        mask = ~length_to_mask(lengths)
        if FIXED:
            future_mask = ~get_subsequent_mask(x)
        out = x.permute(1, 0, 2)
        for layer in self.layers:
            if FIXED and isinstance(layer, TransformerEncoderLayer):
                out = layer(out, src_key_padding_mask=mask, src_mask=future_mask)
            else:
                out = layer(out)
        return out.permute(1, 0, 2)


def make_stay(n_hours, n_vitals=4, septic=False):
    ts = np.random.randn(n_hours, n_vitals)
    ts[np.random.rand(n_hours, n_vitals) < 0.3] = np.nan  # vitals not measured every hour
    labels = np.zeros(n_hours)
    if septic:
        labels[-2:] = 1.
    return {'times': np.arange(n_hours, dtype=np.float64), 'ts': ts, 'labels': labels}


N_VITALS = 4
hparams = Namespace(d_model=16, n_layers=2, n_heads=2, ff_dim=32, dropout=0.1, norm='layer', pos_weight=5.0,
                    input_dim=10 + 2 * N_VITALS)
model = AttentionModel(hparams)

stays = [make_stay(7, N_VITALS, septic=True), make_stay(4, N_VITALS), make_stay(5, N_VITALS, septic=True)]
instances = []
for stay in stays:
    for transform in model.transforms:
        stay = transform(stay)
    instances.append(stay)
batch = variable_length_collate(instances)

model.eval()
with torch.no_grad():
    scores = model(batch['ts'], batch['lengths']).squeeze(-1)
    step = model.training_step({k: v.clone() for k, v in batch.items()}, 0)
for i, n in enumerate(batch['lengths'].tolist()):
    print(f"stay {i} hourly sepsis scores:", [round(s, 4) for s in scores[i, :n].tolist()])
print("loss:", round(step['loss'].item(), 6))
