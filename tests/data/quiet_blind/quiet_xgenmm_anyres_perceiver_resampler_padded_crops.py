"""XGen-MM (BLIP-3): anyres crops of images of different aspect ratios, each crop
resampled by a Perceiver resampler whose learned latents cross-attend the crop's
patch tokens; the letterbox padding of the anyres canvas is masked out of the keys.

Ported from salesforce/LAVIS, branch xgen-mm, commit 8678bdb7014c3f9c9d56a7a5c5a4aeed9b7f15d5:
  open_flamingo/src/helpers.py          PerceiverAttention, PerceiverResampler, FeedForward
      (latents attend [x, latents]; vision_attn_masks gets a column of ones per
       latent, then an additive -inf bias over the masked keys, softmax on the keys)
  open_flamingo/src/vlm.py              VLM._encode_vision_x_anyres (anyres_patch_sampling=True)
      (read at d699f7e54fbe7072c1fbef3b61a4f5e6d3591bd3)
  open_flamingo/src/xgenmm.py           XGenMMPerceiver.forward (crops of all images
      concatenated, vision_features[:, None, None], masks concatenated)
  open_flamingo/train/any_res_data_utils.py  select_best_resolution, resize_and_pad_image,
      divide_to_patches, get_anyres_image_grid_shape, unpad_image (keep_original_shape=True)
As upstream, the merged (C, rows, cols) grid and its mask are cut into "crops" by the same
row-major view, so every patch token keeps its own mask entry.
The einops calls are written as view/permute, the PIL preprocessing on tensors, the
vision encoder is a tiny frozen transformers SiglipVisionModel; the LM loss is
replaced by a small classifier over the pooled vision tokens so that the resampler
trains a few steps.

Checked against a reference: every crop resampled alone on its valid patch tokens only
(no mask), outputs and gradients; and against noise written into the padded tokens.
"""
import math

import torch
import torch.nn.functional as F
from torch import einsum, nn
from transformers import SiglipVisionConfig, SiglipVisionModel

torch.manual_seed(0)
torch.set_num_threads(1)


def exists(val):
    return val is not None


# ---------------------------------------------------------------- helpers.py

def FeedForward(dim, mult=4):
    inner_dim = int(dim * mult)
    return nn.Sequential(
        nn.LayerNorm(dim),
        nn.Linear(dim, inner_dim, bias=False),
        nn.GELU(),
        nn.Linear(inner_dim, dim, bias=False),
    )


class VisionTokenizer(nn.Module):
    def __init__(self, dim_media, num_tokens_per_media):
        super().__init__()
        self.dim_media = dim_media
        self.num_tokens_per_media = num_tokens_per_media


class PerceiverAttention(nn.Module):
    def __init__(self, *, dim, dim_head=64, heads=8):
        super().__init__()
        self.scale = dim_head**-0.5
        self.heads = heads
        inner_dim = dim_head * heads

        self.norm_media = nn.LayerNorm(dim)
        self.norm_latents = nn.LayerNorm(dim)

        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, latents, vision_attn_masks=None):
        """
        Args:
            x (torch.Tensor): image features
                shape (b, T, n1, D)
            latent (torch.Tensor): latent features
                shape (b, T, n2, D)
        """
        x = self.norm_media(x)
        latents = self.norm_latents(latents)

        h = self.heads

        q = self.to_q(latents)
        kv_input = torch.cat((x, latents), dim=-2)
        if vision_attn_masks is not None:
            vision_attn_masks = torch.cat((vision_attn_masks,
                                           torch.ones((latents.shape[0], latents.shape[-2]), dtype=latents.dtype, device=latents.device)),
                                          dim=-1)
        k, v = self.to_kv(kv_input).chunk(2, dim=-1)
        # rearrange_many((q, k, v), "b t n (h d) -> b h t n d", h=h)
        q, k, v = (t.view(*t.shape[:3], h, -1).permute(0, 3, 1, 2, 4) for t in (q, k, v))
        q = q * self.scale

        # attention
        sim = einsum("... i d, ... j d  -> ... i j", q, k)
        # Apply vision attention mask here.
        if vision_attn_masks is not None:
            attn_bias = torch.zeros((q.size(0), 1, 1, q.size(-2), k.size(-2)), dtype=q.dtype, device=q.device)
            # repeat(vision_attn_masks, 'b n -> b 1 1 l n', l=q.size(-2))
            vision_attn_masks = vision_attn_masks[:, None, None, None, :].expand(-1, 1, 1, q.size(-2), -1)
            attn_bias.masked_fill_(vision_attn_masks.logical_not(), float("-inf"))
            sim += attn_bias

        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)

        out = einsum("... i j, ... j d -> ... i d", attn, v)
        # rearrange(out, "b h t n d -> b t n (h d)", h=h)
        out = out.permute(0, 2, 3, 1, 4).flatten(-2)
        return self.to_out(out)


