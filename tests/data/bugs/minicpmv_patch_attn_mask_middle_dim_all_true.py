"""MiniCPM-V get_vllm_embedding: patch_attn_mask filled along its size-1 axis, so it is all True (MiniCPM-V#274).

Citation: OpenBMB/MiniCPM-V#274 ("[BUG] get_vllm_embedding中的patch_attn_mask计算有问题") and the
duplicate OpenBMB/MiniCPM-V#322 ("finetune代码中patch_attn_mask是不是写错了，运行后全为True了"),
both closed; #322 quotes the buggy line in MiniCPM-Llama3-V-2_5's modeling_minicpmv.py and the
corrected one. I read the issue threads; I did not find the commit that changed the Hub file,
so the fixed line below is the one the issue gives (and later MiniCPM-V releases carry).

Bug: for a batch of image slices of different patch counts, the vision input is padded to
``max_patches`` and ``patch_attn_mask = torch.zeros((B, 1, max_patches), dtype=torch.bool)`` is
filled with ``patch_attn_mask[i, :tgt_sizes[i][0] * tgt_sizes[i][1]] = True``: the slice hits
the size-1 middle axis, so every row becomes all True and the SigLIP/Idefics2 vision encoder
attends to the zero-padded patches of the shorter slices.

Fix: ``patch_attn_mask[i, 0, :tgt_sizes[i][0] * tgt_sizes[i][1]] = True``.

Reproduction: the batch_vision_input branch of ``MiniCPMV.get_vllm_embedding`` feeding an
Idefics2VisionTransformer built from an Idefics2VisionConfig with random weights (MiniCPM-V
2.5's vpm is that SigLIP-NaViT encoder), SDPA attention, two slices of 2x3 and 1x4 patches
(``tgt_sizes``) as the image processor's reshape_by_patch lays them out. The resampler that
follows is left out.
"""
import sys
from types import SimpleNamespace

import torch
from torch import nn
from transformers import Idefics2Config
from transformers.models.idefics2.modeling_idefics2 import Idefics2VisionTransformer

FIXED = "--fixed" in sys.argv

PATCH = 14


def reshape_by_patch(image, patch_size=PATCH):
    """(3, H, W) -> (3, patch_size, H*W/patch_size), patches laid out one after another."""
    patches = torch.nn.functional.unfold(image, (patch_size, patch_size), stride=(patch_size, patch_size))
    patches = patches.reshape(image.size(0), patch_size, patch_size, -1)
    patches = patches.permute(0, 1, 3, 2).reshape(image.size(0), patch_size, -1)
    return patches


class MiniCPMV(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.vpm = Idefics2VisionTransformer(config.vision_config)

    def get_vllm_embedding(self, data):
        dtype = self.vpm.embeddings.position_embedding.weight.dtype
        device = self.vpm.embeddings.position_embedding.weight.device
        tgt_sizes = data['tgt_sizes']
        pixel_values_list = data['pixel_values']
        all_pixel_values = []
        img_cnt = []
        for pixel_values in pixel_values_list:
            img_cnt.append(len(pixel_values))
            all_pixel_values.extend([i.flatten(end_dim=1).permute(1, 0) for i in pixel_values])

        # exist image
        if all_pixel_values:
            tgt_sizes = torch.vstack(tgt_sizes).type(torch.int32)
            if self.config.batch_vision_input:
                max_patches = torch.max(tgt_sizes[:, 0] * tgt_sizes[:, 1])
                all_pixel_values = torch.nn.utils.rnn.pad_sequence(all_pixel_values, batch_first=True,
                                                                   padding_value=0.0)
                B, L, _ = all_pixel_values.shape
                all_pixel_values = all_pixel_values.permute(0, 2, 1).reshape(B, 3, -1, L)

                patch_attn_mask = torch.zeros((B, 1, max_patches), dtype=torch.bool, device=device)
                for i in range(B):
                    if FIXED:
                        patch_attn_mask[i, 0, :tgt_sizes[i][0] * tgt_sizes[i][1]] = True
                    else:
                        patch_attn_mask[i, :tgt_sizes[i][0] * tgt_sizes[i][1]] = True

                vision_embedding = self.vpm(all_pixel_values.type(dtype),
                                            patch_attention_mask=patch_attn_mask).last_hidden_state
                return vision_embedding, patch_attn_mask


def main():
    torch.manual_seed(0)
    config = Idefics2Config(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, image_size=4 * PATCH, patch_size=PATCH))
    config.vision_config._attn_implementation = "sdpa"
    config = SimpleNamespace(vision_config=config.vision_config, batch_vision_input=True)
    model = MiniCPMV(config).eval()

    slice_a = torch.randn(3, 2 * PATCH, 3 * PATCH)  # 2 x 3 patches
    slice_b = torch.randn(3, 1 * PATCH, 4 * PATCH)  # 1 x 4 patches
    data = {
        "pixel_values": [[reshape_by_patch(slice_a)], [reshape_by_patch(slice_b)]],
        "tgt_sizes": [torch.tensor([[2, 3]]), torch.tensor([[1, 4]])],
    }
    with torch.no_grad():
        vision_embedding, patch_attn_mask = model.get_vllm_embedding(data)
    print("vision_embedding", tuple(vision_embedding.shape), "patches kept per slice",
          patch_attn_mask.sum((1, 2)).tolist(), "slice1 patch0 sum", round(float(vision_embedding[1, 0, :8].sum()), 4))


if __name__ == "__main__":
    main()
