"""Correct program (quiet batch quiet-r84a).

Ported from huggingface/transformers v5.25.0 (installed): src/transformers/models/idefics/processing_idefics.py
(image_attention_mask_for_packed_input_ids_pt, incremental_to_binary_attention_mask, the zero-image padding to
max_num_images, left padding) and src/transformers/models/idefics/modeling_idefics.py (IdeficsModel.forward:
image_attention_mask expanded over each image's perceiver latents, cross_attention_gate,
IdeficsGatedCrossAttentionLayer), run tiny from IdeficsConfig with random weights.

Flamingo-style gated cross-attention: every text token cross-attends only the latents of the last <image> before
it; samples with fewer images get all-zero padding images whose mask column is 0; tokens before any image (and the
left pads) attend no image and their cross-attention output is gated to zero.  The batch's logits at every real
token are checked against each sample run alone, unpadded, with only its own images.
"""
from types import SimpleNamespace

import torch

from transformers import IdeficsConfig, IdeficsForVisionText2Text

IMAGE_TOKEN = "<image>"


def incremental_to_binary_attention_mask(incremental_mask, return_tensors, num_classes=-1):
    if num_classes != -1:
        incremental_mask[incremental_mask >= num_classes] = -1
    negatives = incremental_mask == -1
    incremental_mask[negatives] = 0
    attn_mask = torch.nn.functional.one_hot(incremental_mask, num_classes=num_classes)
    attn_mask[negatives, :] = 0
    return attn_mask


def image_attention_mask_for_packed_input_ids_pt(input_ids, tokenizer):
    image_attention_mask = torch.full_like(input_ids, fill_value=-1)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    eod_token_id = tokenizer.eos_token_id
    for batch_idx in range(input_ids.size(0)):
        count = -1
        seen_eod = False
        for idx, token_id in enumerate(input_ids[batch_idx]):
            if token_id == image_token_id:
                count += 1
                image_attention_mask[batch_idx][idx] = count
                seen_eod = False
            else:
                image_attention_mask[batch_idx][idx] = count
            if seen_eod:
                image_attention_mask[batch_idx][idx] = -1
            if token_id == eod_token_id:
                seen_eod = True
    return image_attention_mask


def process(samples, tokenizer, image_dims):
    """The processor's batching: left-pad the ids, pad each sample's images with zero images."""
    max_len = max(len(ids) for ids, _ in samples)
    max_num_images = max(1, max(len(imgs) for _, imgs in samples))
    all_ids, all_masks, all_images = [], [], []
    for ids, imgs in samples:
        pad = max_len - len(ids)
        all_ids.append([tokenizer.pad_token_id] * pad + ids)
        all_masks.append([0] * pad + [1] * len(ids))
        padded_image_tensor = torch.zeros(max_num_images, *image_dims)
        if len(imgs):
            padded_image_tensor[: len(imgs)] = torch.stack(imgs)
        all_images.append(padded_image_tensor)
    input_ids = torch.tensor(all_ids)
    attention_mask = torch.tensor(all_masks)
    pixel_values = torch.stack(all_images)
    image_attention_mask = image_attention_mask_for_packed_input_ids_pt(input_ids, tokenizer)
    image_attention_mask = incremental_to_binary_attention_mask(image_attention_mask, "pt", num_classes=max_num_images)
    return dict(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                image_attention_mask=image_attention_mask)


def main():
    torch.manual_seed(0)
    config = IdeficsConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        alpha_initializer="normal", alphas_initializer_range=1.0, alpha_type="vector",
        cross_layer_interval=1, use_resampler=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        vision_config=dict(embed_dim=16, image_size=16, patch_size=8, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=32),
        perceiver_config=dict(use_resampler=True, resampler_n_latents=3, resampler_depth=1,
                              resampler_n_heads=2, resampler_head_dim=8),
    )
    config._attn_implementation = "eager"
    model = IdeficsForVisionText2Text(config).eval()

    image_token_id = 63
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=2,
                                convert_tokens_to_ids=lambda t: image_token_id)
    image_dims = (3, 16, 16)
    img = lambda: torch.randn(*image_dims, dtype=torch.float32)
    I = image_token_id
    samples = [
        ([1, 5, I, 7, 8, 9, I, 10, 11, 12], [img(), img()]),  # text before the first image, then two images
        ([1, I, 20, 21], [img()]),                               # one image: the second image slot is padding
        ([1, 30, 31, 32, I, 33], [img()]),
    ]
    batch = process(samples, tokenizer, image_dims)
    assert batch["image_attention_mask"][1, :, 1].sum() == 0  # the padding image is attended by no token

    with torch.no_grad():
        logits = model(**batch).logits
        for b, (ids, imgs) in enumerate(samples):
            alone = process([(ids, imgs)], tokenizer, image_dims)
            ref = model(**alone).logits[0]
            n = len(ids)
            got = logits[b, -n:]
            assert torch.allclose(got, ref, atol=1e-5), (b, (got - ref).abs().max())

        # the gate really matters: tokens before the first image see no image, those after do
        gate_off = model(**{**batch, "image_attention_mask": torch.zeros_like(batch["image_attention_mask"])}).logits
        assert torch.allclose(gate_off[0, :2], logits[0, :2], atol=1e-5)
        assert not torch.allclose(gate_off[0, 3:], logits[0, 3:], atol=1e-4)
    print("ok: batched IDEFICS logits match each sample run alone with only its images")


if __name__ == "__main__":
    main()
