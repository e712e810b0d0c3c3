"""Correct: DataLoader batches attended along their time axis, whichever way the program lays them out.

For checks/batchaxis.py's reading of a DataLoader's batch (trace/loaderbatch.py): a loader with a collate_fn of the
program's own that pads the series time-major (`pad_sequence`, (T, N, C)) feeding a time-major nn.TransformerEncoder
(batch_first=False) as it is; and a loader with the default collate ((N, T, C)) feeding a batch_first=True encoder.
Both attend over each series' own steps: nothing to say.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, TensorDataset


def time_major(samples):
    series = pad_sequence([s for s, _ in samples])  # (T, N, C): the program's own collate
    return series, torch.stack([y for _, y in samples])


class Encoder(nn.Module):
    def __init__(self, channels, embed, batch_first):
        super().__init__()
        self.embed = nn.Linear(channels, embed)
        layer = nn.TransformerEncoderLayer(embed, 2, 32, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(embed, 3)
        self.time_axis = 1 if batch_first else 0

    def forward(self, series):
        return self.head(self.encoder(self.embed(series)).mean(dim=self.time_axis))


def main():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 12, 4), torch.randint(0, 3, (16,)))
    runs = ((DataLoader(data, batch_size=4, collate_fn=time_major), Encoder(4, 16, batch_first=False)),
            (DataLoader(data, batch_size=4), Encoder(4, 16, batch_first=True)))
    for loader, model in runs:
        total = 0.0
        for series, labels in loader:
            total += F.cross_entropy(model(series), labels).item()
        print(f"loss {total:.4f}")


if __name__ == "__main__":
    main()
