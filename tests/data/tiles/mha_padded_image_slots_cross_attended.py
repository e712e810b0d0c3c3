"""A captioner whose text cross-attends the tokens of up to three images per sample through nn.MultiheadAttention:
the collate pads the image slots of a sample with fewer images with all-zero images, and the buggy model hands no
key_padding_mask, so the text attends the padded slots' tokens; the fix masks them (True = padding, as torch takes it).
The text is right-padded with PAD_ID. Written another way than torchtune#1836 (image slots, not tiles; MHA, not SDPA)."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD_ID, VOCAB, DIM, HEADS, MAX_IMAGES, SIDE, PATCH = 0, 50, 32, 4, 3, 8, 4


def collate(samples):
    length = max(len(s["ids"]) for s in samples)
    ids = torch.tensor([s["ids"] + [PAD_ID] * (length - len(s["ids"])) for s in samples])
    images = torch.zeros(len(samples), MAX_IMAGES, 3, SIDE, SIDE)
    counts = torch.tensor([len(s["images"]) for s in samples])
    for b, s in enumerate(samples):
        for i, image in enumerate(s["images"]):
            images[b, i] = (image - 0.5) / 0.25  # normalised: never exactly 0 over a whole image
    return ids, images, counts


class Captioner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD_ID)
        self.patches = nn.Conv2d(3, DIM, kernel_size=PATCH, stride=PATCH)
        self.xattn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, images, image_counts):
        b = ids.shape[0]
        tokens = self.patches(images.flatten(0, 1)).flatten(2).transpose(1, 2)  # (B * slots, 4, DIM)
        memory = tokens.reshape(b, -1, DIM)  # (B, slots * 4, DIM)
        padding = None
        if FIXED:
            per = memory.shape[1] // MAX_IMAGES
            padding = (torch.arange(MAX_IMAGES)[None, :] >= image_counts[:, None]).repeat_interleave(per, dim=1)
        text = self.embed(ids)
        out, _ = self.xattn(text, memory, memory, key_padding_mask=padding, need_weights=False)
        return self.head(text + out)


def main():
    model = Captioner()
    samples = [{"ids": [5, 6, 7, 8, 9], "images": [torch.rand(3, SIDE, SIDE) for _ in range(3)]},
               {"ids": [11, 12, 13], "images": [torch.rand(3, SIDE, SIDE)]}]
    ids, images, counts = collate(samples)
    logits = model(ids, images, counts)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), ignore_index=PAD_ID)
    print(f"fixed={FIXED} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