class PerceiverResampler(VisionTokenizer):
    def __init__(
        self,
        *,
        dim,
        dim_inner=None,
        depth=6,
        dim_head=96,
        heads=16,
        num_latents=128,
        max_num_media=None,
        max_num_frames=None,
        ff_mult=4,
    ):
        if dim_inner is not None:
            projection = nn.Linear(dim, dim_inner)
        else:
            projection = None
            dim_inner = dim
        super().__init__(dim_media=dim, num_tokens_per_media=num_latents)
        self.projection = projection
        self.latents = nn.Parameter(torch.randn(num_latents, dim))

        # positional embeddings
        self.frame_embs = (
            nn.Parameter(torch.randn(max_num_frames, dim))
            if exists(max_num_frames)
            else None
        )
        self.media_time_embs = (
            nn.Parameter(torch.randn(max_num_media, 1, dim))
            if exists(max_num_media)
            else None
        )

        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(
                nn.ModuleList(
                    [
                        PerceiverAttention(dim=dim, dim_head=dim_head, heads=heads),
                        FeedForward(dim=dim, mult=ff_mult),
                    ]
                )
            )

        self.norm = nn.LayerNorm(dim)

    def forward(self, x, vision_attn_masks):
        """
        Args:
            x (torch.Tensor): image features
                shape (b, T, F, v, D)
            vision_attn_masks (torch.Tensor): attention masks for padded visiont tokens (i.e., x)
                shape (b, v)
        Returns:
            shape (b, T, n, D) where n is self.num_latents
        """
        b, T, F_, v = x.shape[:4]

        # frame and media time embeddings
        if exists(self.frame_embs):
            x = x + self.frame_embs[:F_][None, None, :, None, :]
        x = x.flatten(2, 3)  # "b T F v d -> b T (F v) d"
        if exists(self.media_time_embs):
            x = x + self.media_time_embs[:T]

        # blocks
        latents = self.latents
        latents = latents[None, None].expand(b, T, -1, -1)  # "n d -> b T n d"
        for attn, ff in self.layers:
            latents = attn(x, latents, vision_attn_masks) + latents
            latents = ff(latents) + latents

        if exists(self.projection):
            return self.projection(self.norm(latents))
        else:
            return self.norm(latents)


# ------------------------------------------------------ any_res_data_utils.py

def unpad_image(tensor, original_size, keep_original_shape=False):
    """Unpads a tensor of a padded and resized image (C x H x W); with
    keep_original_shape, returns it whole with an (H, W) attention mask instead."""
    original_width, original_height = original_size
    current_height, current_width = tensor.shape[1:]

    original_aspect_ratio = original_width / original_height
    current_aspect_ratio = current_width / current_height

    if original_aspect_ratio > current_aspect_ratio:
        scale_factor = current_width / original_width
        new_height = int(original_height * scale_factor)
        padding = (current_height - new_height) // 2
        if keep_original_shape:
            attention_mask = torch.ones((current_height, current_width), device=tensor.device)
            attention_mask[:padding, :] = 0
            attention_mask[current_height - padding:, :] = 0
            return tensor, attention_mask
        else:
            unpadded_tensor = tensor[:, padding:current_height - padding, :]
            return unpadded_tensor, None
    else:
        scale_factor = current_height / original_height
        new_width = int(original_width * scale_factor)
        padding = (current_width - new_width) // 2
        if keep_original_shape:
            attention_mask = torch.ones((current_height, current_width), device=tensor.device)
            attention_mask[:, :padding] = 0
            attention_mask[:, current_width - padding:] = 0
            return tensor, attention_mask
        else:
            unpadded_tensor = tensor[:, :, padding:current_width - padding]
            return unpadded_tensor, None


