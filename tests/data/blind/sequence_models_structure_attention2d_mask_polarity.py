# microsoft/protein-sequence-models commit 6669c32 ("Fix masking bugs in attention layer."), sequence_models/structure.py.
# Attention2d pools the ByteNet2d features of a padded (N, L, L) structure map with a softmax over the L*L pairs;
# it filled -inf where input_mask was 1 (the residue pairs that exist) instead of where it was 0 (the padding).
# The fix masks ~input_mask. (The same commit also dropped the .unsqueeze(-1) on the embedder's mask, a shape change
# for its caller; this port keeps the collater's (N, L, L) structure_mask and the pre-fix embedder call.)
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# sequence_models/layers.py
class PositionFeedForward(nn.Module):

    def __init__(self, d_in, d_out):
        super().__init__()
        self.conv = nn.Conv1d(d_in, d_out, 1)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class PositionFeedForward2d(nn.Module):

    def __init__(self, d_in, d_out):
        super().__init__()
        self.conv = nn.Conv2d(d_in, d_out, 1)

    def forward(self, x):
        return self.conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


# sequence_models/convolutional.py
class MaskedConv2d(nn.Conv2d):
    """ A masked 2-dimensional convolution layer.

         Shape:
            Input: (N, L, L, in_channels)
            input_mask: (N, L, L, 1), optional
            Output: (N, L, L, out_channels)
    """

    def __init__(self, in_channels: int, out_channels: int,
                 kernel_size: int, stride: int=1, dilation: int=1, groups: int=1,
                 bias: bool=True):
        padding = dilation * (kernel_size - 1) // 2
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, dilation=dilation,
                                           groups=groups, bias=bias, padding=padding)

    def forward(self, x, input_mask=None):
        if input_mask is not None:
            x = x * input_mask
        return super().forward(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


class MaskedCausalConv1d(nn.Module):
    """Masked Causal 1D convolution (training mode only in this port)."""

    def __init__(self, in_channels, out_channels, kernel_size=1, dilation=1, groups=1, init=None):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.dilation = dilation
        self.groups = groups
        self.sequential = False
        self.zeros = (kernel_size - 1) * dilation
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        if init:
            init(self.conv)

    def forward(self, x, input_mask=None):
        if input_mask is not None:
            x = x * input_mask
        x = torch.transpose(x, 1, 2)
        if self.kernel_size == 1:
            return self.conv(x).transpose(1, 2)
        out = self._pad(x)
        return self._unpad(self.conv(out)).transpose(1, 2)

    def _pad(self, x):
        return F.pad(x, [self.zeros, 0])

    def _unpad(self, x):
        return x


class ByteNetBlock(nn.Module):

    def __init__(self, d_in, d_h, d_out, kernel_size, dilation=1, groups=1, causal=False, ells=None):
        super().__init__()
        self.conv = MaskedCausalConv1d(d_h, d_h, kernel_size=kernel_size, dilation=dilation, groups=groups)
        layers1 = [
            nn.LayerNorm(d_in),
            nn.ReLU(),
            PositionFeedForward(d_in, d_h),
            nn.LayerNorm(d_h),
            nn.ReLU()
            ]
        layers2 = [
            nn.LayerNorm(d_h),
            nn.ReLU(),
            PositionFeedForward(d_h, d_out),
            ]
        self.sequence1 = nn.Sequential(*layers1)
        self.sequence2 = nn.Sequential(*layers2)

    def forward(self, x, input_mask=None):
        return x + self.sequence2(
            self.conv(self.sequence1(x), input_mask=input_mask)
        )


class ByteNet(nn.Module):

    def __init__(self, n_tokens, d_embedding, d_model, n_layers, kernel_size, r,
                 ells=None, padding_idx=None, causal=False, dropout=0.0):
        super().__init__()
        self.embedder = nn.Embedding(n_tokens, d_embedding, padding_idx=padding_idx)
        self.up_embedder = PositionFeedForward(d_embedding, d_model)
        log2 = int(np.log2(r)) + 1
        dilations = [2 ** (n % log2) for n in range(n_layers)]
        layers = [
            ByteNetBlock(d_model, d_model // 2, d_model, kernel_size, dilation=d, causal=causal, ells=ells)
            for d in dilations
        ]
        self.layers = nn.ModuleList(modules=layers)
        self.dropout = dropout

    def forward(self, x, input_mask=None):
        e = self._embed(x)
        return self._convolve(e, input_mask=input_mask)

    def _embed(self, x):
        e = self.embedder(x)
        e = self.up_embedder(e)
        return e

    def _convolve(self, e, input_mask=None):
        for layer in self.layers:
            e = layer(e, input_mask=input_mask)
            if self.dropout > 0.0:
                e = F.dropout(e, self.dropout)
        return e


class ConditionedByteNetDecoder(ByteNet):

    def __init__(self, n_tokens, d_embedding, d_conditioning, d_model, n_layers, kernel_size, r):
        super().__init__(n_tokens, d_embedding, d_model, n_layers, kernel_size, r,
                         ells=None, padding_idx=None, causal=True)
        self.up_embedder = PositionFeedForward(d_embedding, d_model - d_conditioning)

    def _embed(self, inputs):
        x, c = inputs
        e = self.embedder(x)
        e = self.up_embedder(e)  # (n, ell, d_model - d_conditioning)
        # Concatenate the conditioning
        _, ell = x.shape
        c = c.unsqueeze(1)
        c_ = torch.repeat_interleave(c, ell, dim=1)  # (n, ell, d_conditioning)
        e = torch.cat([e, c_], dim=2)  # (n, ell, d_model)
        return e


class ByteNetBlock2d(nn.Module):

    def __init__(self, d_in, d_h, d_out, kernel_size, dilation=1, groups=1):
        super().__init__()
        self.conv = MaskedConv2d(d_h, d_h, kernel_size=kernel_size, dilation=dilation, groups=groups)
        layers1 = [
            nn.LayerNorm(d_in),
            nn.ReLU(),
            PositionFeedForward2d(d_in, d_h),
            nn.LayerNorm(d_h),
            nn.ReLU()
        ]
        layers2 = [
            nn.LayerNorm(d_h),
            nn.ReLU(),
            PositionFeedForward2d(d_h, d_out),
        ]
        self.sequence1 = nn.Sequential(*layers1)
        self.sequence2 = nn.Sequential(*layers2)

    def forward(self, x, input_mask=None):
        return x + self.sequence2(
            self.conv(self.sequence1(x), input_mask=input_mask)
        )


class ByteNet2d(nn.Module):

    def __init__(self, d_in, d_model, n_layers, kernel_size, r, dropout=0.0):
        super().__init__()
        self.up_embedder = PositionFeedForward2d(d_in, d_model)
        log2 = int(np.log2(r)) + 1
        dilations = [2 ** (n % log2) for n in range(n_layers)]
        layers = [
            ByteNetBlock2d(d_model, d_model // 2, d_model, kernel_size, dilation=d)
            for d in dilations
        ]
        self.layers = nn.ModuleList(modules=layers)
        self.dropout = dropout

    def forward(self, x, input_mask=None):
        e = self._embed(x)
        return self._convolve(e, input_mask=input_mask)

    def _embed(self, x):
        e = self.up_embedder(x)
        return e

    def _convolve(self, e, input_mask=None):
        for layer in self.layers:
            e = layer(e, input_mask=input_mask)
            if self.dropout > 0.0:
                e = F.dropout(e, self.dropout)
        return e


# sequence_models/structure.py
class Attention2d(nn.Module):

    def __init__(self, in_dim):
        super().__init__()
        self.layer = MaskedConv2d(in_dim, 1, 1)

    def forward(self, x, input_mask=None):
        n, ell, _, _ = x.shape
        attn = self.layer(x)
        attn = attn.view(n, -1)
        if input_mask is not None:
            if FIXED:
                attn = attn.masked_fill_(~input_mask.view(n, -1).bool(), float('-inf'))
            else:
                attn = attn.masked_fill_(input_mask.view(n, -1).bool(), float('-inf'))
        attn = F.softmax(attn, dim=-1).view(n, -1, 1)
        out = (attn * x.view(n, ell * ell, -1)).mean(dim=1)
        return out


class StructureConditioner(nn.Module):

    def __init__(self, d_in, d_model, n_layers, kernel_size, r, dropout=0.0):
        super().__init__()
        self.embedder = ByteNet2d(d_in, d_model, n_layers, kernel_size, r, dropout=dropout)
        self.attention = Attention2d(d_model)

    def forward(self, x, input_mask=None):
        return self.attention(self.embedder(x, input_mask=input_mask.unsqueeze(-1)), input_mask=input_mask)


class StructureConditionedBytenet(nn.Module):

    def __init__(self, n_tokens, d_embedding, d_conditioning, d_model, n_layers, k_b, r_b,
                 d_structure, n_c_layers, k_c, r_c):
        super().__init__()
        self.conditioner = StructureConditioner(d_structure, d_conditioning, n_c_layers, k_c, r_c)
        self.bytenet = ConditionedByteNetDecoder(n_tokens, d_embedding, d_conditioning, d_model, n_layers, k_b, r_b)
        self.decoder = PositionFeedForward(d_model, n_tokens)

    def forward(self, src, struc, src_mask, str_mask):
        c = self.conditioner(struc, input_mask=str_mask)
        out = self.bytenet((src, c), input_mask=src_mask)
        out = self.decoder(out)
        return out


# sequence_models/data.py StructureImageCollater (after e4c724f): structure (n, L, L, 4) of dist/omega/theta/phi,
# structure_mask (n, L, L) = 1 inside each protein's L x L block.
AAS = "ACDEFGHIKLMNPQRSTVWY"
PAD_IDX = len(AAS)


def collate(sequences, structures):
    ells = [len(s) for s in sequences]
    max_ell = max(ells)
    n = len(sequences)
    src = torch.full((n, max_ell), PAD_IDX, dtype=torch.long)
    src_mask = torch.zeros(n, max_ell, 1)
    structure = torch.zeros(n, max_ell, max_ell, 4)
    structure_mask = torch.zeros(n, max_ell, max_ell)
    for i, (seq, st, ell) in enumerate(zip(sequences, structures, ells)):
        src[i, :ell] = torch.tensor([AAS.index(a) for a in seq])
        src_mask[i, :ell] = 1.0
        structure[i, :ell, :ell, :] = st
        structure_mask[i, :ell, :ell] = 1.0
    structure[torch.isnan(structure)] = 0.0
    return src, src_mask, structure, structure_mask


def main():
    torch.manual_seed(0)
    model = StructureConditionedBytenet(
        n_tokens=len(AAS) + 1, d_embedding=8, d_conditioning=8, d_model=32, n_layers=2, k_b=3, r_b=2,
        d_structure=4, n_c_layers=2, k_c=3, r_c=2,
    ).eval()

    sequences = ["MKTAYIA", "GSHM"]
    structures = [torch.randn(len(s), len(s), 4) for s in sequences]
    src, src_mask, structure, structure_mask = collate(sequences, structures)

    with torch.no_grad():
        c = model.conditioner(structure, input_mask=structure_mask)
        logits = model(src, structure, src_mask, structure_mask)
    print("structure conditioning, protein 0:", [round(v, 4) for v in c[0, :4].tolist()])
    print("structure conditioning, protein 1:", [round(v, 4) for v in c[1, :4].tolist()])
    for i, seq in enumerate(sequences):
        loss = F.cross_entropy(logits[i, : len(seq) - 1], src[i, 1: len(seq)])
        print(f"protein {i} next-residue loss:", round(loss.item(), 6))


if __name__ == "__main__":
    main()
