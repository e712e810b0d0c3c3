# Correct program (quiet batch quiet-r164a).
# Citation: huggingface/transformers v5.25.0 (installed release) src/transformers/models/molmo2/:
#   image_processing_molmo2.py (compute_crop_geometry, _build_overlapping_crops, arange_for_pooling: pooling
#   windows padded with -1, low-res view first, then the overlapping high-res crops), processing_molmo2.py
#   (replace_image_token: <low_res_im_start> (<im_patch>*w <im_col>)*h <im_end> <im_start> ... <im_end>;
#   mm_token_type_ids = 1 on every image-structure token), modeling_molmo2.py (Molmo2Adapter.forward: a
#   cross-attention pool per output token under create_bidirectional_mask(valid_mask), -1 slots dropped;
#   Molmo2Model.forward: pooled features added onto the <im_patch> embeddings, block_sequence_ids = 0 on image
#   tokens / -1 elsewhere at prefill so all image tokens of a row see each other, causal elsewhere;
#   prepare_inputs_for_generation / create_masks_for_generate: no block overlay on one-token decode steps).
# Molmo2 batched inference: three chats (two images of different crop tilings, one text-only) are left padded
# into one batch and decoded greedily over the KV cache. Generation builds position_ids from the attention_mask.
# Checked here: every real position's prefill logits, each cached step's scores and the greedy tokens equal each
# chat run alone, unpadded and uncached, through a reference written by hand (the ViT, the adapter's pooling over
# the valid patches only, decoder attention by a double loop: key j <= query i, or both are image tokens).
import torch
import torch.nn.functional as F
from transformers import Molmo2Config, Molmo2ForConditionalGeneration
from transformers.models.molmo2.image_processing_molmo2 import (
    arange_for_pooling,
    batch_pixels_to_patches,
    compute_crop_geometry,
)

torch.manual_seed(0)
torch.set_num_threads(1)

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
VOCAB = 100
IM_START, IM_END, IM_PATCH, IM_COL, LOW_RES_IM_START, FRAME_START, FRAME_END, IM_LOW = range(100, 108)
IMAGE_STRUCTURE_IDS = [IM_PATCH, IM_COL, IM_START, LOW_RES_IM_START, FRAME_START, IM_END, FRAME_END, IM_LOW]

CROP_SIZE = 42  # Molmo2ImageProcessor size {"height": 42, "width": 42}
PATCH = 14
MAX_CROPS = 3
OVERLAP_MARGINS = [1, 1]
POOLING = [2, 2]
MAX_NEW_TOKENS = 5

config = Molmo2Config(
    vision_config=dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        image_size=[CROP_SIZE, CROP_SIZE],
        patch_size=PATCH,
    ),
    adapter_config=dict(
        vision_feature_layer=[-1, 0],
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        text_hidden_size=64,
    ),
    text_config=dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        additional_vocab_size=12,
        num_hidden_layers=2,
        intermediate_size=128,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        rope_scaling_layers=[0],
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    ),
    image_start_token_id=IM_START,
    low_res_image_start_token_id=LOW_RES_IM_START,
    image_end_token_id=IM_END,
    image_patch_id=IM_PATCH,
    frame_start_token_id=FRAME_START,
    frame_end_token_id=FRAME_END,
)
model = Molmo2ForConditionalGeneration(config).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if p.dim() > 1:
            p.normal_(0.0, 0.3 if "embed" in name or "lm_head" in name else 0.12)
        elif "norm" in name:
            p.uniform_(0.8, 1.2)
        else:
            p.normal_(0.0, 0.05)


