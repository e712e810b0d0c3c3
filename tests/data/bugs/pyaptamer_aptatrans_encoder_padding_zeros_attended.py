# gc-os-ai/pyaptamer#178 (fixes #177): AptaTrans' aptamer/protein encoders ran nn.TransformerEncoder
# without any mask, so residues/nucleotides attended to the zero-padding (token 0) of shorter sequences.
import math
import sys
from collections import OrderedDict

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=64):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1).float()
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class AptaTrans(nn.Module):
    def __init__(self, n_apta=8, n_prot=24, in_dim=32, n_encoder_layers=2, n_heads=4, max_len=64):
        super().__init__()
        self.encoder_apta = self._make_encoder(n_apta, in_dim, n_encoder_layers, n_heads, max_len)
        self.encoder_prot = self._make_encoder(n_prot, in_dim, n_encoder_layers, n_heads, max_len)
        self.fc = nn.Linear(1, 1)

    def _make_encoder(self, num_embeddings, in_dim, n_encoder_layers, n_heads, max_len):
        embedding = nn.Embedding(num_embeddings=num_embeddings, embedding_dim=in_dim, padding_idx=0)
        pos_encoding = PositionalEncoding(d_model=in_dim, max_len=max_len)
        encoder = nn.TransformerEncoder(
            encoder_layer=nn.TransformerEncoderLayer(
                d_model=in_dim, nhead=n_heads, dim_feedforward=in_dim * 2, dropout=0.0, batch_first=True
            ),
            num_layers=n_encoder_layers,
            norm=nn.LayerNorm(in_dim),
            enable_nested_tensor=False,
        )
        return nn.ModuleDict(
            OrderedDict([("embedding", embedding), ("pos_encoding", pos_encoding), ("encoder", encoder)])
        )

    def _encode(self, enc, x):
        h = enc["pos_encoding"](enc["embedding"](x))
        if FIXED:
            # after the fix: padded positions (token 0) are masked out of the keys
            mask = x == 0
            return enc["encoder"](h, src_key_padding_mask=mask)
        return enc["encoder"](h)

    def forward_imap(self, x_apta, x_prot):
        out_apta = self._encode(self.encoder_apta, x_apta)
        out_prot = self._encode(self.encoder_prot, x_prot)
        # interaction map: (batch, 1, len_apta, len_prot)
        return torch.einsum("bid,bjd->bij", out_apta, out_prot).unsqueeze(1)

    def forward(self, x_apta, x_prot):
        imap = self.forward_imap(x_apta, x_prot)
        return torch.sigmoid(self.fc(imap.mean(dim=(2, 3), keepdim=False).view(-1, 1)))


def pad(seqs, length):
    out = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


model = AptaTrans().eval()
apta = [torch.randint(1, 8, (12,)), torch.randint(1, 8, (7,))]
prot = [torch.randint(1, 24, (20,)), torch.randint(1, 24, (11,))]
x_apta, x_prot = pad(apta, 12), pad(prot, 20)

with torch.no_grad():
    imap = model.forward_imap(x_apta, x_prot)
    # reference: the short pair encoded alone, without any padding
    ref = model.forward_imap(apta[1][None], prot[1][None])
    diff = (imap[1, :, :7, :11] - ref[0]).abs().max().item()
    print("pred:", model(x_apta, x_prot).flatten().tolist())
print(f"fixed={FIXED} max |imap(padded batch) - imap(alone)| for the short pair = {diff:.4e}")
