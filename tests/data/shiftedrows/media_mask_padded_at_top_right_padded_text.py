"""An interleaved image-text model (Flamingo style, written by hand): each text token attends the latents of the
image whose <image> token it follows, by a per-sample media mask (text_len, images * latents). The collate pads the
ids on the right but the buggy one pads each media mask at the top (as a left-padding collate would), so a short
sample's rows slide down onto its padding and its own tokens read the rows of the tokens before them; the fix pads
the mask at the bottom, as the ids. Attention by einsum and a softmax, rows that see no image zeroed after it.
Written another way than torchtune#1601 (right-padded text, the mask padded at the top; a hand-written softmax)."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD_ID, IMAGE_ID, VOCAB, DIM, LATENTS, MAX_IMAGES = 0, 1, 40, 16, 4, 2


def media_mask(ids):
    """Row i sees the latents of the last image whose <image> token is at or before token i."""
    mask = torch.zeros(len(ids), MAX_IMAGES * LATENTS, dtype=torch.bool)
    image = -1
    for i, token in enumerate(ids):
        image += token == IMAGE_ID
        if image >= 0:
            mask[i, image * LATENTS:(image + 1) * LATENTS] = True
    return mask


def collate(samples):
    length = max(len(ids) for ids in samples)
    ids, masks = [], []
    for sample in samples:
        pad = length - len(sample)
        ids.append(sample + [PAD_ID] * pad)
        mask = media_mask(sample)
        masks.append(F.pad(mask, (0, 0, 0, pad)) if FIXED else F.pad(mask, (0, 0, pad, 0)))
    return torch.tensor(ids), torch.stack(masks)


class GatedCrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q, self.to_kv, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(DIM, DIM)
        self.gate = nn.Parameter(torch.tensor(0.5))

    def forward(self, x, media, media_mask):
        q = self.to_q(x)
        k, v = self.to_kv(media).chunk(2, dim=-1)
        scores = torch.einsum("bid,bjd->bij", q, k) / DIM ** 0.5
        scores = scores.masked_fill(~media_mask, torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1)
        out = torch.einsum("bij,bjd->bid", weights, v)
        out = out * media_mask.any(dim=-1, keepdim=True)  # (a token before any image reads nothing)
        return x + torch.tanh(self.gate) * self.out(out)


class InterleavedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD_ID)
        self.latents = nn.Linear(12, MAX_IMAGES * LATENTS * DIM)
        self.xattn = GatedCrossAttention()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, pixels, media_mask):
        media = self.latents(pixels).view(input_ids.shape[0], MAX_IMAGES * LATENTS, DIM)
        return self.head(self.xattn(self.embed(input_ids), media, media_mask))


def main():
    model = InterleavedLM()
    samples = [[IMAGE_ID, 5, 6, 7, 8, IMAGE_ID, 9, 10], [3, IMAGE_ID, 4]]
    ids, masks = collate(samples)
    logits = model(ids, torch.randn(len(samples), 12), masks)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), ignore_index=PAD_ID)
    print(f"fixed={FIXED} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
