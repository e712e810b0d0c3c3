# Correct program (quiet batch quiet-r93a).
# Citation: huggingface/transformers v5.25.0 (installed release)
#   src/transformers/models/idefics3/modeling_idefics3.py: Idefics3Model.get_image_features (padding images
#   dropped where all pixels are 0, pixel_attention_mask unfolded into patch_size x patch_size subgrids,
#   patch_attention_mask = any pixel real), Idefics3VisionEmbeddings.forward (fractional patch coordinates
#   bucketized per image from its own nb_patches_h / nb_patches_w), Idefics3VisionTransformer.forward
#   (create_bidirectional_mask over the flattened patch_attention_mask); the image processor's layout
#   (pixel_values (batch, max_num_images, 3, max_h, max_w) zero-padded bottom-right, pixel_attention_mask 1 on
#   the real pixels; SmolVLM / Idefics3 batches).
# Images of different sizes in one batch are padded to the largest height and width; each sample's missing
# images are all-zero slots. Checked here: for every real image, the vision tower's hidden states on its real
# patches equal the image run alone at its own size with no mask, and the padding image slots are dropped.
import torch
from transformers import Idefics3Config, Idefics3Model

torch.manual_seed(0)

PATCH = 4
config = Idefics3Config(
    vision_config=dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_channels=3,
        image_size=32,
        patch_size=PATCH,
    ),
    text_config=dict(
        model_type="llama",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=0,
    ),
    scale_factor=2,
    image_token_id=100,
)
config._attn_implementation = "sdpa"
config.vision_config._attn_implementation = "sdpa"
config.text_config._attn_implementation = "sdpa"
model = Idefics3Model(config).eval()

# sample 0 has two images, sample 1 has three (sizes are multiples of the patch size)
sizes = [[(16, 24), (8, 8)], [(24, 16), (32, 32), (8, 20)]]
images = [[torch.rand(3, h, w) + 0.1 for h, w in s] for s in sizes]

# the image processor's batch layout: zero padding bottom-right, padding images all zero
max_num_images = max(len(s) for s in images)
max_h = max(img.shape[1] for s in images for img in s)
max_w = max(img.shape[2] for s in images for img in s)
pixel_values = torch.zeros(len(images), max_num_images, 3, max_h, max_w)
pixel_attention_mask = torch.zeros(len(images), max_num_images, max_h, max_w, dtype=torch.long)
for b, sample in enumerate(images):
    for i, img in enumerate(sample):
        _, h, w = img.shape
        pixel_values[b, i, :, :h, :w] = img
        pixel_attention_mask[b, i, :h, :w] = 1

with torch.no_grad():
    out = model.get_image_features(pixel_values=pixel_values, pixel_attention_mask=pixel_attention_mask)
    hidden = out.last_hidden_state  # (num_real_images, (max_h / P) * (max_w / P), d)

    real = [img for sample in images for img in sample]
    assert hidden.shape[0] == len(real), hidden.shape
    grid_h, grid_w = max_h // PATCH, max_w // PATCH
    for k, img in enumerate(real):
        _, h, w = img.shape
        alone = model.vision_model(pixel_values=img[None]).last_hidden_state[0]
        batched = hidden[k].view(grid_h, grid_w, -1)[: h // PATCH, : w // PATCH].reshape(-1, hidden.shape[-1])
        torch.testing.assert_close(batched, alone, atol=1e-4, rtol=1e-4)

    # per-sample feature lists keep each sample's own images only
    assert [len(f) for f in out.pooler_output] == [
        len(s) * (grid_h * grid_w) // (config.scale_factor**2) for s in images
    ]

print("idefics3 padded image batch: real patches match each image run alone")