def select_best_resolution(original_size, possible_resolutions):
    original_width, original_height = original_size
    best_fit = None
    max_effective_resolution = 0
    min_wasted_resolution = float('inf')

    for width, height in possible_resolutions:
        scale = min(width / original_width, height / original_height)
        downscaled_width, downscaled_height = int(original_width * scale), int(original_height * scale)
        effective_resolution = min(downscaled_width * downscaled_height, original_width * original_height)
        wasted_resolution = (width * height) - effective_resolution

        if effective_resolution > max_effective_resolution or (effective_resolution == max_effective_resolution and wasted_resolution < min_wasted_resolution):
            max_effective_resolution = effective_resolution
            min_wasted_resolution = wasted_resolution
            best_fit = (width, height)

    return best_fit


def resize_and_pad_image(image, target_resolution):
    """image: (C, H, W) tensor; letterboxed (black) to target (width, height)."""
    original_height, original_width = image.shape[1:]
    target_width, target_height = target_resolution

    scale_w = target_width / original_width
    scale_h = target_height / original_height

    if scale_w < scale_h:
        new_width = target_width
        new_height = min(math.ceil(original_height * scale_w), target_height)
    else:
        new_height = target_height
        new_width = min(math.ceil(original_width * scale_h), target_width)

    resized_image = F.interpolate(image[None], size=(new_height, new_width), mode="bilinear", align_corners=False)[0]

    new_image = torch.zeros(image.shape[0], target_height, target_width)
    paste_x = (target_width - new_width) // 2
    paste_y = (target_height - new_height) // 2
    new_image[:, paste_y:paste_y + new_height, paste_x:paste_x + new_width] = resized_image
    return new_image


def divide_to_patches(image, patch_size):
    patches = []
    height, width = image.shape[1:]
    for i in range(0, height, patch_size):
        for j in range(0, width, patch_size):
            patches.append(image[:, i:i + patch_size, j:j + patch_size])
    return patches


def get_anyres_image_grid_shape(image_size, grid_pinpoints, patch_size):
    width, height = select_best_resolution(image_size, grid_pinpoints)
    return width // patch_size, height // patch_size


def process_anyres_image(image, base_img_size, grid_pinpoints):
    best_resolution = select_best_resolution((image.shape[2], image.shape[1]), grid_pinpoints)
    image_padded = resize_and_pad_image(image, best_resolution)
    patches = divide_to_patches(image_padded, base_img_size)
    image_original_resize = F.interpolate(image[None], size=(base_img_size, base_img_size), mode="bilinear", align_corners=False)[0]
    image_patches = [image_original_resize] + patches
    return torch.stack(image_patches, dim=0)


# ------------------------------------------------------------ vlm.py / xgenmm.py

