"""InternVL-style dynamic tiling: one image cut into tiles plus a global thumbnail, all fed to one causal LLM.

Follows OpenGVLab/InternVL internvl_chat/internvl/train/dataset.py (dynamic_preprocess, use_thumbnail) and
internvl/model/internvl_chat/modeling_internvl_chat.py (extract_feature, pixel_shuffle, the IMG_CONTEXT
token replacement in forward). Recalled, not read line by line.

Masks meant: the vision tower runs each tile (and the thumbnail) as its own batch row, so patches attend
bidirectionally only inside their tile (no mask needed: every row is a full tile). In the language model all
image-context tokens of all tiles sit in one sequence under a plain causal mask: later tiles and the thumbnail
see earlier tiles, text after the image sees every tile. That is what InternVL trains with.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
IMG_CONTEXT = 7  # id of <IMG_CONTEXT>
IMG_START, IMG_END = 5, 6


def dynamic_preprocess(image, image_size=16, max_num=4, use_thumbnail=True):
    """Split a CHW image into a grid of tiles chosen by aspect ratio, plus a thumbnail of the whole image."""
    _, h, w = image.shape
    ratios = sorted({(i, j) for n in range(1, max_num + 1) for i in range(1, n + 1) for j in range(1, n + 1)
                     if i * j <= max_num}, key=lambda x: x[0] * x[1])
    aspect = w / h
    best = min(ratios, key=lambda r: (abs(aspect - r[0] / r[1]), -r[0] * r[1]))
    tw, th = image_size * best[0], image_size * best[1]
    resized = F.interpolate(image[None], size=(th, tw), mode="bilinear", align_corners=False)[0]
    tiles = [resized[:, r * image_size:(r + 1) * image_size, c * image_size:(c + 1) * image_size]
             for r in range(best[1]) for c in range(best[0])]
    if use_thumbnail and len(tiles) != 1:
        tiles.append(F.interpolate(image[None], size=(image_size, image_size), mode="bilinear",
                                   align_corners=False)[0])
    return torch.stack(tiles)


class VisionBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)  # full attention within one tile
        return x + self.proj(o.transpose(1, 2).reshape(b, n, d))


class InternVLChatLite(nn.Module):
    def __init__(self, d=32, heads=4, patch=4, vocab=50):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, d, patch, patch)
        self.vit = VisionBlock(d, heads)
        self.mlp1 = nn.Linear(4 * d, d)  # after pixel_shuffle(0.5)
        self.embed = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.heads = heads
        self.num_image_token = (16 // patch // 2) ** 2

    def extract_feature(self, pixel_values):
        x = self.patch_embed(pixel_values)            # (tiles, d, 4, 4)
        x = self.vit(x.flatten(2).transpose(1, 2))
        n, l, d = x.shape
        s = int(l ** 0.5)
        x = x.view(n, s // 2, 2, s // 2, 2, d).permute(0, 1, 3, 2, 4, 5).reshape(n, (s // 2) ** 2, 4 * d)
        return self.mlp1(x)

    def forward(self, pixel_values, input_ids):
        vit_embeds = self.extract_feature(pixel_values)
        embeds = self.embed(input_ids)
        b, n, d = embeds.shape
        flat = embeds.reshape(b * n, d)
        selected = input_ids.reshape(-1) == IMG_CONTEXT
        flat = flat.clone()
        flat[selected] = vit_embeds.reshape(-1, d).to(flat.dtype)
        h = flat.view(b, n, d)
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True), h


image = torch.rand(3, 20, 40)
pixel_values = dynamic_preprocess(image)
num_tiles = pixel_values.shape[0]
model = InternVLChatLite().eval()
prompt = [1, 2, IMG_START] + [IMG_CONTEXT] * (model.num_image_token * num_tiles) + [IMG_END, 3, 4]
input_ids = torch.tensor([prompt])
with torch.no_grad():
    out, h = model(pixel_values, input_ids)
    # reference: each tile alone through the vision tower; LLM with an explicit lower-triangular softmax
    ref_tiles = torch.cat([model.extract_feature(t[None]) for t in pixel_values], 1)[0]
    assert torch.allclose(h[0, 3:3 + ref_tiles.shape[0]], ref_tiles, atol=1e-5)
    q, k, v = model.qkv(h).view(1, h.shape[1], 3, 4, 8).permute(2, 0, 3, 1, 4)
    s = q @ k.transpose(-1, -2) / 8 ** 0.5
    s = s.masked_fill(~torch.tril(torch.ones(h.shape[1], h.shape[1], dtype=torch.bool)), float("-inf"))
    assert torch.allclose(out, s.softmax(-1) @ v, atol=1e-5)
print(f"tiles={num_tiles} (incl. thumbnail) seq={input_ids.shape[1]} ok")
