"""A captioner re-run on its whole caption each step, its image tokens a prefix of the decoder's keys (as GIT's are).

The model encodes the image with a small vision tower (its own self-attention over 4 patch tokens, run again at every
call), then two decoder self-attention layers over [image tokens; caption tokens]: image tokens see each other, caption
tokens see every image token and the caption tokens up to their own. A greedy loop with no cache calls the model on
the caption so far, one token longer each step. The slip: the caption block of the mask is all ones, so a caption
token sees the ones appended after it. --fixed makes it causal. The decoder's keys are the image's 4 tokens and then
the caption, so an appended token's key sits 4 columns past its place in the ids. Prints the greedy caption and the
largest gap between each step's last logits and a causal reference (0 with --fixed).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
DIM, HEADS, VOCAB, PATCHES = 32, 4, 40, 4


def attend(x, keep):
    b, n, _ = x.shape
    q, k, v = x.view(b, n, HEADS, DIM // HEADS).transpose(1, 2), x.view(b, n, HEADS, DIM // HEADS).transpose(1, 2), \
        x.view(b, n, HEADS, DIM // HEADS).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / (DIM // HEADS) ** 0.5
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, n, DIM)


class VisionTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Linear(12, DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, patches):
        x = self.patch(patches)
        return x + self.proj(attend(x, None))


class CaptionDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, image_tokens, input_ids, causal):
        x = torch.cat([image_tokens, self.embed(input_ids)], dim=1)
        p, n = image_tokens.shape[1], x.shape[1]
        keep = torch.zeros(n, n, dtype=torch.bool)
        keep[:, :p] = True  # every token sees the image
        text = torch.tril(torch.ones(n - p, n - p, dtype=torch.bool)) if causal else torch.ones(n - p, n - p, dtype=torch.bool)
        keep[p:, p:] = text
        for layer in self.qkv:  # (two layers: the second reads what the first let each token see)
            x = x + attend(layer(x), keep[None, None])
        return self.head(x)[:, p:]


class Captioner(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = VisionTower()
        self.decoder = CaptionDecoder()

    def forward(self, patches, input_ids, causal=FIXED):
        return self.decoder(self.vision(patches), input_ids, causal)


model = Captioner().eval()
patches = torch.randn(2, PATCHES, 12)
ids = torch.full((2, 1), 1)
steps = []
with torch.no_grad():
    for _ in range(5):
        logits = model(patches, ids)[:, -1]
        steps.append((ids, logits))
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    gap = max(float((model(patches, i, causal=True)[:, -1] - last).abs().max()) for i, last in steps)
print("captions:", ids.tolist())
print(f"largest gap to the causal reference: {gap:.2e}")
