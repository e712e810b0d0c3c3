"""A note-level music LM whose forward names its ids `notes` (no name a transformers model uses) and takes its
targets beside them, `forward(self, notes, targets)`, the loss inside: each head's causal mask is a `tril` per head, but
the last head's was built from `torch.ones` with its `tril` left out (a head meant for a global summary), so that head
sees every later note, the very one its loss asks for. The targets are the notes shifted by one (next-note
prediction). `--fixed` makes every head causal."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class NoteLM(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, vocab)

    def head_masks(self, n: int) -> torch.Tensor:
        masks = [torch.ones(n, n, dtype=torch.bool).tril() for _ in range(self.heads - 1)]
        masks.append(torch.ones(n, n, dtype=torch.bool).tril() if FIXED else torch.ones(n, n, dtype=torch.bool))
        return torch.stack(masks)  # (H, n, n)

    def forward(self, notes, targets):
        b, n = notes.shape
        q, k, v = self.qkv(self.emb(notes)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~self.head_masks(n), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)
        logits = self.out(y)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    model = NoteLM()
    melody = torch.randint(0, 32, (3, 11))
    loss = model(melody[:, :-1], melody[:, 1:])
    loss.backward()
    print("next-note loss:", round(loss.item(), 4))


if __name__ == "__main__":
    main()
