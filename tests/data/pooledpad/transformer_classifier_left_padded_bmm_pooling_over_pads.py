# The ProkBERT pooling bug (nbrg-ppcu/prokbert PR #109) written another way: a plain-PyTorch transformer text
# classifier over a LEFT-padded batch, its key padding handed to the encoder as `padding_mask` (True = pad), and an
# attention-pooling head that scores each position, softmaxes the (B, L) scores over the positions and pools with
# torch.bmm(alpha.unsqueeze(1), h). The buggy head never masks the scores, so the pads take weight; the fix fills the
# scores at the pads with -inf before the softmax.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


class AttentionPooling(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.score = nn.Linear(d_model, 1, bias=False)

    def forward(self, h: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        scores = self.score(h).squeeze(-1)  # (B, L)
        if FIXED:
            scores = scores.masked_fill(padding_mask, float("-inf"))
        alpha = torch.softmax(scores, dim=-1)
        return torch.bmm(alpha.unsqueeze(1), h).squeeze(1)  # (B, D)


class TextClassifier(nn.Module):
    def __init__(self, vocab: int = 100, d_model: int = 32, n_classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.pool = AttentionPooling(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens), src_key_padding_mask=padding_mask)
        return self.head(self.pool(h, padding_mask))


def left_pad(seqs):
    width = max(len(s) for s in seqs)
    return torch.tensor([[PAD] * (width - len(s)) + s for s in seqs])


model = TextClassifier().eval()
sentences = [torch.randint(1, 100, (n,)).tolist() for n in (12, 7, 9)]
tokens = left_pad(sentences)
padding_mask = tokens == PAD

with torch.no_grad():
    batched = model(tokens, padding_mask)
    short = torch.tensor([sentences[1]])
    alone = model(short, short == PAD)

print(f"fixed={FIXED} max |logits(row 1, batch) - logits(alone)| = {(batched[1] - alone[0]).abs().max().item():.6f}")
