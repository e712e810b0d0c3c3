"""transformers' own Qwen2.5-VL vision tower (random weights, tiny config) with its window index replaced by a port's
that returns whole images: every windowed block attends over the whole image, as the full block does.

The config states window_size=112 over patch_size=14 (8 x 8 = 64 patches a window); a 16 x 16-patch image has four.
--fixed: transformers' own get_window_index. --one: an 8 x 8-patch image, one window (both kinds rightly see it all).
"""
import sys

import torch
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

FIXED = "--fixed" in sys.argv


def whole_images(grid_thw, spatial_merge_size, window_size, patch_size, kwargs=None):
    """The port's window index: tokens in their order, one window per image."""
    sizes = grid_thw.prod(-1)
    first = torch.zeros(1, dtype=torch.int32)
    return torch.arange(int(sizes.sum()) // spatial_merge_size ** 2), torch.cat([first, sizes.cumsum(0).int()])


def main():
    cfg = Qwen2_5_VLVisionConfig(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                                 fullatt_block_indexes=[2], in_channels=3)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel(cfg).eval()
    original = modeling_qwen2_5_vl.get_vision_window_index
    if not FIXED:
        modeling_qwen2_5_vl.get_vision_window_index = whole_images
    grid = torch.tensor([[1, 8, 8]] if "--one" in sys.argv else [[1, 16, 16]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    try:
        with torch.no_grad():
            out = tower(pixels, grid_thw=grid)
    finally:  # (transformers' own again for whatever runs next in this process)
        modeling_qwen2_5_vl.get_vision_window_index = original
    print("pooled", tuple(out.pooler_output.shape))


if __name__ == "__main__":
    main()
