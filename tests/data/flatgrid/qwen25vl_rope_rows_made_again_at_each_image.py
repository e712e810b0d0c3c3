"""ms-swift 48fb0a9 (HunYuanVL's rope rows made again for each image) written another way: a Qwen2.5-VL collator that
builds the (3, B, L) rope ids itself, one sample's images in turn, and starts the three rows afresh from the text
positions at every image, so only each sample's last image keeps its (t, h, w) grid; the first is numbered as text in
all three rows. `--fixed` builds the rows once and lays every image on its grid (the model's get_rope_index gives the
same ids). Tiny config, random weights, CPU.
"""

import sys

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, IMAGE, VIDEO, START, END = 0, 5, 6, 3, 4
config = Qwen2_5_VLConfig(
    text_config=dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256,
                     rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]},
                     pad_token_id=PAD, bos_token_id=1, eos_token_id=2),
    vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, in_channels=3,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                       fullatt_block_indexes=[0]),
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
)
config._attn_implementation = "sdpa"
model = Qwen2_5_VLForConditionalGeneration(config).eval()


def sample(text_before, grid, text_after):
    t, h, w = grid
    n_image = t * h * w // 4  # (merge 2 x 2)
    ids = [*text_before, START, *[IMAGE] * n_image, END, *text_after]
    return ids, torch.randn(t * h * w, 3 * 2 * 14 * 14)


two = sample([10, 11], (1, 4, 6), [12]), sample([13], (1, 4, 4), [14, 15])
samples = [(two[0][0] + two[1][0], torch.cat([two[0][1], two[1][1]])), sample([15], (1, 4, 4), [16, 17, 18, 19, 20, 21])]
length = max(len(ids) for ids, _ in samples)
input_ids = torch.tensor([ids + [PAD] * (length - len(ids)) for ids, _ in samples])
attention_mask = (input_ids != PAD).long()
pixel_values = torch.cat([pixels for _, pixels in samples])
image_grid_thw = torch.tensor([[1, 4, 6], [1, 4, 4], [1, 4, 4]])
mm_token_type_ids = (input_ids == IMAGE).long()
labels = input_ids.masked_fill(attention_mask == 0, -100)


def rope_ids(ids, grids):
    """(3, L) rope rows of one sample: text counts on in all three, an image's merged tokens on their (t, h, w) grid."""
    rows = torch.arange(len(ids)).expand(3, -1).clone()
    at, next_pos, images = 0, 0, iter(grids)
    while at < len(ids):
        if ids[at] == IMAGE:
            t, h, w = next(images)
            h, w = h // 2, w // 2
            if not FIXED:  # (the bug: the rows made afresh from the text positions at every image)
                rows = torch.arange(len(ids)).expand(3, -1).clone()
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")).reshape(3, -1)
            rows[:, at:at + t * h * w] = grid + next_pos
            next_pos += max(t, h, w)
            at += t * h * w
            rows[:, at:] = torch.arange(len(ids) - at) + next_pos
        else:
            rows[:, at] = next_pos
            next_pos += 1
            at += 1
    return rows


grids = [[(1, 4, 6), (1, 4, 4)], [(1, 4, 4)]]
position_ids = torch.stack([rope_ids(row.tolist(), g) for row, g in zip(input_ids, grids)], dim=1)
with torch.no_grad():
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, pixel_values=pixel_values,
                image_grid_thw=image_grid_thw, mm_token_type_ids=mm_token_type_ids, labels=labels)
print(f"loss {out.loss.item():.6f}")
