"""Probabilistic forecasting of intermittent demand: zero sales are real observations; gaps come only from the mask.

Follows huggingface/transformers src/transformers/models/time_series_transformer/modeling_time_series_transformer.py
(``TimeSeriesTransformerForPrediction.forward`` / ``generate`` with ``past_observed_mask`` /
``future_observed_mask``, ``TimeSeriesMeanScaler``) as used in the Hugging Face blog "Probabilistic Time Series
Forecasting with Transformers" (https://huggingface.co/blog/time-series-transformers), where GluonTS's
``AddObservedValuesIndicator`` turns NaN into 0 plus an observed flag of 0. The model is built from a small
TimeSeriesTransformerConfig with random weights.

Mask meant: the encoder attends over the whole context window in both directions and the decoder attends causally
over the forecast horizon plus fully over the encoder output. Zero-valued steps are NOT padding: a store that sold
nothing on a day has value 0 and observed flag 1, and it must enter attention, the mean scale (as a 0 in the
numerator and a 1 in the denominator) and the loss. Only steps with observed flag 0 (the NaNs of the raw data) are
left out of the scale and the loss; they still occupy their time slot.
"""
import math

import torch
from transformers import TimeSeriesTransformerConfig, TimeSeriesTransformerForPrediction


def add_observed_values_indicator(raw):
    """GluonTS AddObservedValuesIndicator: NaN -> 0 with observed 0; every other value (zeros included) observed."""
    observed = ~torch.isnan(raw)
    return torch.nan_to_num(raw, nan=0.0), observed.float()


def main():
    torch.manual_seed(0)
    config = TimeSeriesTransformerConfig(
        prediction_length=4, context_length=8, lags_sequence=[1, 2, 3], num_time_features=1,
        input_size=1, scaling="mean", d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
        num_parallel_samples=5, distribution_output="negative_binomial",
    )
    model = TimeSeriesTransformerForPrediction(config).eval()
    past_length = config.context_length + max(config.lags_sequence)

    nan = math.nan
    # two stores, 11 days of history each: many true zeros, a few missing days (NaN)
    past_raw = torch.tensor([
        [0, 0, 3, 0, 0, 1, 0, nan, 0, 2, 0],
        [5, nan, nan, 0, 4, 0, 0, 6, 0, 0, 0],
    ], dtype=torch.float32)
    future_raw = torch.tensor([[0, 1, nan, 0], [0, 0, 2, 0]], dtype=torch.float32)
    past_values, past_observed_mask = add_observed_values_indicator(past_raw)
    future_values, future_observed_mask = add_observed_values_indicator(future_raw)
    days = torch.arange(past_length + config.prediction_length, dtype=torch.float32)
    time_feature = (days % 7 / 6.0 - 0.5)[None, :, None].expand(2, -1, -1)
    past_time_features = time_feature[:, :past_length]
    future_time_features = time_feature[:, past_length:]

    with torch.no_grad():
        outputs = model(past_values=past_values, past_time_features=past_time_features,
                        past_observed_mask=past_observed_mask, future_values=future_values,
                        future_time_features=future_time_features, future_observed_mask=future_observed_mask)
        assert torch.isfinite(outputs.loss)

        # Reference mean scale over the context window, by an explicit loop: observed zeros count as observations.
        for b in range(2):
            total, count = 0.0, 0
            for t in range(past_length - config.context_length, past_length):
                if not math.isnan(float(past_raw[b, t])):
                    total += abs(float(past_raw[b, t]))
                    count += 1
            expected = max(total / count, 1e-10)  # TimeSeriesMeanScaler minimum_scale
            assert abs(float(outputs.scale[b].squeeze()) - expected) < 1e-5, (b, outputs.scale[b], expected)

        forecast = model.generate(past_values=past_values, past_time_features=past_time_features,
                                  past_observed_mask=past_observed_mask, future_time_features=future_time_features)
    samples = forecast.sequences
    assert samples.shape == (2, config.num_parallel_samples, config.prediction_length)
    assert (samples >= 0).all()  # negative binomial counts
    print(f"loss {outputs.loss.item():.3f}; scales {outputs.scale.flatten().tolist()}; samples {tuple(samples.shape)}")


if __name__ == "__main__":
    main()
