"""GLM-4.1V (Glm4vForConditionalGeneration): images of different sizes packed into one
vision sequence (cu_seqlens per image, each image attended alone), their merged tokens
spliced into the text at <|image|> placeholders, 3-D M-RoPE positions counted over the
real tokens only, a left-padded batch generated greedily and a right-padded batch trained
with prompt and pads left out of the loss.

Uses huggingface/transformers (installed 5.25.0) as is, a tiny model built from its
config classes (no downloads):
  src/transformers/models/glm4v/image_processing_pil_glm4v.py
      (Glm4vImageProcessorPil.patchify -> pixel_values (sum of patches, C*T*p*p), image_grid_thw)
  src/transformers/models/glm4v/processing_glm4v.py
      (Glm4vProcessor.replace_image_token: grid.prod() // merge_size**2 image tokens per
       image; create_mm_token_type_ids: 1 on image tokens, 2 inside <|begin_of_video|>..)
  src/transformers/models/glm4v/modeling_glm4v.py
      (Glm4vVisionModel.forward -> get_vision_attention_seqlens, Glm4vVisionAttention
       split by cu_seqlens for eager / sdpa; Glm4vModel.get_rope_index with attention_mask,
       compute_3d_position_ids (rope_deltas on cached decode), get_placeholder_mask +
       masked_scatter; Glm4vForConditionalGeneration._prepare_position_ids_for_generation)
The batch is built the way Glm4vProcessor builds it (placeholders expanded per image grid,
mm_token_type_ids, the tokenizer's padding), left padding for generation and right padding
for the SFT step.

Checked, for the eager and the sdpa attention implementations, against each prompt run
alone with its own images only (no padding, mask of ones): the merged vision features of
every image, the logits of every real token, the scores of every generated step and the
greedy tokens, the SFT loss (token-weighted over the three rows); and the 3-D positions of
the padded batch against positions counted by hand from the GLM-4.1V layout (text +1 per
token; an image's merged h' x w' grid at (start, start + i, start + j), then start +=
max(h', w')).
"""
import numpy as np
import torch
from transformers import Glm4vConfig, Glm4vForConditionalGeneration
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

torch.set_num_threads(1)  # a tiny model: one thread is faster

# token ids of the tiny vocabulary (GLM-4.1V chat layout: [gMASK]<sop><|user|>\n ... <|assistant|>\n)
PAD, EOS, GMASK, SOP, USER, ASSISTANT, NL = 0, 1, 2, 3, 4, 5, 6
IMAGE, BOI, EOI, BOV, EOV, VIDEO = 70, 71, 72, 73, 74, 75
PATCH, MERGE, TPATCH = 4, 2, 2

config = Glm4vConfig(
    text_config=dict(vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD, initializer_range=0.2,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                          mrope_section=[2, 1, 1])),
    vision_config=dict(depth=2, hidden_size=32, num_heads=4, image_size=16, patch_size=PATCH,
                       spatial_merge_size=MERGE, temporal_patch_size=TPATCH, out_hidden_size=64,
                       intermediate_size=96, initializer_range=0.2),
    image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=BOI, image_end_token_id=EOI,
    video_start_token_id=BOV, video_end_token_id=EOV)

image_processor = Glm4vImageProcessorPil(patch_size=PATCH, temporal_patch_size=TPATCH, merge_size=MERGE,
                                         do_resize=False)
rng = np.random.RandomState(0)
# (H, W) pixels: patch grids 4x6, 2x4 and 6x2 -> 6, 2 and 3 merged tokens
images = [rng.randint(0, 256, (h, w, 3)).astype(np.uint8) for h, w in [(16, 24), (8, 16), (24, 8)]]

# one <|image|> per image in the chat text; the processor expands it per image grid
prompts = [
    ([GMASK, SOP, USER, NL, BOI, IMAGE, EOI, 10, 11, 12, ASSISTANT, NL], [0]),
    ([GMASK, SOP, USER, NL, 13, BOI, IMAGE, EOI, 14, BOI, IMAGE, EOI, 15, 16, ASSISTANT, NL], [1, 2]),
    ([GMASK, SOP, USER, NL, 17, 18, ASSISTANT, NL], []),
]
answers = [[20, 21, EOS], [22, EOS], [23, 24, 25, EOS]]


def image_inputs(imgs):
    out = image_processor(images=imgs, return_tensors="pt", input_data_format="channels_last")
    return out["pixel_values"], out["image_grid_thw"]


def replace_image_tokens(ids, grids):
    """Glm4vProcessor.__call__ / replace_image_token: grid.prod() // merge**2 tokens per image."""
    out, k = [], 0
    for t in ids:
        if t == IMAGE:
            out += [IMAGE] * int(grids[k].prod() // MERGE ** 2)
            k += 1
        else:
            out.append(t)
    return out


def create_mm_token_type_ids(ids):
    """Glm4vProcessor.create_mm_token_type_ids."""
    array_ids = np.array(ids)
    mm_token_types = np.zeros_like(array_ids)
    starts = np.cumsum(array_ids == BOV, axis=0)
    ends = np.cumsum(array_ids == EOV, axis=0)
    is_video_modality = starts > ends
    mm_token_types[(array_ids == IMAGE) & is_video_modality] = 2
    mm_token_types[(array_ids == IMAGE) & (~is_video_modality)] = 1
    return mm_token_types.tolist()


def pad(seqs, side, value):
    """The tokenizer's padding: (ids, attention_mask) with padding_side left or right."""
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), value, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(n - len(s), n) if side == "left" else slice(0, len(s))
        ids[i, sl] = torch.tensor(s)
        mask[i, sl] = 1
    return ids, mask


