"""sktime TinyTimeMixerForecaster: short histories are left-padded with zeros to the
checkpoint's context_length, and `_pad_truncate` hands the model a past_observed_mask.

Citation: sktime/sktime#10626, fixed by sktime/sktime#10627 (commit 2f8cc3c304,
"[BUG] Align TinyTimeMixer padding masks with Granite-TSFM"), sktime/forecasting/ttm.py
`_pad_truncate` and `TinyTimeMixerForecaster._predict`.

Before the fix `_pad_truncate` marked the synthetic zero padding unobserved (mask 0) while
Granite-TSFM, whose checkpoints sktime loads, builds past_observed_mask with ~np.isnan and so
treats its numeric zero padding as observed. The TTM std scaler reads the mask, so every
padded short-history forecast differed from the source pipeline (up to 53.8 on airline).
The fix marks the padding observed: `mask = np.ones_like(truncated_data)`.

TinyTimeMixer lives in granite-tsfm, not transformers; its forward (std scaler over
past_observed_mask, patching, mixer, linear head) is the one of transformers'
PatchTSMixerForPrediction, built here from a tiny config in its place.
"""
import sys

import numpy as np
import torch
from transformers import PatchTSMixerConfig, PatchTSMixerForPrediction

FIXED = "--fixed" in sys.argv


def _pad_truncate(data, seq_len, pad_value=0):
    """Pad or truncate (batch_size, original_seq_len, n_dims) to seq_len, as sktime does."""
    batch_size, original_seq_len, n_dims = data.shape

    if original_seq_len > seq_len:
        truncated_data = data[:, -seq_len:, :]
        mask = np.ones_like(truncated_data)
    else:
        truncated_data = np.pad(
            data,
            ((0, 0), (seq_len - original_seq_len, 0), (0, 0)),
            mode="constant",
            constant_values=pad_value,
        )
        if FIXED:
            mask = np.ones_like(truncated_data)
        else:
            mask = np.zeros_like(truncated_data)
            mask[:, -original_seq_len:, :] = 1

    return truncated_data, mask


def _predict(model, y_values):
    hist = np.expand_dims(y_values, axis=0)  # (batch_size, n_timestamps, n_cols)
    past_values, observed_mask = _pad_truncate(hist, model.config.context_length)
    past_values = torch.tensor(past_values).to(model.dtype)
    observed_mask = torch.tensor(observed_mask).to(model.dtype)
    model.eval()
    with torch.no_grad():
        # TTM's forward names it past_observed_mask; PatchTSMixer's names it observed_mask
        outputs = model(past_values=past_values, observed_mask=observed_mask)
    return outputs.prediction_outputs.detach().cpu().numpy()


def main():
    torch.manual_seed(0)
    config = PatchTSMixerConfig(
        context_length=32,
        prediction_length=8,
        patch_length=8,
        patch_stride=8,
        num_input_channels=1,
        d_model=16,
        num_layers=2,
        scaling="std",
        mode="common_channel",
        dropout=0.0,
        head_dropout=0.0,
    )
    model = PatchTSMixerForPrediction(config)

    # a short history (20 points) against a 32-point context: 12 zeros of padding
    t = np.arange(20, dtype=np.float32)
    y = (100.0 + 10.0 * np.sin(t / 3.0) + t).reshape(-1, 1).astype(np.float32)
    pred = _predict(model, y)
    print("forecast:", np.round(pred[0, :, 0], 3).tolist())


if __name__ == "__main__":
    main()