class XGenMMVisionTokens(nn.Module):
    """The vision half of XGenMMPerceiver: frozen encoder, anyres crops, resampler."""

    def __init__(self, vision_encoder, vis_feature_dim, lang_embedding_dim, num_vision_tokens, base_img_size, anyres_grids):
        super().__init__()
        self.vision_encoder = vision_encoder
        self.vision_tokenizer = PerceiverResampler(
            dim=vis_feature_dim, dim_inner=lang_embedding_dim,
            num_latents=num_vision_tokens, depth=2, dim_head=8, heads=4,
        )
        self.base_img_size = base_img_size
        self.anyres_grids = anyres_grids
        self.anyres_patch_sampling = True

    def _encode_vision_x_anyres(self, samples, device):
        assert self.anyres_grids is not None
        image_raw = samples["image"]  # list of patch list in of shape [1, N_patch, C, H, W]
        image_sizes = samples["image_size"]

        images = [x.squeeze(0) for x in image_raw]  # [N_patch, C, H, W]
        image = torch.cat(images, dim=0)  # [\sum{B}{N_patch_i}, C, H, W]
        image = image.to(device)

        with torch.no_grad():
            image_embeds = self.vision_encoder(image, interpolate_pos_encoding=True).last_hidden_state

        grid_size_base = self.base_img_size // self.vision_encoder.config.patch_size
        grid_size = (grid_size_base, grid_size_base)
        height, width = grid_size

        if not image_embeds.shape[1] == height * width:
            assert image_embeds.shape[1] == height * width + 1  # For vision encoders that has [CLS] token.
            image_embeds = image_embeds[:, 1:, :]
        n_vis_token_per_patch = image_embeds.shape[1]

        split_sizes = [image.shape[0] for image in images]
        image_embeds = torch.split(image_embeds, split_sizes, dim=0)
        new_image_embeds = []
        patch_attn_masks = []
        for idx, patch_embeds in enumerate(image_embeds):
            if patch_embeds.shape[0] > 1:
                base_patch_embeds = patch_embeds[0]
                patch_embeds = patch_embeds[1:]

                assert height * width == base_patch_embeds.shape[0]

                num_patch_width, num_patch_height = get_anyres_image_grid_shape(image_sizes[idx],
                                                                                self.anyres_grids,
                                                                                self.base_img_size)
                patch_embeds = patch_embeds.view(num_patch_height, num_patch_width, height, width, -1)

                patch_embeds = patch_embeds.permute(4, 0, 2, 1, 3).contiguous()
                patch_embeds = patch_embeds.flatten(1, 2).flatten(2, 3)
                patch_embeds, patch_attn_mask = unpad_image(patch_embeds, image_sizes[idx], self.anyres_patch_sampling)
                if self.anyres_patch_sampling:
                    patch_embeds = patch_embeds.view(-1, num_patch_height, num_patch_width, height * width)
                    patch_embeds = patch_embeds.flatten(1, 2).permute(1, 2, 0)
                    assert patch_attn_mask is not None
                    patch_attn_mask = patch_attn_mask.view(num_patch_height, num_patch_width, height * width)
                    patch_attn_mask = patch_attn_mask.flatten(0, 1)
                    patch_embeds = torch.cat((base_patch_embeds.unsqueeze(0), patch_embeds), dim=0)
                    patch_attn_mask = torch.cat((torch.ones(n_vis_token_per_patch, device=patch_embeds.device).unsqueeze(0), patch_attn_mask), dim=0)
            else:
                patch_embeds = patch_embeds[0].unsqueeze(0)
                patch_attn_mask = torch.ones(n_vis_token_per_patch, device=patch_embeds.device).unsqueeze(0)

            new_image_embeds.append(patch_embeds)
            patch_attn_masks.append(patch_attn_mask)

        # Return individual patches for independent token downsampling.
        return new_image_embeds, patch_attn_masks

    def forward(self, vision_x, image_size):
        input_dict = dict(image=vision_x, image_size=image_size)
        vision_features, vision_attn_masks = self._encode_vision_x_anyres(input_dict, vision_x[0].device)
        split_sizes = [feature.shape[0] for feature in vision_features]
        vision_features = torch.cat(vision_features, dim=0)
        vision_features = vision_features[:, None, None, :, :]  # Expand dimensions.
        vision_attn_masks = torch.cat(vision_attn_masks, dim=0)
        vision_tokens = self.vision_tokenizer(vision_features, vision_attn_masks)

        vision_token_groups = torch.split(vision_tokens, split_sizes, dim=0)
        vision_tokens = []
        for patch_vis_tokens in vision_token_groups:
            patch_vis_tokens = patch_vis_tokens.flatten(0, 2)  # [Np, 1, v, d] -> [Np*v, d]
            vision_tokens.append(patch_vis_tokens.unsqueeze(0))  # Add the nt dimension.
        return vision_tokens, vision_features, vision_attn_masks, split_sizes


# ------------------------------------------------------------------- the run

