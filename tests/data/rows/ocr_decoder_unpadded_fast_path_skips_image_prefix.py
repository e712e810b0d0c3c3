# Written another way (the bug of VikParuchuri/surya 2791d60: the image unmasking skipped where the mask came back
# None): a hand-written OCR decoder on F.scaled_dot_product_attention whose dict config states `unmask_image` with
# the end-of-image token. The mask builder takes a fast path for an unpadded batch (no mask, SDPA's is_causal) and
# or-s the image prefix onto the causal mask only on the padded path: a left-padded batch gets its image tiles seen
# both ways, an unpadded one (each row's EOI at its own place) runs causal over them. The fix always builds the mask.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

CONFIG = {"vocab_size": 24, "hidden": 32, "heads": 4, "num_layers": 2, "pad_token_id": 0, "image_token_id": 5,
          "eoi_token_id": 6, "unmask_image": True}
PAD, IMG, EOI = CONFIG["pad_token_id"], CONFIG["image_token_id"], CONFIG["eoi_token_id"]


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x, mask):
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.out(y.transpose(1, 2).reshape(B, L, D))


class OCRDecoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg["vocab_size"], cfg["hidden"])
        self.layers = nn.ModuleList([Attention(cfg["hidden"], cfg["heads"]) for _ in range(cfg["num_layers"])])
        self.head = nn.Linear(cfg["hidden"], cfg["vocab_size"])

    def build_mask(self, input_ids, attention_mask):
        """(B, 1, L, L) bool, True = attend: causal, the image prefix (to each row's EOI) both ways, no padding."""
        real = attention_mask.bool()
        if not FIXED and bool(real.all()):
            return None  # fast path: nothing padded, SDPA's is_causal masks alone
        L = input_ids.shape[1]
        keep = torch.ones(L, L, dtype=torch.bool).tril()[None] & real[:, None, :]
        if self.cfg["unmask_image"]:
            eoi = (input_ids == self.cfg["eoi_token_id"]).int().argmax(dim=1)
            prefix = torch.arange(L)[None, :] <= eoi[:, None]  # (B, L)
            keep = keep | (prefix[:, None, :] & prefix[:, :, None] & real[:, None, :] & real[:, :, None])
        keep = keep | torch.eye(L, dtype=torch.bool)[None]  # (a padding query sees itself: no NaN row)
        return keep[:, None]

    def forward(self, input_ids, attention_mask):
        mask = self.build_mask(input_ids, attention_mask)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x, mask)
        return self.head(x)


model = OCRDecoder(CONFIG).eval()
padded = torch.tensor([[PAD, PAD, IMG, IMG, EOI, 9, 10, 11], [IMG, IMG, IMG, IMG, EOI, 12, 13, 14]])
unpadded = torch.tensor([[IMG, IMG, IMG, EOI, 9, 10, 11, 15], [IMG, IMG, IMG, IMG, IMG, EOI, 12, 13]])
with torch.no_grad():
    for ids in (padded, unpadded):
        logits = model(ids, (ids != PAD).long())
        print(f"batch {tuple(ids.shape)}: first-token logits mean {logits[:, -1].mean().item():.4f}")
