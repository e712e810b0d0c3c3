# meta-pytorch/torchtune#1601: padded_collate_tiled_images_and_mask left-padded the tokens for inference but
# still padded each cross-attention encoder_mask at the bottom, so text rows and mask rows no longer line up.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, IMG = 0, 1
VOCAB, DIM, HEADS, TOKENS_PER_TILE, MAX_TILES = 32, 32, 4, 3, 2


class VisionCrossAttentionMask:
    """Text tokens attend to the image from its <|image|> token up to the next one (or the end)."""

    def __init__(self, tile_size, patch_size, image_token_id):
        self.patches_per_tile = (tile_size // patch_size) ** 2 - 1 if tile_size > patch_size else TOKENS_PER_TILE
        self.image_token_id = image_token_id

    def __call__(self, sample):
        tokens, images = sample["tokens"], sample["encoder_input"]["images"]
        starts = [i for i, t in enumerate(tokens) if t == self.image_token_id]
        intervals = [(s, e) for s, e in zip(starts, starts[1:] + [len(tokens)])]
        masks = []
        for (start, end), image in zip(intervals, images):
            n_tiles = image.shape[0]
            mask = torch.zeros(len(tokens), n_tiles * self.patches_per_tile, dtype=torch.bool)
            mask[start:end, :] = True
            masks.append(mask)
        sample["encoder_mask"] = masks
        return sample


def padded_collate_tiled_images_and_mask(batch, padding_idx=PAD, pad_direction="right"):
    max_seq_len = max(len(s["tokens"]) for s in batch)
    tokens, masks, images = [], [], []
    for s in batch:
        text_padding = max_seq_len - len(s["tokens"])
        if pad_direction == "left":
            tokens.append([padding_idx] * text_padding + s["tokens"])
        else:
            tokens.append(s["tokens"] + [padding_idx] * text_padding)
        for image, mask in zip(s["encoder_input"]["images"], s["encoder_mask"]):
            n_tiles = image.shape[0]
            padding_tiles = MAX_TILES - n_tiles
            images.append(F.pad(image, (0, 0, 0, 0, 0, padding_tiles), value=0))
            image_padding = TOKENS_PER_TILE * padding_tiles
            if FIXED and pad_direction == "left":
                masks.append(F.pad(mask, (0, image_padding, text_padding, 0), value=0))
            else:
                masks.append(F.pad(mask, (0, image_padding, 0, text_padding), value=0))
    return {
        "tokens": torch.tensor(tokens),
        "encoder_input": {"images": torch.stack(images)},
        "encoder_mask": torch.stack(masks),  # one image per sample here: (bsz, seq, image_seq)
    }


class MultiHeadAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x, y, mask):
        b, s_x, _ = x.shape
        q = self.q_proj(x).view(b, s_x, HEADS, -1).transpose(1, 2)
        k = self.k_proj(y).view(b, y.shape[1], HEADS, -1).transpose(1, 2)
        v = self.v_proj(y).view(b, y.shape[1], HEADS, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, :, :])
        return self.output_proj(out.transpose(1, 2).reshape(b, s_x, DIM))


class TransformerSelfAttentionLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.sa_norm, self.attn = nn.LayerNorm(DIM), MultiHeadAttention()
        self.mlp = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.SiLU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x, *, mask, encoder_input=None, encoder_mask=None):
        h = self.sa_norm(x)
        x = x + self.attn(h, h, mask)
        return x + self.mlp(x)


class TransformerCrossAttentionLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ca_norm, self.attn = nn.LayerNorm(DIM), MultiHeadAttention()

    def _skip_mask(self, mask):
        return torch.all(~mask, dim=-1, keepdim=True)

    def forward(self, x, *, mask=None, encoder_input, encoder_mask):
        skip_mask = self._skip_mask(encoder_mask)
        encoder_mask = encoder_mask.masked_fill(skip_mask, True)
        attn_out = self.attn(self.ca_norm(x), encoder_input, encoder_mask)
        attn_out = attn_out.masked_fill(skip_mask, 0)
        return x + attn_out


class DeepFusionModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.encoder = nn.Linear(8, TOKENS_PER_TILE * DIM)  # tile -> tokens_per_tile embeddings
        self.layers = nn.ModuleList(
            [TransformerSelfAttentionLayer(), TransformerCrossAttentionLayer(), TransformerSelfAttentionLayer()]
        )
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, *, mask, encoder_input, encoder_mask):
        b = tokens.shape[0]
        enc = self.encoder(encoder_input["images"].flatten(2)).view(b, -1, DIM)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, mask=mask, encoder_input=enc, encoder_mask=encoder_mask)
        return self.output(h)


def get_causal_mask_from_padding_mask(padding_mask):
    s = padding_mask.shape[1]
    return torch.tril(torch.ones(s, s, dtype=torch.bool)) & padding_mask[:, None, :] | torch.eye(s, dtype=torch.bool)


@torch.no_grad()
def generate_first_logits(model, samples):
    batch = padded_collate_tiled_images_and_mask(samples, pad_direction="left")
    mask = get_causal_mask_from_padding_mask(batch["tokens"] != PAD)
    logits = model(batch["tokens"], mask=mask, encoder_input=batch["encoder_input"], encoder_mask=batch["encoder_mask"])
    return logits[:, -1]


def main():
    model = DeepFusionModel().eval()
    transform = VisionCrossAttentionMask(tile_size=4, patch_size=2, image_token_id=IMG)
    short = {"tokens": [5, IMG, 7, 9], "encoder_input": {"images": [torch.randn(1, 2, 4)]}}
    long = {"tokens": [3, 4, 6, 8, IMG, 10, 11, 12], "encoder_input": {"images": [torch.randn(2, 2, 4)]}}
    samples = [transform(dict(short)), transform(dict(long))]
    batched = generate_first_logits(model, samples)
    alone = generate_first_logits(model, [transform(dict(short))])
    diff = (batched[0] - alone[0]).abs().max().item()
    print(f"fixed={FIXED} next-token logits of the left-padded prompt vs. alone: max diff {diff:.3e}")


if __name__ == "__main__":
    main()
