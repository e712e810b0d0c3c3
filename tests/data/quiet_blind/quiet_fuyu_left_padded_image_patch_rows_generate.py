# Correct program (quiet batch quiet-r93a).
# Citation: huggingface/transformers v5.25.0 (installed release)
#   src/transformers/models/fuyu/processing_fuyu.py (FuyuProcessor.__call__: image placeholder rows
#   `|SPEAKER|` * row_width + `|NEWLINE|`, then `<s>`, the prompt and the beginning-of-answer token; the batch
#   is "always" padded on the left with pad id 0 and an attention_mask), image_processing_fuyu.py
#   (patchify_image), modeling_fuyu.py (FuyuModel.forward: vision_embed_tokens over the flat patches,
#   masked_scatter into the placeholder positions, Persimmon decoder under the 2-D attention_mask).
# Fuyu has no vision tower: each image patch is one linear-projected token placed inline in the causal text
# stream. Images of different sizes give prompts of different lengths, so the processor left-pads the batch.
# Checked here: logits at real positions equal each prompt run alone (no padding, no mask), the loss over the
# answer tokens equals a per-token double loop, and cached greedy generation equals a no-cache loop per prompt.
import math
import sys

import torch
import torch.nn.functional as F
from transformers import FuyuConfig, FuyuForCausalLM, PersimmonConfig

torch.manual_seed(0)

PAD_ID = 0
BOS_ID = 1
BOA_ID = 3  # "\x04", Fuyu's BEGINNING_OF_ANSWER_STRING
IMAGE_TOKEN_ID = 100  # |SPEAKER|
NEWLINE_ID = 101  # |NEWLINE|
PATCH = 4
CHANNELS = 3

text_config = PersimmonConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=2,
)
config = FuyuConfig(
    text_config=text_config.to_dict(),
    patch_size=PATCH,
    num_channels=CHANNELS,
    image_token_id=IMAGE_TOKEN_ID,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=2,
)
config._attn_implementation = "sdpa"
model = FuyuForCausalLM(config).eval()


def patchify_image(image, patch_height=PATCH, patch_width=PATCH):
    # FuyuImageProcessor.patchify_image
    batch_size, channels, _, _ = image.shape
    unfolded_along_height = image.unfold(2, patch_height, patch_height)
    patches = unfolded_along_height.unfold(3, patch_width, patch_width)
    patches = patches.contiguous()
    patches = patches.view(batch_size, channels, -1, patch_height, patch_width)
    patches = patches.permute(0, 2, 3, 4, 1)
    patches = patches.reshape(batch_size, -1, channels * patch_height * patch_width)
    return patches


def image_placeholder_ids(height, width):
    # FuyuProcessor.replace_image_token: one row of placeholders per patch row, each ended by |NEWLINE|, then <s>
    row_width = width // PATCH
    num_patches = (height // PATCH) * row_width
    ids = []
    for _ in range(0, num_patches, row_width):
        ids += [IMAGE_TOKEN_ID] * row_width + [NEWLINE_ID]
    return ids + [BOS_ID]


def build_sample(image, prompt_ids):
    _, h, w = image.shape
    ids = image_placeholder_ids(h, w) + prompt_ids + [BOA_ID]
    patches = patchify_image(image[None]).squeeze(0)
    return torch.tensor(ids), patches


def left_pad(samples):
    # tokenizer.pad(..., padding_side="left") as FuyuProcessor calls it
    max_len = max(len(ids) for ids, _ in samples)
    input_ids = torch.full((len(samples), max_len), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), max_len), dtype=torch.long)
    for i, (ids, _) in enumerate(samples):
        input_ids[i, max_len - len(ids):] = ids
        attention_mask[i, max_len - len(ids):] = 1
    pixel_values = torch.cat([p for _, p in samples], dim=0)
    return input_ids, attention_mask, pixel_values


# images of different sizes (multiples of the patch size, as the processor crops them)
images = [
    torch.randn(CHANNELS, 8, 12),
    torch.randn(CHANNELS, 4, 8),
    torch.randn(CHANNELS, 12, 8),
    torch.randn(CHANNELS, 4, 4),
]
prompts = [[10, 11, 12], [20, 21, 22, 23, 24, 25], [30], [40, 41, 42, 43]]
samples = [build_sample(img, p) for img, p in zip(images, prompts)]
input_ids, attention_mask, pixel_values = left_pad(samples)
position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)

with torch.no_grad():
    out = model(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask,
                position_ids=position_ids)

    # 1) logits at real positions equal each sample alone
    max_len = input_ids.shape[1]
    for i, (ids, patches) in enumerate(samples):
        alone = model(input_ids=ids[None], pixel_values=patches).logits[0]
        n = len(ids)
        torch.testing.assert_close(out.logits[i, max_len - n:], alone, atol=1e-4, rtol=1e-4)

    # 2) a loss over the answer-side text tokens (image rows, <s> and padding set to -100)
    answers = [[50, 51], [52], [53, 54, 55], [56, 57]]
    full = [build_sample(img, p) for img, p in zip(images, prompts)]
    full = [(torch.cat([ids, torch.tensor(a)]), patches) for (ids, patches), a in zip(full, answers)]
    ids_b, mask_b, pix_b = left_pad(full)
    labels = ids_b.clone()
    labels[mask_b == 0] = -100
    labels[(ids_b == IMAGE_TOKEN_ID) | (ids_b == NEWLINE_ID) | (ids_b == BOS_ID)] = -100
    pos_b = (mask_b.cumsum(-1) - 1).masked_fill(mask_b == 0, 0)
    loss = model(input_ids=ids_b, pixel_values=pix_b, attention_mask=mask_b, position_ids=pos_b,
                 labels=labels).loss
    total, count = 0.0, 0
    for ids, patches in full:
        logits = model(input_ids=ids[None], pixel_values=patches).logits[0]
        for t in range(1, len(ids)):
            target = int(ids[t])
            if target in (IMAGE_TOKEN_ID, NEWLINE_ID, BOS_ID):
                continue
            total += F.cross_entropy(logits[t - 1][None], torch.tensor([target])).item()
            count += 1
    ref_loss = total / count
    assert math.isclose(loss.item(), ref_loss, rel_tol=1e-4, abs_tol=1e-5), (loss.item(), ref_loss)

    # 3) cached greedy generation equals a hand-written no-cache greedy loop per prompt
    new_tokens = 5
    generated = model.generate(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask,
                               max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID,
                               eos_token_id=None)
    for i, (ids, patches) in enumerate(samples):
        seq = ids.clone()
        for _ in range(new_tokens):
            logits = model(input_ids=seq[None], pixel_values=patches).logits[0, -1]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)])
        assert generated[i, max_len:].tolist() == seq[len(ids):].tolist(), (i, generated[i, max_len:], seq)

print("fuyu left-padded image-patch batch: logits, loss and greedy generation match per-sample runs")
