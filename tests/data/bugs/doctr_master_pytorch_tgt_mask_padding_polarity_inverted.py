# doctr (mindee/doctr), MASTER recognition model, PyTorch port of the TF model: mindee/doctr#546 (commit d82a4bc).
# The TF make_mask is tf.maximum(padding_mask, look_ahead_mask) with 1 = masked; the torch port negated the padding
# mask and used `&`, so a boolean tgt_mask (True = blocked) only blocks future *real* tokens: PAD keys stay visible.
import math
import sys
from typing import Optional

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def positional_encoding(position: int, d_model: int = 512, dtype=torch.float32) -> torch.Tensor:
    pe = torch.zeros(position, d_model)
    pos = torch.arange(0, position, dtype=dtype).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=dtype) * (-math.log(10000.0) / d_model))
    pe[:, 0::2] = torch.sin(pos * div_term)
    pe[:, 1::2] = torch.cos(pos * div_term)
    return pe.unsqueeze(0)


class Decoder(nn.Module):
    """doctr/models/recognition/transformer/pytorch.py"""

    def __init__(self, num_layers=3, d_model=512, num_heads=8, dff=2048, vocab_size=120,
                 maximum_position_encoding=50, dropout=0.2) -> None:
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
        seq_len = x.shape[1]
        x = self.embedding(x)
        x *= math.sqrt(self.d_model)
        x += self.pos_encoding[:, :seq_len, :]
        x = self.dropout(x)
        for i in range(self.num_layers):
            x = self.dec_layers[i](tgt=x, memory=enc_output, tgt_mask=look_ahead_mask, memory_mask=padding_mask)
        return x


class MASTER(nn.Module):
    """doctr/models/recognition/master/pytorch.py, the feature extractor replaced by random features."""

    def __init__(self, vocab, d_model=32, dff=64, num_heads=4, num_layers=2, max_length=12, dropout=0.0,
                 feat_hw=20):
        super().__init__()
        self.max_length = max_length
        self.vocab = vocab
        self.vocab_size = len(vocab)
        self.num_heads = num_heads
        self.decoder = Decoder(num_layers=num_layers, d_model=d_model, num_heads=num_heads, dff=dff,
                               vocab_size=self.vocab_size, maximum_position_encoding=max_length, dropout=dropout)
        self.register_buffer('feature_pe', positional_encoding(feat_hw, d_model))
        self.linear = nn.Linear(d_model, self.vocab_size + 3)

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

    def compute_target(self, words):
        """_MASTER.compute_target: SOS + chars + EOS, then PAD up to max_length."""
        eos, sos, pad = self.vocab_size, self.vocab_size + 1, self.vocab_size + 2
        gts = [[sos] + [self.vocab.index(c) for c in w] + [eos] for w in words]
        gt = torch.full((len(words), self.max_length), pad, dtype=torch.long)
        for b, g in enumerate(gts):
            gt[b, :len(g)] = torch.tensor(g)
        return gt, torch.tensor([len(w) for w in words])

    def forward_train(self, feature, target):
        b, hw, _ = feature.shape
        encoded = feature + self.feature_pe[:, :hw, :]
        gt, seq_len = self.compute_target(target)
        tgt_mask = self.make_mask(gt)
        output = self.decoder(gt, encoded, tgt_mask, None)
        return self.linear(output), seq_len


vocab = "abcdefghij"
model = MASTER(vocab).eval()
# Words of equal length: every batch element has the same PAD pattern, so the separate batch/head ordering
# of torch.tile (mindee/doctr#941, fixed later) does not enter this comparison.
words = ["abc", "hij", "def"]
feature = torch.randn(len(words), 20, 32)  # (b, h*w, c) from the MAGC ResNet

with torch.no_grad():
    logits, seq_len = model.forward_train(feature, words)
    # Reference: the same words with no PAD tokens at all (each word alone, target of its own length).
    worst = 0.0
    for b, w in enumerate(words):
        model.max_length = len(w) + 2
        ref, _ = model.forward_train(feature[b:b + 1], [w])
        model.max_length = 12
        n = len(w) + 2  # SOS + chars + EOS
        worst = max(worst, (logits[b, :n] - ref[0, :n]).abs().max().item())
print(f"max |logits with PAD-padded targets - unpadded targets| over real positions: {worst:.6f}")
