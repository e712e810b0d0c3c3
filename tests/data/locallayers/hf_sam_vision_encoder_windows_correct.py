# Correct: transformers' own SAM image encoder (a tiny random SamVisionModel) whose config puts layers 1 and 3 in
# global_attn_indexes and windows the others (window_size 4 on an 8x8 patch grid: 4 windows of 16 patches, two images
# in the batch): its windowed layers attend within their windows. --fixed runs the same.
import torch
from transformers import SamVisionConfig, SamVisionModel

torch.manual_seed(0)
config = SamVisionConfig(hidden_size=32, output_channels=16, num_hidden_layers=4, num_attention_heads=2, mlp_dim=64,
                         image_size=64, patch_size=8, window_size=4, global_attn_indexes=[1, 3])
model = SamVisionModel(config).eval()
with torch.no_grad():
    out = model(torch.randn(2, 3, 64, 64))
print(tuple(out.last_hidden_state.shape))