def hand_positions(ids, grids):
    """3-D positions counted by hand from the GLM-4.1V layout, for one unpadded row."""
    pos, cur, k, i = [], 0, 0, 0
    while i < len(ids):
        if ids[i] == IMAGE:
            _, h, w = (int(x) for x in grids[k])
            h, w = h // MERGE, w // MERGE
            for a in range(h):
                for b in range(w):
                    pos.append((cur, cur + a, cur + b))
            cur += max(h, w)
            i += h * w
            k += 1
        else:
            pos.append((cur, cur, cur))
            cur += 1
            i += 1
    return torch.tensor(pos, dtype=torch.long).T  # (3, len)


# the batch, as the processor builds it
batch_images = [images[j] for _, js in prompts for j in js]
pixel_values, image_grid_thw = image_inputs(batch_images)
seqs, row_grids, g = [], [], 0
for ids, js in prompts:
    row_grids.append(image_grid_thw[g:g + len(js)])
    seqs.append(replace_image_tokens(ids, row_grids[-1]))
    g += len(js)
print("prompt lengths", [len(s) for s in seqs], "grids", image_grid_thw.tolist())

GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None,
           output_scores=True, return_dict_in_generate=True)
TOL = 1e-4
ok = True

for impl in ["eager", "sdpa"]:
    torch.manual_seed(0)
    model = Glm4vForConditionalGeneration(config).eval()
    model.set_attn_implementation(impl)

    # ---- left-padded batch: prefill logits and greedy generation ----
    input_ids, attention_mask = pad(seqs, "left", PAD)
    mm_token_type_ids, _ = pad([create_mm_token_type_ids(s) for s in seqs], "left", 0)
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values, image_grid_thw).pooler_output
        position_ids, rope_deltas = model.model.get_rope_index(
            input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw, attention_mask=attention_mask)
        out = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                     image_grid_thw=image_grid_thw, mm_token_type_ids=mm_token_type_ids)
        gen = model.generate(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                             image_grid_thw=image_grid_thw, mm_token_type_ids=mm_token_type_ids, **GEN)
    new_tokens = gen.sequences[:, input_ids.shape[1]:]

    # ---- right-padded SFT batch: prompt and pads ignored in the labels ----
    full = [s + a for s, a in zip(seqs, answers)]
    labels_rows = [[-100] * len(s) + a for s, a in zip(seqs, answers)]
    sft_ids, sft_mask = pad(full, "right", PAD)
    sft_labels, _ = pad(labels_rows, "right", -100)
    sft_types, _ = pad([create_mm_token_type_ids(s) for s in full], "right", 0)
    with torch.no_grad():
        sft = model(input_ids=sft_ids, attention_mask=sft_mask, pixel_values=pixel_values,
                    image_grid_thw=image_grid_thw, mm_token_type_ids=sft_types, labels=sft_labels)

    # ---- references: each prompt alone, its own images only ----
    loss_sum, loss_n = 0.0, 0
    f = 0
    for i, (s, (_, js)) in enumerate(zip(seqs, prompts)):
        n = len(s)
        one = torch.tensor([s])
        one_mask = torch.ones_like(one)
        one_types = torch.tensor([create_mm_token_type_ids(s)])
        kw = {}
        if js:
            pv1, grid1 = image_inputs([images[j] for j in js])
            kw = dict(pixel_values=pv1, image_grid_thw=grid1)
        with torch.no_grad():
            ref = model(input_ids=one, attention_mask=one_mask, mm_token_type_ids=one_types, **kw)
            ref_gen = model.generate(input_ids=one, attention_mask=one_mask, mm_token_type_ids=one_types,
                                     **kw, **GEN)
            one_full = torch.tensor([full[i]])
            ref_sft = model(input_ids=one_full, attention_mask=torch.ones_like(one_full),
                            mm_token_type_ids=torch.tensor([create_mm_token_type_ids(full[i])]),
                            labels=torch.tensor([labels_rows[i]]), **kw)
            if js:
                ref_feat = model.model.get_image_features(pv1, grid1).pooler_output
                for k in range(len(js)):
                    d = (features[f + k] - ref_feat[k]).abs().max().item()
                    print(f"{impl} image {js[k]} features max diff {d:.2e}")
                    ok &= d < TOL
                f += len(js)
        loss_sum += ref_sft.loss.item() * len(answers[i])
        loss_n += len(answers[i])

        d_logits = (out.logits[i, -n:] - ref.logits[0]).abs().max().item()
        d_scores = max((a[i] - b[0]).abs().max().item() for a, b in zip(gen.scores, ref_gen.scores))
        same = new_tokens[i].tolist() == ref_gen.sequences[0, n:].tolist()
        d_sft = (sft.logits[i, :len(full[i])] - ref_sft.logits[0]).abs().max().item()
        hp = hand_positions(s, row_grids[i])
        pos_ok = torch.equal(position_ids[:, i, -n:], hp)
        delta_ok = rope_deltas[i, 0].item() == hp.max().item() + 1 - n
        print(f"{impl} row {i}: prefill logits {d_logits:.2e}, step scores {d_scores:.2e}, "
              f"tokens {new_tokens[i].tolist()} same={same}, sft logits {d_sft:.2e}, "
              f"positions by hand {pos_ok}, rope delta {rope_deltas[i, 0].item()} {delta_ok}")
        ok &= d_logits < TOL and d_scores < TOL and same and d_sft < TOL and pos_ok and delta_ok
    ref_loss = loss_sum / loss_n
    print(f"{impl} sft loss batch {sft.loss.item():.6f} per-row weighted {ref_loss:.6f}")
    ok &= abs(sft.loss.item() - ref_loss) < TOL

assert ok, "batched GLM-4V run differs from the per-prompt runs"
print("OK")
