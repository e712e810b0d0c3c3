"""docTR MASTER (PyTorch): the decoder's target mask blocks only future real characters, not padding.

Citation: mindee/doctr PR #546, commit d82a4bc9 ("fix: tgt_mask computation in master model (PyTorch
backend)"), doctr/models/recognition/master/pytorch.py, `MASTER.make_mask`. Read from the repository
history (parent and fix).

Bug: `make_mask` built `target_padding_mask = ~torch.eq(target, pad)` (True on real symbols) and
`combined_mask = target_padding_mask & look_ahead_mask`, then passed it as `tgt_mask` to
`nn.TransformerDecoderLayer`, where True means "do not attend". So only future *real* symbols were
masked: every query of the teacher-forced target attended to the trailing `<pad>` symbols after the
word (future positions included).
Fix: `target_padding_mask = torch.eq(target, pad)` and `combined_mask = target_padding_mask |
look_ahead_mask` (mask padding or future).

This program keeps the pre-fix MASTER head: `compute_target` / `encode_sequences` (EOS = len(vocab),
SOS = len(vocab)+1, PAD = len(vocab)+2, `max_length`), `make_mask` tiled over `num_heads`, and doctr's
transformer `Decoder` (stacked `nn.TransformerDecoderLayer(batch_first=True)`) over the flattened image
features. The MAGC-ResNet backbone is replaced by a two-conv stack to stay small. The training forward
is run on two 5-letter words with `max_length=10` (so 3 pads each). `--fixed` applies the fix's two lines.
The `torch.tile` head layout is left as upstream had it (both words have the same padding here).
"""
import math
import sys
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv


def encode_sequences(sequences, vocab, target_size, eos, sos, pad):
    encoded = np.full((len(sequences), target_size), pad, dtype=np.int32)
    for idx, seq in enumerate(sequences):
        encoded_seq = [vocab.index(char) for char in seq] + [eos]
        encoded_seq = [sos] + encoded_seq
        encoded[idx, :min(len(encoded_seq), target_size)] = encoded_seq[:target_size]
    return encoded


def positional_encoding(position: int, d_model: int = 512, dtype=torch.float32) -> torch.Tensor:
    pe = torch.zeros(position, d_model)
    pos = torch.arange(0, position, dtype=dtype).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=dtype) * (-math.log(10000.0) / d_model))
    pe[:, 0::2] = torch.sin(pos * div_term)
    pe[:, 1::2] = torch.cos(pos * div_term)
    return pe.unsqueeze(0)


class Decoder(nn.Module):

    def __init__(self, num_layers=3, d_model=512, num_heads=8, dff=2048, vocab_size=120,
                 maximum_position_encoding=50, dropout=0.2):
        super().__init__()
        self.d_model = d_model
        self.num_layers = num_layers
        self.embedding = nn.Embedding(vocab_size + 3, d_model)  # 3 more classes EOS/SOS/PAD
        self.register_buffer('pos_encoding', positional_encoding(maximum_position_encoding, d_model))
        self.dec_layers = nn.ModuleList([
            nn.TransformerDecoderLayer(d_model=d_model, nhead=num_heads, dim_feedforward=dff,
                                       dropout=dropout, activation='relu', batch_first=True)
            for _ in range(num_layers)
        ])
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, enc_output, look_ahead_mask, padding_mask: Optional[torch.Tensor] = None):
        seq_len = x.shape[1]  # Batch first = True
        x = self.embedding(x)  # (batch_size, target_seq_len, d_model)
        x *= math.sqrt(self.d_model)
        x += self.pos_encoding[:, :seq_len, :]
        x = self.dropout(x)
        for i in range(self.num_layers):
            x = self.dec_layers[i](tgt=x, memory=enc_output, tgt_mask=look_ahead_mask,
                                   memory_mask=padding_mask)
        return x


class MASTER(nn.Module):

    def __init__(self, vocab: str, d_model: int = 32, num_heads: int = 2, dff: int = 64,
                 num_layers: int = 2, max_length: int = 10, dropout: float = 0.0,
                 input_shape=(3, 8, 16)) -> None:
        super().__init__()
        self.max_length = max_length
        self.vocab = vocab
        self.vocab_size = len(vocab)
        self.num_heads = num_heads
        # stands in for MAGCResnet(headers=headers)
        self.feat_extractor = nn.Sequential(nn.Conv2d(3, d_model, 3, padding=1), nn.ReLU(),
                                            nn.MaxPool2d(2), nn.Conv2d(d_model, d_model, 3, padding=1))
        self.decoder = Decoder(num_layers=num_layers, d_model=d_model, num_heads=num_heads, dff=dff,
                               vocab_size=self.vocab_size, maximum_position_encoding=max_length,
                               dropout=dropout)
        self.register_buffer('feature_pe', positional_encoding(input_shape[1] * input_shape[2], d_model))
        self.linear = nn.Linear(d_model, self.vocab_size + 3)

    def compute_target(self, gts: List[str]):
        encoded = encode_sequences(sequences=gts, vocab=self.vocab, target_size=self.max_length,
                                   eos=len(self.vocab), sos=len(self.vocab) + 1, pad=len(self.vocab) + 2)
        seq_len = [len(word) for word in gts]
        return encoded, seq_len

    def make_mask(self, target: torch.Tensor) -> torch.Tensor:
        size = target.size(1)
        look_ahead_mask = ~ (torch.triu(torch.ones(size, size, device=target.device)) == 1).transpose(0, 1)[:, None]
        if FIXED:
            target_padding_mask = torch.eq(target, self.vocab_size + 2)  # Pad symbol
            combined_mask = target_padding_mask | look_ahead_mask
        else:
            target_padding_mask = ~ torch.eq(target, self.vocab_size + 2)  # Pad symbol
            combined_mask = target_padding_mask & look_ahead_mask
        return torch.tile(combined_mask.permute(1, 0, 2), (self.num_heads, 1, 1))

    def forward(self, x: torch.Tensor, target: Optional[List[str]] = None) -> Dict[str, Any]:
        feature = self.feat_extractor(x)
        b, c, h, w = (feature.size(i) for i in range(4))
        feature = torch.reshape(feature, shape=(b, c, h * w))
        feature = feature.permute(0, 2, 1)  # shape (b, h*w, c)
        encoded = feature + self.feature_pe[:, :h * w, :]
        _gt, _seq_len = self.compute_target(target)
        gt = torch.from_numpy(_gt).to(dtype=torch.long)
        tgt_mask = self.make_mask(gt)
        output = self.decoder(gt, encoded, tgt_mask, None)
        logits = self.linear(output)
        return {'out_map': logits}


def main():
    torch.manual_seed(0)
    model = MASTER(vocab="abcdefghijklmnopqrstuvwxyz").train()
    images = torch.rand(2, 3, 8, 16)
    out = model(images, target=["hello", "world"])
    logits = out['out_map']
    print("fixed" if FIXED else "buggy", tuple(logits.shape), round(float(logits[0, :6].detach().abs().sum()), 3))


if __name__ == "__main__":
    main()
