# The same bug as neuralforecast#1014 (MOMENT handed no insample_mask), written as a variable-length time-series
# classifier writes it: a collate function right-pads each series with zeros and states which steps are there in the
# batch dict's `available_mask` (1 = a step of the series); the model takes the whole batch dict, and its encoder
# (nn.TransformerEncoder over one token per step) was called without a key padding mask, so every step attends the
# zero padding after the short series. The fix hands `src_key_padding_mask=~available_mask`.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def collate(series: list) -> dict:
    """Right-pad a list of 1-D series with zeros; available_mask marks the steps each series has."""
    longest = max(len(s) for s in series)
    values = torch.zeros(len(series), longest)
    available = torch.zeros(len(series), longest, dtype=torch.long)
    for i, s in enumerate(series):
        values[i, :len(s)] = s
        available[i, :len(s)] = 1
    return {"values": values, "available_mask": available}


class SeriesClassifier(nn.Module):
    def __init__(self, d_model: int = 16, n_heads: int = 2, n_classes: int = 3):
        super().__init__()
        self.embed = nn.Linear(1, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, batch: dict) -> torch.Tensor:
        h = self.embed(batch["values"].unsqueeze(-1))              # [B, T, d]
        available = batch["available_mask"].bool()
        if FIXED:
            h = self.encoder(h, src_key_padding_mask=~available)
        else:
            h = self.encoder(h)
        pooled = (h * available.unsqueeze(-1)).sum(1) / available.sum(1, keepdim=True)
        return self.head(pooled)


model = SeriesClassifier().train()  # (training step: the encoder's fast path is off, as under autograd)
series = [torch.randn(10).cumsum(0) + 5.0, torch.randn(6).cumsum(0) + 5.0, torch.randn(8).cumsum(0) + 5.0]
batch = collate(series)
logits = model(batch)
alone = model(collate([series[1]]))
print("logits of the short series, batched vs alone: max |diff| =", f"{(logits[1] - alone[0]).abs().max().item():.6f}")
