# Written another way (checks/padend.py): moment-research#3's padding mask at the wrong end of the zeros, as a sensor
# classifier's collate writes it: windows of 10, 6 and 3 steps of 2 channels are left-padded with zeros to 10
# (`F.pad(w, (0, 0, n, 0))`, (B, S, C)), but the key padding mask is built by length from the start
# (`arange(S) >= length`, True = padding, the right-padding rule), so nn.TransformerEncoder hides the last real steps
# and attends the zero padding at the start. The fix builds it from the end (`arange(S) < S - length`).
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def collate(windows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(w.shape[0] for w in windows)
    values = torch.stack([F.pad(w, (0, 0, longest - w.shape[0], 0)) for w in windows])  # zeros first
    lengths = torch.tensor([w.shape[0] for w in windows])
    steps = torch.arange(longest)[None, :]
    if FIXED:
        padding_mask = steps < longest - lengths[:, None]
    else:
        padding_mask = steps >= lengths[:, None]
    return values, padding_mask


class SensorClassifier(nn.Module):
    def __init__(self, channels: int = 2, d_model: int = 16, classes: int = 3):
        super().__init__()
        self.proj = nn.Linear(channels, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=32, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, values: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.proj(values), src_key_padding_mask=padding_mask)
        keep = (~padding_mask).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1))


windows = [torch.randn(n, 2).cumsum(0) + 3.0 for n in (10, 6, 3)]
values, padding_mask = collate(windows)
model = SensorClassifier().eval()
with torch.no_grad():
    logits = model(values, padding_mask)
print(f"logits {tuple(logits.shape)}; padded steps attended: {int(padding_mask.sum())} masked")
