# huggingface/transformers#33499: Idefics2 marked a vision patch as valid when *any* of its pixels was real
# (sum > 0), so in a padded batch the mostly-padding border patches were attended to by the vision tower.
import sys

import torch
from transformers import Idefics2Config, Idefics2Model

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

config = Idefics2Config(
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       image_size=24, patch_size=4, initializer_range=0.3),
    perceiver_config=dict(hidden_size=32, rms_norm_eps=1e-6, hidden_act="silu", resampler_n_latents=4, resampler_depth=1, resampler_n_heads=2,
                          resampler_head_dim=8, num_key_value_heads=1),
    text_config=dict(model_type="mistral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128),
)
config._attn_implementation = "sdpa"
config.vision_config._attn_implementation = "sdpa"
config.perceiver_config._attn_implementation = "sdpa"
model = Idefics2Model(config).eval()


def get_image_features(self, pixel_values, pixel_attention_mask=None):
    batch_size, num_images, num_channels, height, width = pixel_values.shape
    pixel_values = pixel_values.view(batch_size * num_images, *pixel_values.shape[2:])

    # Remove padding images - padding images are full 0.
    nb_values_per_image = pixel_values.shape[1:].numel()
    real_images_inds = (pixel_values == 0.0).sum(dim=(-1, -2, -3)) != nb_values_per_image
    pixel_values = pixel_values[real_images_inds].contiguous()

    # Handle the vision attention mask
    if pixel_attention_mask is None:
        pixel_attention_mask = torch.ones(
            size=(pixel_values.size(0), pixel_values.size(2), pixel_values.size(3)), dtype=torch.bool)
    else:
        pixel_attention_mask = pixel_attention_mask.view(batch_size * num_images, *pixel_attention_mask.shape[2:])
        pixel_attention_mask = pixel_attention_mask[real_images_inds].contiguous()

    patch_size = self.config.vision_config.patch_size
    patches_subgrid = pixel_attention_mask.unfold(dimension=1, size=patch_size, step=patch_size)
    patches_subgrid = patches_subgrid.unfold(dimension=2, size=patch_size, step=patch_size)
    if FIXED:
        patch_attention_mask = (patches_subgrid.sum(dim=(-1, -2)) == patch_size * patch_size).bool()
    else:
        patch_attention_mask = (patches_subgrid.sum(dim=(-1, -2)) > 0).bool()

    # Get sequence from the vision encoder
    image_hidden_states = self.vision_model(
        pixel_values=pixel_values, patch_attention_mask=patch_attention_mask).last_hidden_state
    # Modality projection & resampling
    image_hidden_states = self.connector(
        image_hidden_states, attention_mask=patch_attention_mask.view(pixel_values.size(0), -1))
    image_hidden_states = getattr(image_hidden_states, "last_hidden_state", image_hidden_states)
    return image_hidden_states


# the image processor pads every image of the batch to the largest one and returns pixel_attention_mask
small = torch.randn(3, 10, 14)   # 10x14 pixels: 2x3 whole patches, a border of partial patches
large = torch.randn(3, 24, 24)
pixel_values = torch.zeros(2, 1, 3, 24, 24)
pixel_attention_mask = torch.zeros(2, 1, 24, 24, dtype=torch.long)
pixel_values[0, 0, :, :10, :14] = small
pixel_attention_mask[0, 0, :10, :14] = 1
pixel_values[1, 0] = large
pixel_attention_mask[1, 0] = 1

with torch.no_grad():
    batched = get_image_features(model, pixel_values, pixel_attention_mask)
    alone = get_image_features(model, small[None, None])  # the same image, batch of one

print("mode:", "fixed" if FIXED else "buggy")
print("max |features(padded batch) - features(alone)| for the small image: %.4f" % (batched[0] - alone[0]).abs().max())
