"""SigLIP2 NaFlex: images of different aspect ratios patchified and padded to
max_num_patches, a per-image pixel_attention_mask driving the encoder's
bidirectional key mask, the MAP probe's key_padding_mask, and the classifier's
masked mean pool.

Uses huggingface/transformers (installed 5.25.0) as is, tiny models built from
config classes (no downloads):
  src/transformers/models/siglip2/image_processing_pil_siglip2.py
      (convert_image_to_patches, pad_along_first_dim -> pixel_attention_mask)
  src/transformers/models/siglip2/modeling_siglip2.py
      (Siglip2VisionEmbeddings.resize_positional_embeddings,
       Siglip2VisionModel.forward -> create_bidirectional_mask,
       Siglip2MultiheadAttentionPoolingHead key_padding_mask = ~mask.bool(),
       Siglip2ForImageClassification masked mean pool)
Checked against each image run alone on its own patches only (no padding, mask
of ones), for the eager and the sdpa attention implementations.
"""
import torch
from transformers import Siglip2Config, Siglip2VisionConfig, Siglip2TextConfig
from transformers import Siglip2VisionModel, Siglip2ForImageClassification
import numpy as np
from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil

torch.manual_seed(0)

PATCH, MAX_PATCHES = 4, 16
proc = Siglip2ImageProcessorPil(patch_size=PATCH, max_num_patches=MAX_PATCHES, do_resize=False)

# three images, (H, W) in pixels: 2x3, 4x4 and 1x5 patches
rng = np.random.RandomState(0)
images = [rng.randint(0, 256, (h, w, 3)).astype(np.uint8) for h, w in [(8, 12), (16, 16), (4, 20)]]
batch = proc(images=images, return_tensors="pt", input_data_format="channels_last")
pv, pmask, shapes = batch["pixel_values"], batch["pixel_attention_mask"], batch["spatial_shapes"]
print("pixel_values", tuple(pv.shape), "mask rows", pmask.sum(-1).tolist(), "shapes", shapes.tolist())
n_valid = (shapes[:, 0] * shapes[:, 1]).tolist()
assert pmask.sum(-1).tolist() == n_valid

vcfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_channels=3, patch_size=PATCH, num_patches=16)

ok_all = True
for impl in ["eager", "sdpa"]:
    torch.manual_seed(1)
    vis = Siglip2VisionModel(Siglip2VisionConfig(**vcfg, attn_implementation=impl)).eval()
    torch.manual_seed(2)
    cfg = Siglip2Config(text_config=Siglip2TextConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=1, num_attention_heads=4,
                                                      pad_token_id=0, bos_token_id=1, eos_token_id=2),
                        vision_config=Siglip2VisionConfig(**vcfg), num_labels=5)
    cfg._attn_implementation = impl
    clf = Siglip2ForImageClassification(cfg).eval()
    with torch.no_grad():
        out = vis(pixel_values=pv, pixel_attention_mask=pmask, spatial_shapes=shapes)
        logits = clf(pixel_values=pv, pixel_attention_mask=pmask, spatial_shapes=shapes).logits
        for b, n in enumerate(n_valid):
            # reference: this image alone, only its n real patches, nothing to mask
            one_pv = pv[b:b + 1, :n]
            one_mask = torch.ones(1, n, dtype=pmask.dtype)
            ref = vis(pixel_values=one_pv, pixel_attention_mask=one_mask, spatial_shapes=shapes[b:b + 1])
            ref_logits = clf(pixel_values=one_pv, pixel_attention_mask=one_mask,
                             spatial_shapes=shapes[b:b + 1]).logits
            ok_h = torch.allclose(out.last_hidden_state[b, :n], ref.last_hidden_state[0], atol=1e-5)
            ok_p = torch.allclose(out.pooler_output[b], ref.pooler_output[0], atol=1e-5)
            ok_l = torch.allclose(logits[b], ref_logits[0], atol=1e-5)
            print(f"{impl} image {b} ({n} patches): tokens={ok_h} map_pool={ok_p} cls_logits={ok_l}")
            ok_all &= ok_h and ok_p and ok_l

print("ALL MATCH" if ok_all else "MISMATCH")
assert ok_all
