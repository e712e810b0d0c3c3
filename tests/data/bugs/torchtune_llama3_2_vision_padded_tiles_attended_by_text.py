# meta-pytorch/torchtune#1836: Llama3VisionTransform padded every image to max_num_tiles inside CLIPImageTransform,
# before VisionCrossAttentionMask counted the tiles, so the cross-attention mask let text attend to the padding tiles.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

IMAGE_ID, PAD_ID, VOCAB, DIM, HEADS = 1, 0, 40, 32, 4
TILE, PATCH, MAX_NUM_TILES = 4, 2, 4
PATCHES_PER_TILE = (TILE // PATCH) ** 2


def tile_crop(image, tile_size):
    c, h, w = image.shape
    tiles = image.view(c, h // tile_size, tile_size, w // tile_size, tile_size)
    return tiles.permute(1, 3, 0, 2, 4).reshape(-1, c, tile_size, tile_size)


def pad_dim_to_size(x, size, dim=0):
    padding = [0] * (2 * x.dim())
    padding[-(2 * dim + 1)] = size - x.shape[dim]
    return F.pad(x, padding)


class CLIPImageTransform:
    def __init__(self, tile_size, max_num_tiles, pad_max_tiles=False):
        self.tile_size = tile_size
        self.pad_tile_size = max_num_tiles if pad_max_tiles else None

    def __call__(self, sample):
        image = tile_crop(image=sample["image"], tile_size=self.tile_size)
        if self.pad_tile_size:
            image = pad_dim_to_size(image, size=self.pad_tile_size, dim=0)
        sample["image"] = image
        return sample


class VisionCrossAttentionMask:
    def __init__(self, tile_size, patch_size, image_token_id):
        self.patches_per_tile = (tile_size // patch_size) ** 2
        self.image_token_id = image_token_id

    def __call__(self, sample):
        tokens, images = sample["tokens"], sample["encoder_input"]["images"]
        starts = [i for i, t in enumerate(tokens) if t == self.image_token_id]
        masks = []
        for image_num, start in enumerate(starts):
            end = starts[image_num + 1] if image_num + 1 < len(starts) else len(tokens)
            n_tiles = images[image_num].shape[0]
            image_seq_len = n_tiles * (self.patches_per_tile + 1)  # +1 for CLS token
            mask = torch.zeros(len(tokens), image_seq_len, dtype=torch.bool)
            mask[start:end, :image_seq_len] = True
            masks.append(mask)
        sample["encoder_mask"] = masks
        return sample


class Llama3VisionTransform:
    def __init__(self):
        self.transform_image = CLIPImageTransform(TILE, MAX_NUM_TILES, pad_max_tiles=not FIXED)
        self.xattn_mask = VisionCrossAttentionMask(TILE, PATCH, IMAGE_ID)

    def __call__(self, sample):
        image = self.transform_image({"image": sample["image"]})["image"]
        return self.xattn_mask({"tokens": sample["tokens"], "encoder_input": {"images": [image]}})


def padded_collate_tiled_images_and_mask(batch, padding_idx=PAD_ID, pad_max_tiles=None):
    max_seq_len = max(len(s["tokens"]) for s in batch)
    max_num_tiles = max(img.shape[0] for s in batch for img in s["encoder_input"]["images"])
    if pad_max_tiles is not None:
        max_num_tiles = pad_max_tiles
    tokens = torch.tensor([s["tokens"] + [padding_idx] * (max_seq_len - len(s["tokens"])) for s in batch])
    images, masks = [], []
    for s in batch:
        for image, mask in zip(s["encoder_input"]["images"], s["encoder_mask"]):
            n_tiles = image.shape[0]
            text_seq_len, image_seq_len = mask.shape
            tokens_per_tile = image_seq_len // n_tiles
            padding_tiles = max_num_tiles - n_tiles
            images.append(F.pad(image, (0, 0, 0, 0, 0, 0, 0, padding_tiles)))
            masks.append(F.pad(mask, (0, tokens_per_tile * padding_tiles, 0, max_seq_len - text_seq_len), value=0))
    return {"tokens": tokens, "encoder_input": {"images": torch.stack(images)[:, None]},
            "encoder_mask": torch.stack(masks)}


class VisionEncoder(nn.Module):
    """Per-tile patch embedding + CLS, as the CLIP tile encoder emits (patches_per_tile + 1) tokens per tile."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, DIM, kernel_size=PATCH, stride=PATCH)
        self.cls_token_embedding = nn.Parameter(torch.randn(DIM))
        self.positional_embedding = nn.Parameter(torch.randn(PATCHES_PER_TILE + 1, DIM))
        self.proj = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM))

    def forward(self, images):
        b, n_imgs, n_tiles = images.shape[:3]
        x = self.conv(images.flatten(0, 2)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token_embedding.expand(x.shape[0], 1, DIM), x], dim=1) + self.positional_embedding
        return self.proj(x).reshape(b, n_imgs * n_tiles * (PATCHES_PER_TILE + 1), DIM)


class MultiHeadAttention(nn.Module):
    def __init__(self, is_causal):
        super().__init__()
        self.is_causal = is_causal
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x, y, mask=None):
        b, s_x, _ = x.shape
        q = self.q_proj(x).view(b, s_x, HEADS, -1).transpose(1, 2)
        k = self.k_proj(y).view(b, y.shape[1], HEADS, -1).transpose(1, 2)
        v = self.v_proj(y).view(b, y.shape[1], HEADS, -1).transpose(1, 2)
        if mask is not None:
            mask = mask[:, None, :, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.is_causal and mask is None)
        return self.output_proj(out.transpose(1, 2).reshape(b, s_x, DIM))


class Llama3VisionDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.sa = MultiHeadAttention(is_causal=True)
        self.ca = MultiHeadAttention(is_causal=False)
        self.ca_scale = nn.Parameter(torch.ones(1))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, encoder_input, encoder_mask):
        h = self.tok_embeddings(tokens)
        h = h + self.sa(h, h)
        skip_mask = torch.all(~encoder_mask, dim=-1, keepdim=True)
        ca_out = self.ca(h, encoder_input, encoder_mask.masked_fill(skip_mask, True))
        h = h + self.ca_scale * ca_out.masked_fill(skip_mask, 0)
        return self.output(self.norm(h))


class Llama3_2VisionModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = VisionEncoder(), Llama3VisionDecoder()

    def forward(self, tokens, *, encoder_input, encoder_mask):
        return self.decoder(tokens, self.encoder(encoder_input["images"]), encoder_mask)


def main():
    model = Llama3_2VisionModel()
    transform = Llama3VisionTransform()
    raw = [
        {"tokens": [IMAGE_ID, 5, 6, 7], "image": torch.randn(3, TILE, TILE)},  # 1 tile
        {"tokens": [3, IMAGE_ID, 8, 9, 10, 11], "image": torch.randn(3, TILE, 2 * TILE)},  # 2 tiles
    ]
    batch = padded_collate_tiled_images_and_mask(
        [transform(dict(s)) for s in raw], pad_max_tiles=MAX_NUM_TILES if FIXED else None
    )
    logits = model(batch["tokens"], encoder_input=batch["encoder_input"], encoder_mask=batch["encoder_mask"])
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["tokens"][:, 1:].reshape(-1), ignore_index=PAD_ID)
    loss.backward()  # one training step's forward/backward

    with torch.no_grad():  # reference: the 1-tile image with exactly its own tokens, nothing padded
        tiles = tile_crop(raw[0]["image"], TILE)
        n = len(raw[0]["tokens"])
        ref = model(torch.tensor([raw[0]["tokens"]]), encoder_input={"images": tiles[None, None]},
                    encoder_mask=torch.ones(1, n, PATCHES_PER_TILE + 1, dtype=torch.bool))
        diff = (logits[0, :n] - ref[0]).abs().max().item()
    print(f"fixed={FIXED} loss {loss.item():.4f}; 1-tile sample logits vs unpadded reference: max diff {diff:.3e}")


if __name__ == "__main__":
    main()
