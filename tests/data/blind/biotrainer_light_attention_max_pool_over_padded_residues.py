# sacdallago/biotrainer#102 ("Improving masking mechanisms in CNN and LightAttention models", closes #100),
# commit cec78eb ("Improving masking in LightAttention model").
# LightAttention (protein embeddings -> per-protein class, e.g. subcellular localization) derives its padding
# mask from the zero-padded per-residue embeddings and fills the attention logits at padded residues with -1e9,
# but the feature branch `o` is left unmasked: the convolution's bias and its kernel's reach over the last real
# residues make padded positions non-zero, and the max pool `torch.max(o, dim=-1)` reads them, so a protein's
# prediction depends on how long the other proteins in its batch are.
# The fix multiplies `o` by the mask before pooling (and uses -inf instead of -1e9 for the attention logits).
# Ported (trimmed) from biotrainer/models/light_attention.py, biotrainer/datasets/collate_functions.py
# (pad_residues_embeddings) and biotrainer/utilities/constants.py at cec78eb^ / cec78eb.
import sys
from typing import List, Tuple

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv

# ---- biotrainer/utilities/constants.py ----
SEQUENCE_PAD_VALUE = 0


# ---- biotrainer/datasets/collate_functions.py (trimmed) ----
def pad_residues_embeddings(
        batch: List[Tuple[str, torch.Tensor, torch.Tensor]], batch_first=True
):
    if not batch:
        return [], torch.tensor([]), torch.tensor([]), torch.LongTensor([])
    try:
        sorted_batch = sorted(batch, key=lambda x: x[1].shape[1], reverse=True)
    except IndexError:
        sorted_batch = batch
    seq_ids = [x[0] for x in sorted_batch]
    sequences = [x[1] for x in sorted_batch]
    sequences = [s if s.dim() > 1 else s.unsqueeze(0) for s in sequences]
    padded_sequences = pad_sequence(sequences, batch_first=batch_first, padding_value=SEQUENCE_PAD_VALUE)
    lengths = torch.LongTensor([len(x) for x in sequences])
    labels = torch.stack([x[2] for x in sorted_batch])
    return seq_ids, padded_sequences, labels, lengths


# ---- biotrainer/models/light_attention.py ----
# LightAttention model originally from Hannes Stark:
# https://github.com/HannesStark/protein-localization/blob/master/models/light_attention.py
class LightAttention(nn.Module):
    def __init__(self, n_features: int, n_classes: int, dropout_rate=0.25, kernel_size=9, conv_dropout: float = 0.25,
                 **kwargs):
        super(LightAttention, self).__init__()

        self.feature_convolution = nn.Conv1d(n_features, n_features, kernel_size, stride=1,
                                             padding=kernel_size // 2)
        self.attention_convolution = nn.Conv1d(n_features, n_features, kernel_size, stride=1,
                                               padding=kernel_size // 2)

        self.softmax = nn.Softmax(dim=-1)

        self.dropout = nn.Dropout(conv_dropout)

        self.linear = nn.Sequential(
            nn.Linear(2 * n_features, 32),
            nn.Dropout(dropout_rate),
            nn.ReLU(),
            nn.LayerNorm(32)
        )

        self.output = nn.Linear(32, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Calculate mask (== where all residues are 0)
        mask = x.sum(dim=-1) != SEQUENCE_PAD_VALUE

        x = x.permute(0, 2, 1)
        o = self.feature_convolution(x)  # [batch_size, embeddings_dim, sequence_length]
        o = self.dropout(o)  # [batch_size, embeddings_dim, sequence_length]
        if FIXED:
            o = o * mask.unsqueeze(1)

        attention = self.attention_convolution(x)  # [batch_size, embeddings_dim, sequence_length]

        # mask out the padding to which we do not want to pay any attention
        if FIXED:
            attention = attention.masked_fill(mask[:, None, :] == False, -float('inf'))
        else:
            attention = attention.masked_fill(mask[:, None, :] == False, -1e9)

        o1 = torch.sum(o * self.softmax(attention), dim=-1)  # [batchsize, embeddings_dim]
        o2, _ = torch.max(o, dim=-1)  # [batchsize, embeddings_dim]
        o = torch.cat([o1, o2], dim=-1)  # [batchsize, 2*embeddings_dim]
        o = self.linear(o)  # [batchsize, 32]
        return self.output(o)  # [batchsize, output_dim]


def main():
    torch.manual_seed(0)
    n_features, n_classes = 16, 10  # per-residue embedding size (ProtT5 would be 1024), localization classes
    model = LightAttention(n_features=n_features, n_classes=n_classes, kernel_size=9)
    model.eval()

    # per-residue embeddings of three proteins of different lengths, as the embedding service stores them
    lengths = [23, 11, 6]
    batch = [(f"P{i}", torch.randn(L, n_features), torch.tensor(i % n_classes)) for i, L in enumerate(lengths)]
    seq_ids, padded, labels, lens = pad_residues_embeddings(batch)

    with torch.no_grad():
        logits = model(padded)
    preds = logits.argmax(-1)
    for sid, L, row, p in zip(seq_ids, lens.tolist(), logits, preds.tolist()):
        print(sid, "len", L, "pred", p, "logits", [round(v, 4) for v in row.tolist()])


if __name__ == "__main__":
    main()
