# The CSU-MS2 bug (tingxiecsu/CSU-MS2#4) written another way: a set encoder over left-padded atoms (torch's
# nn.TransformerEncoder, batch first, handed `padding_mask`, True = padding) with an attention readout of one score per
# atom, filled by torch.where and pooled by bmm. The readout is handed the same padding mask but reads it as a keep
# mask: it fills the real atoms and pools the pads. The fix fills where the mask says padding.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class AttentionReadout(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gate = nn.Linear(dim, 1)

    def forward(self, h, mask):
        scores = self.gate(h).squeeze(-1)  # (B, N)
        hidden = mask if FIXED else ~mask  # (the bug: True taken as "keep")
        scores = torch.where(hidden, torch.full_like(scores, -1e9), scores)
        alpha = torch.softmax(scores, dim=-1)
        return torch.bmm(alpha.unsqueeze(1), h).squeeze(1)


class SetEncoder(nn.Module):
    def __init__(self, n_types=10, dim=16):
        super().__init__()
        self.embed = nn.Embedding(n_types, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.readout = AttentionReadout(dim)

    def forward(self, atoms, counts):
        n = atoms.shape[1]
        padding_mask = torch.arange(n)[None, :] < (n - counts)[:, None]  # left padded: True = padding
        h = self.encoder(self.embed(atoms), src_key_padding_mask=padding_mask)
        return self.readout(h, padding_mask)


model = SetEncoder().eval()
counts = torch.tensor([9, 5, 7])
atoms = torch.zeros(3, 9, dtype=torch.long)
for b, c in enumerate(counts.tolist()):
    atoms[b, 9 - c:] = torch.randint(1, 10, (c,))
with torch.no_grad():
    out = model(atoms, counts)
    alone = model(atoms[1:2, 9 - 5:], counts[1:2])
print(f"fixed={FIXED}  max |padded row - alone|: {float((out[1] - alone[0]).abs().max()):.6f}")
