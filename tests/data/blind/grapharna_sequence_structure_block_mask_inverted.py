"""GraphaRNA SequenceStructureModule: per-structure block mask written with inverted polarity.

Citation: mjustynaPhD/GraphaRNA PR #10 ("fix: attention mask in the transformer block was
incorrect"), commit fdc0af32ac508e3b41b1596b758badc4ffb2db65 (on main). Read in the upstream git
history of src/grapharna/models.py (parent and fix commit).

Bug: all residues of a PyG mini-batch of RNA structures are concatenated into one unbatched
sequence `x` of shape (num_nodes, dim) and run through `nn.TransformerEncoder(x, mask=...)`,
with `batch` (node -> structure index) meant to restrict attention to the own structure. The
mask started as zeros and set the same-structure cells to 1 (when `batch.sum() != 0`), then
passed `attn_mask.bool()`: for a boolean `mask` True means "not allowed", so with two or more
structures every residue attends ONLY to the other structures' residues and never to its own.
(With a single structure, `batch.sum() == 0` kept the mask all zeros: full attention, correct.)
Fix: start from ones (block all) and set the same-structure cells to 0.

This program: the RiNALMo sequence embeddings and the PAMNet structure features are random
tensors of the same widths; a batch of two structures with 5 and 3 residues.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class SequenceStructureModule(nn.Module):
    def __init__(self, dim, n_layers: int = 6, nhead: int = 8):
        super(SequenceStructureModule, self).__init__()
        self.encoder_layer = nn.TransformerEncoderLayer(d_model=dim, nhead=nhead, batch_first=True)
        self.transformer_encoder = nn.TransformerEncoder(self.encoder_layer, num_layers=n_layers, norm=nn.LayerNorm(dim))

    def forward(self, seq_emb, x_struct, batch):
        x = torch.cat((seq_emb, x_struct), dim=1)
        if FIXED:
            attn_mask = torch.ones(x.size(0), x.size(0), device=x.device)  # Default: block all
            attn_pos = torch.where(batch[:, None] == batch[None, :])
            attn_mask[attn_pos] = 0  # Allow attention within same structure
        else:
            attn_mask = torch.zeros(x.size(0), x.size(0), device=x.device)
            attn_pos = torch.where(batch[:, None] == batch[None, :])
            if batch.sum() == 0:
                attn_mask[attn_pos] = 0
            else:
                attn_mask[attn_pos] = 1
        out = self.transformer_encoder(x, mask=attn_mask.bool())
        return out


def main():
    torch.manual_seed(0)
    seq_emb_dim, dim = 16, 16
    batch = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])  # PyG Batch.batch for two RNA structures
    seq_emb = torch.randn(batch.numel(), seq_emb_dim)  # stands for RiNALMo embeddings per nucleotide
    x_struct = torch.randn(batch.numel(), dim)  # stands for PAMNet coarse-grain features
    module = SequenceStructureModule(seq_emb_dim + dim, n_layers=2, nhead=8).eval()
    with torch.no_grad():
        out = module(seq_emb, x_struct, batch)
        alone = module(seq_emb[batch == 1], x_struct[batch == 1], torch.zeros(3, dtype=torch.long))
    print("structure 1 batched vs alone, max diff:", round((out[batch == 1] - alone).abs().max().item(), 5))


if __name__ == "__main__":
    main()
