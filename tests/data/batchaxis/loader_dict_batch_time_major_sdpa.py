"""A time-major self-attention block handed the batch-first series a DataLoader collated (dicts of samples).

Written for checks/batchaxis.py another way than BreizhCrops#20 (nn.TransformerEncoder at batch_first=False inside a
Sequential, handed the (N, T, D) batch of a TensorDataset): a hand-written block on SDPA that reads its input as
(T, N, E), fairseq's `tgt_len, bsz, embed_dim = x.size()`, a dataset of dicts (`{"series": (T, C), "label": ()}`)
collated by the DataLoader's default collate into `batch["series"]` (N, T, C), the sizes in a dict. The bug hands the
batch as it comes: the block attends across the 6 series of the batch at each of their 20 time steps. `--fixed`
transposes to (T, N, C) first.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

FIXED = "--fixed" in sys.argv
CONFIG = {"channels": 5, "embed": 16, "heads": 2, "steps": 20, "classes": 3, "batch": 6}


class SeriesSet(Dataset):
    def __init__(self, count, steps, channels):
        g = torch.Generator().manual_seed(0)
        self.series = torch.randn(count, steps, channels, generator=g)
        self.labels = torch.randint(0, CONFIG["classes"], (count,), generator=g)

    def __len__(self):
        return len(self.series)

    def __getitem__(self, i):
        return {"series": self.series[i], "label": self.labels[i]}


class TimeMajorBlock(nn.Module):
    """Self-attention over the first axis of a (T, N, E) input."""

    def __init__(self, embed, heads):
        super().__init__()
        self.heads = heads
        self.in_proj = nn.Linear(embed, 3 * embed)
        self.out_proj = nn.Linear(embed, embed)

    def forward(self, x):
        tgt_len, bsz, embed_dim = x.size()
        hd = embed_dim // self.heads
        q, k, v = (t.reshape(tgt_len, bsz, self.heads, hd).permute(1, 2, 0, 3) for t in self.in_proj(x).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v)  # (bsz, heads, tgt_len, hd)
        return x + self.out_proj(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim))


class SeriesClassifier(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Linear(cfg["channels"], cfg["embed"])
        self.block = TimeMajorBlock(cfg["embed"], cfg["heads"])
        self.head = nn.Linear(cfg["embed"], cfg["classes"])

    def forward(self, series):
        x = self.embed(series)
        if FIXED:
            x = self.block(x.transpose(0, 1)).transpose(0, 1)  # (N, T, E) -> (T, N, E) and back
        else:
            x = self.block(x)
        return self.head(x.mean(dim=1))


def main():
    torch.manual_seed(0)
    loader = DataLoader(SeriesSet(24, CONFIG["steps"], CONFIG["channels"]), batch_size=CONFIG["batch"])
    model = SeriesClassifier(CONFIG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    total = 0.0
    for batch in loader:
        loss = F.cross_entropy(model(batch["series"]), batch["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
    print(f"loss {total:.4f}")


if __name__ == "__main__":
    main()
