# A bidirectional text encoder (a sentence-embedding model, ModernBERT-style eager attention) trained on packed rows:
# its collator builds the per-document mask with a causal tril copied from a decoder's collator, so inside each packed
# sentence a token no longer sees the tokens after it. The same encoder run on each sentence alone (no mask: every
# token sees every token) is the program's own reference. Fixed: the document mask is same-document only.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


def packed_document_mask(position_ids, attention_mask):
    """(B, 1, L, L) bool keep mask: same document (position_ids restarting at 0), real tokens; pads see themselves."""
    starts = (position_ids == 0) & (attention_mask == 1)
    doc = torch.cumsum(starts.long(), dim=1)
    same = doc[:, :, None] == doc[:, None, :]
    real = attention_mask.bool()
    keep = same & real[:, :, None] & real[:, None, :]
    if not FIXED:
        L = position_ids.shape[1]
        keep = keep & torch.tril(torch.ones(L, L, dtype=torch.bool))
    keep = keep | torch.eye(position_ids.shape[1], dtype=torch.bool)[None]
    return keep[:, None]


class EncoderLayer(nn.Module):
    def __init__(self, dim=24, heads=3):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.Wqkv = nn.Linear(dim, 3 * dim)
        self.Wo = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, keep=None):
        B, L, D = x.shape
        q, k, v = self.Wqkv(self.norm(x)).view(B, L, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = scores.softmax(dim=-1)
        return x + self.Wo((probs @ v).transpose(1, 2).reshape(B, L, D))


class SentenceEncoder(nn.Module):
    def __init__(self, vocab=40, dim=24, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(32, dim)
        self.layers = nn.ModuleList([EncoderLayer(dim) for _ in range(layers)])

    def forward(self, input_ids, position_ids, attention_mask=None):
        x = self.tok(input_ids) + self.pos(position_ids)
        keep = None
        if attention_mask is not None and (position_ids[:, 1:] == 0).any():
            keep = packed_document_mask(position_ids, attention_mask)
        for layer in self.layers:
            x = layer(x, keep)
        return x


sentences = [torch.randint(1, 40, (n,)) for n in (4, 3, 5, 2)]
rows = [[0, 1], [2, 3]]
L = 8
input_ids = torch.full((2, L), PAD)
position_ids = torch.zeros(2, L, dtype=torch.long)
attention_mask = torch.zeros(2, L, dtype=torch.long)
for b, row in enumerate(rows):
    at = 0
    for i in row:
        n = len(sentences[i])
        input_ids[b, at:at + n] = sentences[i]
        position_ids[b, at:at + n] = torch.arange(n)
        attention_mask[b, at:at + n] = 1
        at += n

model = SentenceEncoder().eval()
with torch.no_grad():
    packed = model(input_ids, position_ids, attention_mask)
    diff = 0.0
    for b, row in enumerate(rows):
        at = 0
        for i in row:
            n = len(sentences[i])
            alone = model(sentences[i][None], torch.arange(n)[None])
            diff = max(diff, (packed[b, at:at + n] - alone[0]).abs().max().item())
            at += n
print(f"fixed={FIXED} packed vs each sentence alone, max |diff| = {diff:.4f}")
