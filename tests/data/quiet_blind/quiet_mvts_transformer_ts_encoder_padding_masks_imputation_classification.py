"""mvts_transformer (gzerveas/mvts_transformer): multivariate time series of different lengths, padded.

Follows gzerveas/mvts_transformer @4ac1ae593686d8a2fe9778acfefb5df9077619b5 src/models/ts_transformer.py
(FixedPositionalEncoding, LearnablePositionalEncoding, TransformerBatchNormEncoderLayer, TSTransformerEncoder,
TSTransformerEncoderClassiregressor), src/running.py (UnsupervisedRunner.evaluate, SupervisedRunner.evaluate) and
src/datasets/dataset.py @812be5e727196ce31d35691778609bd40647c639 (collate_unsuperv, collate_superv, noise_mask,
padding_mask); src/models/loss.py MaskedMSELoss.

The collators zero-pad every series to the batch's longest (or to a fixed max_len for the classifier, whose output
Linear reads d_model * max_len) and return `padding_masks` (True = keep). The models are seq-first and pass
`src_key_padding_mask=~padding_masks` to nn.TransformerEncoder (BatchNorm layers with nn.MultiheadAttention, or
torch's TransformerEncoderLayer for norm='LayerNorm'); the classifier zeroes padding embeddings before flattening,
and the imputation loss is taken over `target_masks * padding_masks.unsqueeze(-1)`.

Checked (eval mode: BatchNorm on running statistics, no dropout): the imputation predictions at every real time
step and the per-element masked losses equal each series run alone (no padding), and the classifier's logits equal
a reference that runs each series alone, zero-pads its embeddings to max_len and applies the same output layer.
"""
import math
from typing import Optional

import numpy as np
import torch
from torch import nn, Tensor
from torch.nn import functional as F
from torch.nn.modules import MultiheadAttention, Linear, Dropout, BatchNorm1d, TransformerEncoderLayer


def _get_activation_fn(activation):
    if activation == "relu":
        return F.relu
    elif activation == "gelu":
        return F.gelu
    raise ValueError("activation should be relu/gelu, not {}".format(activation))


class FixedPositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=1024, scale_factor=1.0):
        super(FixedPositionalEncoding, self).__init__()
        self.dropout = nn.Dropout(p=dropout)

        pe = torch.zeros(max_len, d_model)  # positional encoding
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = scale_factor * pe.unsqueeze(0).transpose(0, 1)
        self.register_buffer('pe', pe)

    def forward(self, x):
        x = x + self.pe[:x.size(0), :]
        return self.dropout(x)


class LearnablePositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=1024):
        super(LearnablePositionalEncoding, self).__init__()
        self.dropout = nn.Dropout(p=dropout)
        self.pe = nn.Parameter(torch.empty(max_len, 1, d_model))
        nn.init.uniform_(self.pe, -0.02, 0.02)

    def forward(self, x):
        x = x + self.pe[:x.size(0), :]
        return self.dropout(x)


def get_pos_encoder(pos_encoding):
    if pos_encoding == "learnable":
        return LearnablePositionalEncoding
    elif pos_encoding == "fixed":
        return FixedPositionalEncoding
    raise NotImplementedError("pos_encoding should be 'learnable'/'fixed', not '{}'".format(pos_encoding))