BASE = 32                      # base_img_size: one crop = 32 x 32 pixels
PATCH = 8                      # 4 x 4 = 16 patch tokens per crop
ANYRES_GRIDS = [[BASE, BASE * 2], [BASE * 2, BASE], [BASE * 2, BASE * 2], [BASE * 3, BASE], [BASE, BASE * 3]]
VIS_DIM, LANG_DIM, N_LATENTS, N_CLASSES = 32, 24, 6, 3

vision_encoder = SiglipVisionModel(SiglipVisionConfig(
    hidden_size=VIS_DIM, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    image_size=BASE, patch_size=PATCH, num_channels=3,
)).eval()
vision_encoder.requires_grad_(False)

model = XGenMMVisionTokens(vision_encoder, VIS_DIM, LANG_DIM, N_LATENTS, BASE, ANYRES_GRIDS)
head = nn.Linear(LANG_DIM, N_CLASSES)

# images (C, H, W) of different aspect ratios: very wide (3 x 1 crops), very tall (1 x 3),
# 4:3 (2 x 2) and square (2 x 2, no letterbox)
raw_images = [torch.rand(3, 20, 100), torch.rand(3, 70, 15), torch.rand(3, 45, 60), torch.rand(3, 40, 40)]
image_sizes = [(im.shape[2], im.shape[1]) for im in raw_images]   # (width, height), as PIL's image.size
vision_x = [process_anyres_image(im, BASE, ANYRES_GRIDS)[None] for im in raw_images]
labels = torch.tensor([0, 1, 2, 0])


def loss_from_tokens(vision_tokens):
    pooled = torch.stack([t[0].mean(dim=0) for t in vision_tokens])
    return F.cross_entropy(head(pooled), labels)


def reference_tokens(vision_features, vision_attn_masks, split_sizes):
    """Every crop resampled alone on its valid patch tokens only, no mask."""
    outs = []
    for feat, m in zip(vision_features, vision_attn_masks):
        valid = feat[0, 0][m.bool()]
        outs.append(model.vision_tokenizer(valid[None, None, None], None))
    outs = torch.cat(outs, dim=0)
    return [g.flatten(0, 2).unsqueeze(0) for g in torch.split(outs, split_sizes, dim=0)]


vision_tokens, feats, masks, split_sizes = model(vision_x, image_sizes)
print("crops per image:", split_sizes, "masked patch tokens per crop:", (masks == 0).sum(-1).tolist())
assert (masks == 0).any(), "the anyres canvases should hold letterbox padding"

# 1) outputs and gradients against the per-crop reference
params = list(model.vision_tokenizer.parameters()) + list(head.parameters())
loss = loss_from_tokens(vision_tokens)
grads = torch.autograd.grad(loss, params)
ref_tokens = reference_tokens(feats, masks, split_sizes)
ref_loss = loss_from_tokens(ref_tokens)
ref_grads = torch.autograd.grad(ref_loss, params)
for a, b in zip(vision_tokens, ref_tokens):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(loss, ref_loss)
for g, rg in zip(grads, ref_grads):
    torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-4)

# 2) noise written into the padded patch tokens changes nothing
noisy = feats.clone()
noisy[masks[:, None, None, :, None].expand_as(noisy) == 0] = 1e3
noisy_out = model.vision_tokenizer(noisy, masks)
torch.testing.assert_close(noisy_out, model.vision_tokenizer(feats, masks), atol=1e-5, rtol=1e-5)

# 3) a few training steps; the batched run keeps matching the reference
opt = torch.optim.AdamW(params, lr=3e-3)
losses = []
for step in range(6):
    vision_tokens, feats, masks, split_sizes = model(vision_x, image_sizes)
    loss = loss_from_tokens(vision_tokens)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
print("losses:", [round(l, 4) for l in losses])
assert losses[-1] < losses[0]

with torch.no_grad():
    vision_tokens, feats, masks, split_sizes = model(vision_x, image_sizes)
    for a, b in zip(vision_tokens, reference_tokens(feats, masks, split_sizes)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(torch.isfinite(t).all() for t in vision_tokens)
print("ok: masked resampler matches per-crop runs on valid tokens, before and after training")
