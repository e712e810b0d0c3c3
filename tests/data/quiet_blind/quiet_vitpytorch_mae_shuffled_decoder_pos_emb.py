# Citation: lucidrains/vit-pytorch @3e5d1be6f0004ecc9ce727dcf52bdc1a9888168b: vit_pytorch/mae.py (MAE.__init__ / forward,
#   as of d4daf7b "Support SimpleViT as encoder in MAE (#272)"), vit_pytorch/vit.py (FeedForward, Attention,
#   Transformer, ViT). einops Rearrange / rearrange / repeat written as plain torch ops so the program needs only torch.
# Masked autoencoder pretraining: a random argsort per image splits the patches into masked_indices and
# unmasked_indices. The ViT encoder runs over the unmasked tokens only (gathered with batch_range, no attention mask:
# every image keeps the same number of patches). The decoder sees every patch: the encoded tokens get
# decoder_pos_emb(unmasked_indices), the learned mask token gets decoder_pos_emb(masked_indices), and both are
# scattered back to their patch slots before the full-attention decoder; the masked slots are gathered out again for
# the pixel reconstruction loss.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


# helpers

def pair(t):
    return t if isinstance(t, tuple) else (t, t)


class Rearrange(nn.Module):
    """einops Rearrange('b c (h p1) (w p2) -> b (h w) (p1 p2 c)')."""

    def __init__(self, p1, p2):
        super().__init__()
        self.p1, self.p2 = p1, p2

    def forward(self, img):
        b, c, H, W = img.shape
        h, w = H // self.p1, W // self.p2
        x = img.reshape(b, c, h, self.p1, w, self.p2)
        x = x.permute(0, 2, 4, 3, 5, 1)  # b h w p1 p2 c
        return x.reshape(b, h * w, self.p1 * self.p2 * c)


# classes (vit_pytorch/vit.py)

class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, dropout=0.):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(dim),
            nn.Linear(dim, hidden_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, dim),
            nn.Dropout(dropout)
        )

    def forward(self, x):
        return self.net(x)


class Attention(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64, dropout=0.):
        super().__init__()
        inner_dim = dim_head * heads
        project_out = not (heads == 1 and dim_head == dim)

        self.heads = heads
        self.scale = dim_head ** -0.5

        self.norm = nn.LayerNorm(dim)

        self.attend = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)

        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)

        self.to_out = nn.Sequential(
            nn.Linear(inner_dim, dim),
            nn.Dropout(dropout)
        ) if project_out else nn.Identity()

    def forward(self, x):
        x = self.norm(x)

        qkv = self.to_qkv(x).chunk(3, dim=-1)
        b, n, _ = x.shape
        # rearrange(t, 'b n (h d) -> b h n d', h = self.heads)
        q, k, v = map(lambda t: t.reshape(b, n, self.heads, -1).transpose(1, 2), qkv)

        dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale

        attn = self.attend(dots)
        attn = self.dropout(attn)

        out = torch.matmul(attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out)


class Transformer(nn.Module):
    def __init__(self, dim, depth, heads, dim_head, mlp_dim, dropout=0.):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Attention(dim, heads=heads, dim_head=dim_head, dropout=dropout),
                FeedForward(dim, mlp_dim, dropout=dropout)
            ]))

    def forward(self, x):
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x

        return self.norm(x)