class TransformerBatchNormEncoderLayer(nn.modules.Module):
    """TransformerEncoderLayer with BatchNorm instead of LayerNorm (mvts_transformer)."""

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation="relu"):
        super(TransformerBatchNormEncoderLayer, self).__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = Linear(d_model, dim_feedforward)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model)

        self.norm1 = BatchNorm1d(d_model, eps=1e-5)
        self.norm2 = BatchNorm1d(d_model, eps=1e-5)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)

        self.activation = _get_activation_fn(activation)

    def forward(self, src: Tensor, src_mask: Optional[Tensor] = None,
                src_key_padding_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        src2 = self.self_attn(src, src, src, attn_mask=src_mask,
                              key_padding_mask=src_key_padding_mask)[0]
        src = src + self.dropout1(src2)  # (seq_len, batch_size, d_model)
        src = src.permute(1, 2, 0)  # (batch_size, d_model, seq_len)
        src = self.norm1(src)
        src = src.permute(2, 0, 1)  # restore (seq_len, batch_size, d_model)
        src2 = self.linear2(self.dropout(self.activation(self.linear1(src))))
        src = src + self.dropout2(src2)
        src = src.permute(1, 2, 0)
        src = self.norm2(src)
        src = src.permute(2, 0, 1)
        return src


class TSTransformerEncoder(nn.Module):

    def __init__(self, feat_dim, max_len, d_model, n_heads, num_layers, dim_feedforward, dropout=0.1,
                 pos_encoding='fixed', activation='gelu', norm='BatchNorm', freeze=False):
        super(TSTransformerEncoder, self).__init__()

        self.max_len = max_len
        self.d_model = d_model
        self.n_heads = n_heads

        self.project_inp = nn.Linear(feat_dim, d_model)
        self.pos_enc = get_pos_encoder(pos_encoding)(d_model, dropout=dropout*(1.0 - freeze), max_len=max_len)

        if norm == 'LayerNorm':
            encoder_layer = TransformerEncoderLayer(d_model, self.n_heads, dim_feedforward, dropout*(1.0 - freeze), activation=activation)
        else:
            encoder_layer = TransformerBatchNormEncoderLayer(d_model, self.n_heads, dim_feedforward, dropout*(1.0 - freeze), activation=activation)

        self.transformer_encoder = nn.TransformerEncoder(encoder_layer, num_layers)

        self.output_layer = nn.Linear(d_model, feat_dim)

        self.act = _get_activation_fn(activation)

        self.dropout1 = nn.Dropout(dropout)

        self.feat_dim = feat_dim

    def forward(self, X, padding_masks):
        """
        X: (batch_size, seq_length, feat_dim); padding_masks: (batch_size, seq_length) bool, 1 = keep, 0 = padding
        """
        inp = X.permute(1, 0, 2)
        inp = self.project_inp(inp) * math.sqrt(self.d_model)  # [seq_length, batch_size, d_model]
        inp = self.pos_enc(inp)  # add positional encoding
        # NOTE: logic for padding masks is reversed to comply with definition in MultiHeadAttention, TransformerEncoderLayer
        output = self.transformer_encoder(inp, src_key_padding_mask=~padding_masks)  # (seq_length, batch_size, d_model)
        output = self.act(output)
        embedding = output
        output = output.permute(1, 0, 2)  # (batch_size, seq_length, d_model)
        output = self.dropout1(output)
        output = self.output_layer(output)  # (batch_size, seq_length, feat_dim)

        return output, embedding


class TSTransformerEncoderClassiregressor(nn.Module):
    """Concatenates final layer embeddings and uses 0s to ignore padding embeddings in final output layer."""

    def __init__(self, feat_dim, max_len, d_model, n_heads, num_layers, dim_feedforward, num_classes,
                 dropout=0.1, pos_encoding='fixed', activation='gelu', norm='BatchNorm', freeze=False):
        super(TSTransformerEncoderClassiregressor, self).__init__()

        self.max_len = max_len
        self.d_model = d_model
        self.n_heads = n_heads

        self.project_inp = nn.Linear(feat_dim, d_model)
        self.pos_enc = get_pos_encoder(pos_encoding)(d_model, dropout=dropout*(1.0 - freeze), max_len=max_len)

        if norm == 'LayerNorm':
            encoder_layer = TransformerEncoderLayer(d_model, self.n_heads, dim_feedforward, dropout*(1.0 - freeze), activation=activation)
        else:
            encoder_layer = TransformerBatchNormEncoderLayer(d_model, self.n_heads, dim_feedforward, dropout*(1.0 - freeze), activation=activation)

        self.transformer_encoder = nn.TransformerEncoder(encoder_layer, num_layers)

        self.act = _get_activation_fn(activation)

        self.dropout1 = nn.Dropout(dropout)

        self.feat_dim = feat_dim
        self.num_classes = num_classes
        self.output_layer = self.build_output_module(d_model, max_len, num_classes)

    def build_output_module(self, d_model, max_len, num_classes):
        output_layer = nn.Linear(d_model * max_len, num_classes)
        return output_layer

    def forward(self, X, padding_masks):
        inp = X.permute(1, 0, 2)
        inp = self.project_inp(inp) * math.sqrt(self.d_model)
        inp = self.pos_enc(inp)
        # NOTE: logic for padding masks is reversed to comply with definition in MultiHeadAttention, TransformerEncoderLayer
        output = self.transformer_encoder(inp, src_key_padding_mask=~padding_masks)  # (seq_length, batch_size, d_model)
        output = self.act(output)
        output = output.permute(1, 0, 2)  # (batch_size, seq_length, d_model)
        output = self.dropout1(output)

        # Output
        output = output * padding_masks.unsqueeze(-1)  # zero-out padding embeddings
        output = output.reshape(output.shape[0], -1)  # (batch_size, seq_length * d_model)
        output = self.output_layer(output)  # (batch_size, num_classes)

        return output


class MaskedMSELoss(nn.Module):
    """Masked MSE Loss (src/models/loss.py)."""

    def __init__(self, reduction: str = 'mean'):
        super().__init__()
        self.reduction = reduction
        self.mse_loss = nn.MSELoss(reduction=self.reduction)

    def forward(self, y_pred: torch.Tensor, y_true: torch.Tensor, mask: torch.BoolTensor) -> torch.Tensor:
        masked_pred = torch.masked_select(y_pred, mask)
        masked_true = torch.masked_select(y_true, mask)
        return self.mse_loss(masked_pred, masked_true)


def noise_mask(X, masking_ratio, rng):
    """'random' distribution, 'separate' mode of dataset.noise_mask: 0s mask and predict, 1s unaffected input."""
    return rng.choice(np.array([True, False]), size=X.shape, replace=True, p=(1 - masking_ratio, masking_ratio))


def padding_mask(lengths, max_len=None):
    """(batch_size, max_len) boolean mask from sequence lengths, 1 means keep element at this position."""
    batch_size = lengths.numel()
    max_len = max_len or lengths.max_val()
    return (torch.arange(0, max_len, device=lengths.device)
            .type_as(lengths)
            .repeat(batch_size, 1)
            .lt(lengths.unsqueeze(1)))


def collate_unsuperv(data, max_len=None, mask_compensation=False):
    batch_size = len(data)
    features, masks, IDs = zip(*data)

    lengths = [X.shape[0] for X in features]
    if max_len is None:
        max_len = max(lengths)
    X = torch.zeros(batch_size, max_len, features[0].shape[-1])
    target_masks = torch.zeros_like(X, dtype=torch.bool)
    for i in range(batch_size):
        end = min(lengths[i], max_len)
        X[i, :end, :] = features[i][:end, :]
        target_masks[i, :end, :] = masks[i][:end, :]

    targets = X.clone()
    X = X * target_masks  # mask input

    padding_masks = padding_mask(torch.tensor(lengths, dtype=torch.int16), max_len=max_len)
    target_masks = ~target_masks  # inverse logic: 0 now means ignore, 1 means predict
    return X, targets, target_masks, padding_masks, IDs


def collate_superv(data, max_len=None):
    batch_size = len(data)
    features, labels, IDs = zip(*data)

    lengths = [X.shape[0] for X in features]
    if max_len is None:
        max_len = max(lengths)
    X = torch.zeros(batch_size, max_len, features[0].shape[-1])
    for i in range(batch_size):
        end = min(lengths[i], max_len)
        X[i, :end, :] = features[i][:end, :]

    targets = torch.stack(labels, dim=0)

    padding_masks = padding_mask(torch.tensor(lengths, dtype=torch.int16), max_len=max_len)

    return X, targets, padding_masks, IDs


def encode_alone(model, x):
    """Reference: one series (L, feat_dim) through the model's layers with no padding and no mask."""
    inp = x.unsqueeze(1)  # (L, 1, feat_dim)
    inp = model.project_inp(inp) * math.sqrt(model.d_model)
    inp = model.pos_enc(inp)
    out = inp
    for layer in model.transformer_encoder.layers:
        out = layer(out)
    return model.act(out)[:, 0]  # (L, d_model)


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    feat_dim, d_model, n_heads, num_layers, dim_ff = 3, 16, 4, 2, 32
    lengths = [9, 4, 7, 2, 6]
    series = [torch.randn(L, feat_dim) for L in lengths]

    # ---- imputation (UnsupervisedRunner.evaluate), BatchNorm and LayerNorm encoders
    for norm, pos in (('BatchNorm', 'fixed'), ('LayerNorm', 'learnable')):
        model = TSTransformerEncoder(feat_dim, 16, d_model, n_heads, num_layers, dim_ff, dropout=0.1,
                                     pos_encoding=pos, activation='gelu', norm=norm)
        if norm == 'BatchNorm':
            for m in model.modules():
                if isinstance(m, BatchNorm1d):
                    m.running_mean.normal_(0, 0.3)
                    m.running_var.uniform_(0.5, 2.0)
        model = model.eval()
        loss_module = MaskedMSELoss(reduction='none')

        data = [(s, torch.from_numpy(noise_mask(s.numpy(), 0.3, rng)), i) for i, s in enumerate(series)]
        X, targets, target_masks, padding_masks, IDs = collate_unsuperv(data)
        with torch.no_grad():
            predictions, embedding = model(X, padding_masks)
            target_masks = target_masks * padding_masks.unsqueeze(-1)
            loss = loss_module(predictions, targets, target_masks)

            ref_losses = []
            for i, (s, keep, _) in enumerate(data):
                L = s.shape[0]
                x_in = s * keep
                emb = encode_alone(model, x_in)
                pred = model.output_layer(emb)  # (L, feat_dim)
                assert torch.allclose(predictions[i, :L], pred, atol=1e-5), (norm, i)
                assert torch.allclose(embedding[:L, i], emb, atol=1e-5), (norm, i)
                sel = ~keep
                # double loop over (time step, feature) in the order masked_select reads them
                for t in range(L):
                    for f in range(feat_dim):
                        if sel[t, f]:
                            ref_losses.append((pred[t, f] - s[t, f]) ** 2)
            ref_losses = torch.stack(ref_losses)
            assert loss.shape == ref_losses.shape, (loss.shape, ref_losses.shape)
            assert torch.allclose(loss, ref_losses, atol=1e-5), norm
        print(f"imputation [{norm}]: {len(loss)} masked elements, mean loss {loss.mean().item():.4f} matches per-series runs")

    # ---- classification (SupervisedRunner.evaluate) with a fixed max_len
    max_len, num_classes = 12, 4
    clf = TSTransformerEncoderClassiregressor(feat_dim, max_len, d_model, n_heads, num_layers, dim_ff,
                                              num_classes=num_classes, dropout=0.1, pos_encoding='learnable',
                                              activation='gelu', norm='BatchNorm').eval()
    labels = [torch.tensor([i % num_classes]) for i in range(len(series))]
    data = [(s, y, i) for i, (s, y) in enumerate(zip(series, labels))]
    X, targets, padding_masks, IDs = collate_superv(data, max_len=max_len)
    loss_module = nn.CrossEntropyLoss(reduction='none')
    with torch.no_grad():
        predictions = clf(X, padding_masks)
        loss = loss_module(predictions, targets.squeeze(1))
        for i, s in enumerate(series):
            L = s.shape[0]
            emb = encode_alone(clf, s)
            flat = torch.zeros(max_len, d_model)
            flat[:L] = emb
            ref = clf.output_layer(flat.reshape(1, -1))[0]
            assert torch.allclose(predictions[i], ref, atol=1e-5), i
            ref_loss = -torch.log_softmax(ref, -1)[labels[i][0]]
            assert torch.allclose(loss[i], ref_loss, atol=1e-5), i
    print("classification: logits of", len(series), "padded series match per-series runs; preds",
          predictions.argmax(1).tolist())
    print("OK")


if __name__ == "__main__":
    main()
