"""sktime MomentFMForecaster: the padding mask goes to ``mask=`` and MOMENT attends the zero pad.

Citation: sktime/sktime#10685 ("[ENH] golden output tests for MomentFMForecaster", merged; towards
#10672). PR description read; the fixed ``_predict`` and the vendored
``sktime/libs/momentfm/models/moment.py`` were read in stored sktime sources. The pre-fix call
``self.model(x_enc=..., mask=input_mask)`` is quoted in the PR description.

Bug: ``MomentFMForecaster._predict`` right-pads a short history with zeros up to MOMENT's fixed
context (``_moment_seq_len``, 512 upstream) and builds ``input_mask`` (1 = real, 0 = pad), but
called ``self.model(x_enc=y_torch_input, mask=input_mask)``. ``MOMENT.forward`` reads ``mask`` only
for the reconstruction task; for forecasting it defaults ``input_mask`` to all ones, so the
T5 encoder's patch ``attention_mask`` (``Masking.convert_seq_to_patch_view``) marks the zero
padding patches as real and every patch attends them (RevIN statistics are corrupted too).
Fix: ``input_mask = input_mask.unsqueeze(0).repeat(num_instances, 1)`` and
``self.model(x_enc=y_torch_input, input_mask=input_mask)``.

Reproduction: plain-torch MOMENT (RevIN, patching, one T5-style encoder layer with the additive
extended mask and softmax over q @ k^T, forecasting head), random weights. Sizes are scaled
down: context 32 instead of 512, patch_len 8, a 16-step history with 2 channels, horizon 4.
"""
import sys

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Masking:
    @staticmethod
    def convert_seq_to_patch_view(mask, patch_len=8, stride=None):
        stride = patch_len if stride is None else stride
        mask = mask.unfold(dimension=-1, size=patch_len, step=stride)
        # mask : [batch_size x n_patches x patch_len]
        return (mask.sum(dim=-1) == patch_len).long()


class RevIN(nn.Module):
    def __init__(self, num_features, eps=1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x, mask=None, mode="norm"):
        if mode == "norm":
            if mask is None:
                mask = torch.ones((x.shape[0], x.shape[-1]))
            n_channels = x.shape[1]
            mask = mask.unsqueeze(1).repeat(1, n_channels, 1).bool()
            masked_x = torch.where(mask, x, torch.nan)
            self.mean = torch.nanmean(masked_x, dim=-1, keepdim=True).detach()
            var = torch.nanmean((masked_x - self.mean) ** 2, dim=-1, keepdim=True)
            self.stdev = torch.sqrt(var + self.eps).detach()
            return (x - self.mean) / self.stdev
        return x * self.stdev + self.mean


class T5LayerSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.d_kv = n_heads, d_model // n_heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, hidden_states, extended_attention_mask):
        b, n, _ = hidden_states.shape

        def shape(t):
            return t.view(b, n, self.n_heads, self.d_kv).transpose(1, 2)

        q, k, v = shape(self.q(hidden_states)), shape(self.k(hidden_states)), shape(self.v(hidden_states))
        scores = torch.matmul(q, k.transpose(3, 2)) + extended_attention_mask
        attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(b, n, -1)
        return hidden_states + self.o(out)