class ViT(nn.Module):
    def __init__(self, *, image_size, patch_size, num_classes, dim, depth, heads, mlp_dim, pool='cls', channels=3,
                 dim_head=64, dropout=0., emb_dropout=0.):
        super().__init__()
        image_height, image_width = pair(image_size)
        patch_height, patch_width = pair(patch_size)

        assert image_height % patch_height == 0 and image_width % patch_width == 0, 'Image dimensions must be divisible by the patch size.'

        num_patches = (image_height // patch_height) * (image_width // patch_width)
        patch_dim = channels * patch_height * patch_width
        assert pool in {'cls', 'mean'}, 'pool type must be either cls (cls token) or mean (mean pooling)'

        self.to_patch_embedding = nn.Sequential(
            Rearrange(p1=patch_height, p2=patch_width),
            nn.LayerNorm(patch_dim),
            nn.Linear(patch_dim, dim),
            nn.LayerNorm(dim),
        )

        self.pos_embedding = nn.Parameter(torch.randn(1, num_patches + 1, dim))
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.dropout = nn.Dropout(emb_dropout)

        self.transformer = Transformer(dim, depth, heads, dim_head, mlp_dim, dropout)

        self.pool = pool
        self.to_latent = nn.Identity()

        self.mlp_head = nn.Linear(dim, num_classes)

    def forward(self, img):
        x = self.to_patch_embedding(img)
        b, n, _ = x.shape

        cls_tokens = self.cls_token.expand(b, -1, -1)  # repeat(self.cls_token, '1 1 d -> b 1 d', b = b)
        x = torch.cat((cls_tokens, x), dim=1)
        x += self.pos_embedding[:, :(n + 1)]
        x = self.dropout(x)

        x = self.transformer(x)

        x = x.mean(dim=1) if self.pool == 'mean' else x[:, 0]

        x = self.to_latent(x)
        return self.mlp_head(x)


# vit_pytorch/mae.py

class MAE(nn.Module):
    def __init__(
        self,
        *,
        encoder,
        decoder_dim,
        masking_ratio=0.75,
        decoder_depth=1,
        decoder_heads=8,
        decoder_dim_head=64
    ):
        super().__init__()
        assert masking_ratio > 0 and masking_ratio < 1, 'masking ratio must be kept between 0 and 1'
        self.masking_ratio = masking_ratio

        # extract some hyperparameters and functions from encoder (vision transformer to be trained)

        self.encoder = encoder
        num_patches, encoder_dim = encoder.pos_embedding.shape[-2:]

        self.to_patch = encoder.to_patch_embedding[0]
        self.patch_to_emb = nn.Sequential(*encoder.to_patch_embedding[1:])

        pixel_values_per_patch = encoder.to_patch_embedding[2].weight.shape[-1]

        # decoder parameters
        self.decoder_dim = decoder_dim
        self.enc_to_dec = nn.Linear(encoder_dim, decoder_dim) if encoder_dim != decoder_dim else nn.Identity()
        self.mask_token = nn.Parameter(torch.randn(decoder_dim))
        self.decoder = Transformer(dim=decoder_dim, depth=decoder_depth, heads=decoder_heads, dim_head=decoder_dim_head, mlp_dim=decoder_dim * 4)
        self.decoder_pos_emb = nn.Embedding(num_patches, decoder_dim)
        self.to_pixels = nn.Linear(decoder_dim, pixel_values_per_patch)

    def forward(self, img):
        device = img.device

        # get patches

        patches = self.to_patch(img)
        batch, num_patches, *_ = patches.shape

        # patch to encoder tokens and add positions

        tokens = self.patch_to_emb(patches)
        if self.encoder.pool == "cls":
            tokens += self.encoder.pos_embedding[:, 1:(num_patches + 1)]
        elif self.encoder.pool == "mean":
            tokens += self.encoder.pos_embedding.to(device, dtype=tokens.dtype)

        # calculate of patches needed to be masked, and get random indices, dividing it up for mask vs unmasked

        num_masked = int(self.masking_ratio * num_patches)
        rand_indices = torch.rand(batch, num_patches, device=device).argsort(dim=-1)
        masked_indices, unmasked_indices = rand_indices[:, :num_masked], rand_indices[:, num_masked:]

        # get the unmasked tokens to be encoded

        batch_range = torch.arange(batch, device=device)[:, None]
        tokens = tokens[batch_range, unmasked_indices]

        # get the patches to be masked for the final reconstruction loss

        masked_patches = patches[batch_range, masked_indices]

        # attend with vision transformer

        encoded_tokens = self.encoder.transformer(tokens)

        # project encoder to decoder dimensions, if they are not equal - the paper says you can get away with a smaller dimension for decoder

        decoder_tokens = self.enc_to_dec(encoded_tokens)

        # reapply decoder position embedding to unmasked tokens

        unmasked_decoder_tokens = decoder_tokens + self.decoder_pos_emb(unmasked_indices)

        # repeat mask tokens for number of masked, and add the positions using the masked indices derived above

        mask_tokens = self.mask_token.expand(batch, num_masked, -1)  # repeat(self.mask_token, 'd -> b n d', ...)
        mask_tokens = mask_tokens + self.decoder_pos_emb(masked_indices)

        # concat the masked tokens to the decoder tokens and attend with decoder

        decoder_tokens = torch.zeros(batch, num_patches, self.decoder_dim, device=device)
        decoder_tokens[batch_range, unmasked_indices] = unmasked_decoder_tokens
        decoder_tokens[batch_range, masked_indices] = mask_tokens
        decoded_tokens = self.decoder(decoder_tokens)

        # splice out the mask tokens and project to pixel values

        mask_tokens = decoded_tokens[batch_range, masked_indices]
        pred_pixel_values = self.to_pixels(mask_tokens)

        # calculate reconstruction loss

        recon_loss = F.mse_loss(pred_pixel_values, masked_patches)
        return recon_loss


# ---------------------------------------------------------------------------------------------------------------
# references, written per image with plain loops


def reference_attention_kept_keys(attn, x, keep):
    """Attention.forward over every patch of one image, with the masked patches removed as keys."""
    x = attn.norm(x)
    q, k, v = attn.to_qkv(x).chunk(3, dim=-1)
    n = x.shape[0]
    q, k, v = (t.reshape(n, attn.heads, -1).transpose(0, 1) for t in (q, k, v))
    dots = torch.matmul(q, k.transpose(-1, -2)) * attn.scale
    dots = dots.masked_fill(~keep[None, None, :], float('-inf'))
    out = torch.matmul(dots.softmax(dim=-1), v)
    return attn.to_out(out.transpose(0, 1).reshape(n, -1))


def reference_encoder_kept_keys(transformer, x, keep):
    for attn, ff in transformer.layers:
        x = reference_attention_kept_keys(attn, x, keep) + x
        x = ff(x) + x
    return transformer.norm(x)


@torch.no_grad()
def reference_image(mae, img, order):
    """One image, patch order `order` (argsort of its noise): returns (pred of masked patches, masked patches)."""
    patches = mae.to_patch(img[None])[0]                     # (N, patch_dim)
    num_patches = patches.shape[0]
    num_masked = int(mae.masking_ratio * num_patches)
    masked = [int(i) for i in order[:num_masked]]
    kept = [int(i) for i in order[num_masked:]]

    tokens = mae.patch_to_emb(patches) + mae.encoder.pos_embedding[0, 1:num_patches + 1]

    # encoder over the kept patches only, in the shuffled order
    encoded = mae.encoder.transformer(tokens[kept][None])[0]

    # the same encoder over all patches in raster order, the masked ones removed as keys: same kept outputs
    keep = torch.zeros(num_patches, dtype=torch.bool)
    keep[kept] = True
    encoded_raster = reference_encoder_kept_keys(mae.encoder.transformer, tokens, keep)
    torch.testing.assert_close(encoded, encoded_raster[kept], rtol=1e-5, atol=1e-5)

    # decoder input built slot by slot, in raster order
    dec_in = []
    for p in range(num_patches):
        if p in kept:
            tok = mae.enc_to_dec(encoded[kept.index(p)])
        else:
            tok = mae.mask_token
        dec_in.append(tok + mae.decoder_pos_emb.weight[p])
    decoded = mae.decoder(torch.stack(dec_in)[None])[0]
    pred = mae.to_pixels(decoded[masked])

    # the decoder has no positions of its own: the token order must not matter (1cc0f18 concatenated
    # [mask tokens, encoded tokens] instead of scattering them back to raster order)
    concat_in = torch.stack([dec_in[p] for p in masked + kept])
    decoded_concat = mae.decoder(concat_in[None])[0]
    torch.testing.assert_close(mae.to_pixels(decoded_concat[:num_masked]), pred, rtol=1e-5, atol=1e-5)

    return pred, patches[masked]


def main():
    v = ViT(
        image_size=32,
        patch_size=8,
        num_classes=10,
        dim=64,
        depth=2,
        heads=4,
        dim_head=16,
        mlp_dim=128
    )

    mae = MAE(
        encoder=v,
        masking_ratio=0.75,
        decoder_dim=32,
        decoder_depth=2,
        decoder_heads=4,
        decoder_dim_head=8
    )

    images = torch.randn(4, 3, 32, 32)
    batch, num_patches = images.shape[0], (32 // 8) ** 2

    # a few pretraining steps
    opt = torch.optim.Adam(mae.parameters(), lr=1e-3)
    losses = []
    for step in range(20):
        loss = mae(images)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"recon loss: step 0 {losses[0]:.4f} -> step {len(losses) - 1} {losses[-1]:.4f}")
    assert losses[-1] < losses[0]

    # check one forward against the per-image references, drawing the same noise
    mae.eval()
    torch.manual_seed(1234)
    with torch.no_grad():
        loss = mae(images)
    torch.manual_seed(1234)
    rand_indices = torch.rand(batch, num_patches).argsort(dim=-1)

    preds, targets = [], []
    for b in range(batch):
        pred, target = reference_image(mae, images[b], rand_indices[b])
        preds.append(pred)
        targets.append(target)
    ref_loss = F.mse_loss(torch.stack(preds), torch.stack(targets))
    print(f"batched loss {loss.item():.6f}  per-image reference {ref_loss.item():.6f}")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)

    # masked patches never reach the encoder: changing their pixels leaves every kept token's encoding unchanged
    num_masked = int(mae.masking_ratio * num_patches)
    perturbed = mae.to_patch(images).clone()
    batch_range = torch.arange(batch)[:, None]
    perturbed[batch_range, rand_indices[:, :num_masked]] += 5.0
    with torch.no_grad():
        def encode(patches):
            tokens = mae.patch_to_emb(patches) + mae.encoder.pos_embedding[:, 1:(num_patches + 1)]
            return mae.encoder.transformer(tokens[batch_range, rand_indices[:, num_masked:]])
        torch.testing.assert_close(encode(perturbed), encode(mae.to_patch(images)))
    print("ok")


if __name__ == "__main__":
    main()