def preprocess_image(image):
    """Molmo2ImageProcessor._image_batch_to_patches_and_grids for one image; the backend's resize is bilinear
    F.interpolate and the image arrives normalized."""
    _, height, width = image.shape
    left_margin, right_margin = OVERLAP_MARGINS
    crop_patches = CROP_SIZE // PATCH
    window_size = (crop_patches - left_margin - right_margin) * PATCH
    tiling_h, tiling_w, canvas_h, canvas_w = compute_crop_geometry(
        height, width, max_crops=MAX_CROPS, overlap_margins=OVERLAP_MARGINS, crop_size=CROP_SIZE, patch_size=PATCH
    )
    canvas = F.interpolate(image[None], size=(canvas_h, canvas_w), mode="bilinear", align_corners=False)
    crops = canvas.unfold(2, CROP_SIZE, window_size).unfold(3, CROP_SIZE, window_size)
    crops = crops.permute(0, 2, 3, 4, 5, 1).reshape(tiling_h * tiling_w, CROP_SIZE, CROP_SIZE, 3)

    patch_index_grid = torch.arange(tiling_h * tiling_w * crop_patches * crop_patches, dtype=torch.int32).reshape(
        tiling_h, tiling_w, crop_patches, crop_patches
    )
    patch_index_grid[1:, :, :left_margin, :] = -1
    patch_index_grid[:, 1:, :, :left_margin] = -1
    patch_index_grid[:-1, :, -right_margin:, :] = -1
    patch_index_grid[:, :-1, :, -right_margin:] = -1
    patch_index_grid = patch_index_grid.permute(0, 2, 1, 3).reshape(-1)
    patch_index_grid = patch_index_grid[patch_index_grid >= 0].reshape(canvas_h // PATCH, canvas_w // PATCH)
    pooling_indices, rows, cols = arange_for_pooling(patch_index_grid, *POOLING)

    resized = F.interpolate(image[None], size=(CROP_SIZE, CROP_SIZE), mode="bilinear", align_corners=False)
    resized = resized.permute(0, 2, 3, 1)
    resized_grid = torch.arange(crop_patches**2, dtype=torch.int32).reshape(crop_patches, crop_patches)
    resized_pooling, resized_h, resized_w = arange_for_pooling(resized_grid, *POOLING)

    patches_per_crop = crop_patches**2
    pooling_indices = torch.where(pooling_indices >= 0, pooling_indices + patches_per_crop, -1)
    pooling_indices = torch.cat([resized_pooling, pooling_indices])
    all_crops = torch.cat([resized, crops], dim=0)
    patches = batch_pixels_to_patches(all_crops, PATCH)
    grid = torch.tensor([resized_h, resized_w, rows, cols])
    return patches, pooling_indices.long(), grid


def image_tokens(grid):
    """Molmo2Processor.replace_image_token (image_use_col_tokens, use_single_crop_start_token)."""
    resized_h, resized_w, height, width = grid.tolist()
    low = [LOW_RES_IM_START] + ([IM_PATCH] * resized_w + [IM_COL]) * resized_h + [IM_END]
    high = [IM_START] + ([IM_PATCH] * width + [IM_COL]) * height + [IM_END]
    return low + high


images = {
    0: torch.randn(3, 36, 90),  # tiling 1 x 3
    1: torch.randn(3, 33, 30),  # tiling 1 x 1
}
chats = [
    ([BOS_ID, 11, 12], 0, [13, 14, 15, 16]),
    ([BOS_ID, 21], 1, [22, 23]),
    ([BOS_ID, 31, 32, 33, 34, 35], None, [36, 37]),
]

rows, pixel_values, pooling, grids, num_crops, row_images = [], [], [], [], [], []
for before, img, after in chats:
    ids = list(before)
    if img is not None:
        patches, pool, grid = preprocess_image(images[img])
        ids += image_tokens(grid)
        pixel_values.append(patches)
        pooling.append(pool)
        grids.append(grid)
        num_crops.append(patches.shape[0])
        row_images.append((patches, pool, grid))
    else:
        row_images.append(None)
    rows.append(ids + list(after))

seq_len = max(len(r) for r in rows)
input_ids = torch.full((len(rows), seq_len), PAD_ID)
attention_mask = torch.zeros((len(rows), seq_len), dtype=torch.long)
for b, r in enumerate(rows):  # padding_side="left"
    input_ids[b, seq_len - len(r) :] = torch.tensor(r)
    attention_mask[b, seq_len - len(r) :] = 1
mm_token_type_ids = (torch.isin(input_ids, torch.tensor(IMAGE_STRUCTURE_IDS)) & attention_mask.bool()).long()
inputs = dict(
    input_ids=input_ids,
    attention_mask=attention_mask,
    mm_token_type_ids=mm_token_type_ids,
    pixel_values=torch.cat(pixel_values),
    image_token_pooling=torch.cat(pooling),
    image_grids=torch.stack(grids),
    image_num_crops=torch.tensor(num_crops),
)


# ---------------------------------------------------------------- reference written by hand
def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_image_features(patches, pool):
    vt, vc = model.model.vision_tower, config.vision_config
    heads, hd = vc.num_attention_heads, vc.head_dim
    x = vt.patch_embedding(patches) + vt.positional_embedding
    hidden = [x]
    for layer in vt.layers:  # no mask in the ViT: each crop's patches all see each other
        a = layer.self_attn
        y = F.layer_norm(x, (vc.hidden_size,), layer.layer_norm1.weight, layer.layer_norm1.bias, vc.layer_norm_eps)
        q, k, v = (p(y).view(*y.shape[:2], heads, hd) for p in (a.q_proj, a.k_proj, a.v_proj))
        w = torch.softmax(torch.einsum("cqhd,ckhd->chqk", q, k) * hd**-0.5, -1)
        x = x + a.o_proj(torch.einsum("chqk,ckhd->cqhd", w, v).reshape(*y.shape[:2], -1))
        y = F.layer_norm(x, (vc.hidden_size,), layer.layer_norm2.weight, layer.layer_norm2.bias, vc.layer_norm_eps)
        x = x + layer.mlp.fc2(F.gelu(layer.mlp.fc1(y), approximate="tanh"))
        hidden.append(x)
    layers = config.adapter_config.vision_feature_layer
    feats = torch.cat([hidden[l + 1 if l >= 0 else l] for l in layers], -1).reshape(-1, 64)
    adapter = model.model.multi_modal_projector
    att = adapter.image_pooling_2d
    heads, hd = config.adapter_config.num_attention_heads, config.adapter_config.head_dim
    out = []
    for slots in pool.tolist():
        valid = [s for s in slots if s >= 0]
        if not valid:
            continue
        kv = feats[valid]  # only the valid patches
        query = kv.sum(0) / len(valid)
        q = att.q_proj(query).view(heads, hd)
        k = att.k_proj(kv).view(len(valid), heads, hd)
        v = att.v_proj(kv).view(len(valid), heads, hd)
        o = torch.stack([torch.softmax(k[:, h] @ q[h] * hd**-0.5, 0) @ v[:, h] for h in range(heads)])
        out.append(adapter.image_projector(att.o_proj(o.reshape(-1))))
    return torch.stack(out)


def ref_logits(ids, img_feats):
    tc = config.text_config
    lm = model.model.language_model
    n = len(ids)
    ids_t = torch.tensor(ids)
    h = lm.embed_tokens(ids_t)
    if img_feats is not None:
        h = h.clone()
        h[ids_t == IM_PATCH] += img_feats
    is_img = [t in IMAGE_STRUCTURE_IDS for t in ids]
    allowed = torch.tensor([[j <= i or (is_img[i] and is_img[j]) for j in range(n)] for i in range(n)])
    hd, nh, nkv = tc.head_dim, tc.num_attention_heads, tc.num_key_value_heads
    pos = torch.arange(n, dtype=torch.float)
    for li, layer in enumerate(lm.layers):
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        if li in tc.rope_scaling_layers:
            inv_freq = inv_freq / 2.0
        ang = torch.cat([pos[:, None] * inv_freq] * 2, -1)
        cos, sin = ang.cos(), ang.sin()

        def rope(x):
            x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
            return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

        a = layer.self_attn
        x = rms(h, layer.input_layernorm.weight, tc.rms_norm_eps)
        q = rope(rms(a.q_proj(x).view(n, nh, hd), a.q_norm.weight, tc.rms_norm_eps))
        k = rope(rms(a.k_proj(x).view(n, nkv, hd), a.k_norm.weight, tc.rms_norm_eps))
        v = a.v_proj(x).view(n, nkv, hd)
        o = torch.zeros(n, nh, hd)
        for head in range(nh):
            g = head // (nh // nkv)
            s = (q[:, head] @ k[:, g].T) * hd**-0.5
            s = s.masked_fill(~allowed, float("-inf"))
            o[:, head] = torch.softmax(s, -1) @ v[:, g]
        h = h + a.o_proj(o.reshape(n, -1))
        h = h + layer.mlp(rms(h, layer.post_attention_layernorm.weight, tc.rms_norm_eps))
    return model.lm_head(rms(h, lm.norm.weight, tc.rms_norm_eps))


with torch.no_grad():
    ref_prefill, ref_steps, ref_tokens = [], [], []
    for b, ids in enumerate(rows):
        feats = None if row_images[b] is None else ref_image_features(*row_images[b][:2])
        ids = list(ids)
        steps = []
        logits = ref_logits(ids, feats)
        ref_prefill.append(logits)
        for _ in range(MAX_NEW_TOKENS):  # greedy, no cache: the whole chat again each step
            steps.append(logits[-1])
            ids.append(int(logits[-1].masked_fill(torch.arange(VOCAB) == EOS_ID, float("-inf")).argmax()))
            logits = ref_logits(ids, feats)
        ref_steps.append(torch.stack(steps))
        ref_tokens.append(ids[len(rows[b]) :])

    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        out = model(**inputs)
        for b, r in enumerate(rows):
            real = out.logits[b, seq_len - len(r) :]
            err = (real - ref_prefill[b]).abs().max().item()
            assert err < 1e-4, (impl, b, err)

        gen = model.generate(
            **inputs,
            max_new_tokens=MAX_NEW_TOKENS,
            min_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            return_dict_in_generate=True,
            output_scores=True,
        )
        scores = torch.stack(gen.scores, 1)
        for b in range(len(rows)):
            new = gen.sequences[b, seq_len:].tolist()
            assert new == ref_tokens[b], (impl, b, new, ref_tokens[b])
            finite = torch.isfinite(scores[b])  # min_new_tokens sets eos to -inf in the scores
            err = (scores[b][finite] - ref_steps[b][finite]).abs().max().item()
            assert err < 1e-4, (impl, b, err)
        print(impl, "tokens", gen.sequences[:, seq_len:].tolist())

print("prompt lengths", [len(r) for r in rows], "image tokens", mm_token_type_ids.sum(-1).tolist())
print("ok: left-padded batched Molmo2 prefill, cached greedy decode equal each chat alone")
