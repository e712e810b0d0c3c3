# good-features (histaug), georg-wolflein/good-features#1 ("Improve masked attention"): AttentionMIL multiplied the
# attention logits by the bag mask, so padded tiles get logit 0 (not -inf) and still take softmax weight.
import sys
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class AttentionMIL(nn.Module):
    def __init__(self, targets, d_features: int, hidden_dim: Optional[int] = 256, batchnorm: bool = True):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_features, hidden_dim), nn.ReLU())
        self.attention = nn.Sequential(nn.Linear(hidden_dim, hidden_dim // 2), nn.Tanh(), nn.Linear(hidden_dim // 2, 1))
        self.pre_head = nn.Sequential(nn.BatchNorm1d(hidden_dim), nn.Dropout()) if batchnorm else nn.Dropout()
        self.heads = nn.ModuleDict(
            {
                target.column: nn.Linear(
                    in_features=hidden_dim,
                    out_features=len(target.classes) if target.type == "categorical" else 1,
                )
                for target in targets
            }
        )
        self.targets = targets

    def forward(self, feats, coords, mask, *args, **kwargs):
        embeddings = self.encoder(feats)  # B, N, D
        attention = self.attention(embeddings)  # B, N, 1
        if FIXED:
            attention = torch.masked_fill(attention, ~mask.unsqueeze(-1), -torch.inf)  # B, N, 1
        else:
            attention = attention * mask.unsqueeze(-1)  # B, N, 1
        attention = F.softmax(attention, dim=-2)  # B, N, 1
        embeddings = embeddings * attention  # B, N, D
        slide_tokens = embeddings.sum(dim=-2)  # B, D
        slide_tokens = self.pre_head(slide_tokens)  # B, D

        # Apply the corresponding head to each slide-level token
        logits = {target.column: self.heads[target.column](slide_tokens).squeeze(-1) for target in self.targets}
        return logits


targets = [SimpleNamespace(column="isMSIH", type="categorical", classes=["nonMSIH", "MSIH"])]
model = AttentionMIL(targets, d_features=32, hidden_dim=64).eval()

# two slides (bags of tile features), zero-padded to the longest bag as the bag collate function does
n_tiles = [12, 7]
N = max(n_tiles)
feats = torch.zeros(2, N, 32)
mask = torch.zeros(2, N, dtype=torch.bool)
for b, n in enumerate(n_tiles):
    feats[b, :n] = torch.randn(n, 32)
    mask[b, :n] = True
coords = torch.zeros(2, N, 2)

with torch.no_grad():
    batched = model(feats, coords, mask)["isMSIH"]
    alone = model(feats[1:, :7], coords[1:, :7], mask[1:, :7])["isMSIH"]
print("slide 1 logits batched:", batched[1].tolist(), " alone:", alone[0].tolist())
print("max |batched - alone| for the padded slide:", (batched[1] - alone[0]).abs().max().item())