class T5Stack(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.layer = T5LayerSelfAttention(d_model, n_heads)

    def forward(self, inputs_embeds, attention_mask):
        # get_extended_attention_mask: 1 -> 0, 0 -> finfo.min
        extended = (1.0 - attention_mask[:, None, None, :].to(inputs_embeds.dtype)) * torch.finfo(inputs_embeds.dtype).min
        return self.layer(inputs_embeds, extended)


class MOMENT(nn.Module):
    def __init__(self, seq_len=32, patch_len=8, d_model=16, n_heads=2, forecast_horizon=4):
        super().__init__()
        self.patch_len = patch_len
        self.d_model = d_model
        self.normalizer = RevIN(num_features=1)
        self.patch_embedding = nn.Linear(patch_len, d_model)
        self.encoder = T5Stack(d_model, n_heads)
        self.head = nn.Linear(d_model * (seq_len // patch_len), forecast_horizon)

    def forecast(self, x_enc, input_mask=None, **kwargs):
        batch_size, n_channels, seq_len = x_enc.shape
        x_enc = self.normalizer(x=x_enc, mask=input_mask, mode="norm")
        x_enc = torch.nan_to_num(x_enc, nan=0, posinf=0, neginf=0)
        x_enc = x_enc.unfold(dimension=-1, size=self.patch_len, step=self.patch_len)  # tokenizer
        enc_in = self.patch_embedding(x_enc)
        n_patches = enc_in.shape[2]
        enc_in = enc_in.reshape((batch_size * n_channels, n_patches, self.d_model))
        patch_view_mask = Masking.convert_seq_to_patch_view(input_mask, self.patch_len)
        attention_mask = patch_view_mask.repeat_interleave(n_channels, dim=0)
        enc_out = self.encoder(inputs_embeds=enc_in, attention_mask=attention_mask)
        enc_out = enc_out.reshape((-1, n_channels, n_patches * self.d_model))
        dec_out = self.head(enc_out)  # [batch_size x n_channels x forecast_horizon]
        return self.normalizer(x=dec_out, mode="denorm")

    def forward(self, x_enc, mask=None, input_mask=None, **kwargs):
        if input_mask is None:
            input_mask = torch.ones_like(x_enc[:, 0, :])
        # task_name == "forecasting": `mask` is only read for reconstruction
        return self.forecast(x_enc=x_enc, input_mask=input_mask, **kwargs)


def _create_padding(x, pad_shape):
    """Return zero padded tensor of size seq_len, num_cols."""
    x_ = torch.from_numpy(x)
    out = torch.cat((x_, torch.zeros(pad_shape, dtype=x_.dtype)), axis=1)
    return out.numpy()


def _create_mask(ones_length, zeros_length=0):
    return torch.cat((torch.ones(ones_length), torch.zeros(zeros_length)))


class MomentFMForecaster:
    def __init__(self, seq_len):
        self._seq_len = seq_len
        self._moment_seq_len = 32  # forced seq_len by pre-trained model (512 upstream)
        self.model = MOMENT(seq_len=self._moment_seq_len).eval()

    def _predict(self, y_values):
        y_ = np.expand_dims(y_values, axis=0)
        num_instances, sequence_length, num_channels = y_.shape
        if sequence_length < self._moment_seq_len:
            # if smaller, need to pad values
            y_ = _create_padding(y_, (num_instances, self._moment_seq_len - sequence_length, num_channels))
            input_mask = _create_mask(sequence_length, self._moment_seq_len - sequence_length)
        else:
            input_mask = _create_mask(self._moment_seq_len)
        if FIXED:
            # broadcast the per-timestep mask to all instances in the batch
            input_mask = input_mask.unsqueeze(0).repeat(num_instances, 1)
        y_ = y_.transpose(0, 2, 1)
        y_torch_input = torch.from_numpy(y_).float()
        with torch.no_grad():
            if FIXED:
                output = self.model(x_enc=y_torch_input, input_mask=input_mask)
            else:
                output = self.model(x_enc=y_torch_input, mask=input_mask)
        return output.numpy().transpose(0, 2, 1)


if __name__ == "__main__":
    t = np.arange(16, dtype=np.float32)
    y = np.stack([np.sin(t / 3.0) + 5.0, np.cos(t / 4.0) * 2.0], axis=1)  # 16 steps, 2 channels
    forecaster = MomentFMForecaster(seq_len=16)
    pred = forecaster._predict(y)
    print("fixed" if FIXED else "buggy", "forecast[0,:,0]:", np.round(pred[0, :, 0], 3))
