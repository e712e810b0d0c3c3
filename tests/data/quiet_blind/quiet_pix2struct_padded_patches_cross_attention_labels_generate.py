"""Pix2Struct (Donut-like screenshot parsing) over a batch of images with different aspect
ratios: the image processor pads the flattened patches with zero rows, the vision encoder masks
those keys, and the text decoder cross-attends to the padded patch memory while its own
right-padded labels (-100) are masked causally.

Follows huggingface/transformers v5.25.0 (the installed package):
  models/pix2struct/image_processing_pix2struct.py  extract_flattened_patches (row/col ids in
      columns 0/1, zero-padded to max_patches), _preprocess: masks = (patches.sum(-1) != 0)
  models/pix2struct/modeling_pix2struct.py  Pix2StructVisionModel.forward (mask from the patches,
      create_bidirectional_mask), Pix2StructTextModel (causal self-attention, encoder_attention_mask
      for cross-attention), Pix2StructForConditionalGeneration.forward (decoder_input_ids =
      shift_right(labels) with -100 -> pad, decoder_attention_mask = ne(pad) with column 0 forced
      to 1 because decoder_start == pad)
as used by google-research/pix2struct fine-tuning recipes (labels padded with -100).
Tiny model built from config classes; no downloads.
"""
import torch
from transformers import (Pix2StructConfig, Pix2StructForConditionalGeneration,
                          Pix2StructImageProcessor, Pix2StructTextConfig, Pix2StructVisionConfig)

torch.manual_seed(0)
PAD, EOS = 0, 1
PH = PW = 4
MAX_PATCHES = 12

vision = Pix2StructVisionConfig(
    hidden_size=32, patch_embed_hidden_size=PH * PW * 3, d_ff=64, d_kv=8, num_attention_heads=4,
    num_hidden_layers=2, dropout_rate=0.0, attention_dropout=0.0, seq_len=16)
text = Pix2StructTextConfig(
    vocab_size=50, hidden_size=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
    relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
    pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD, is_decoder=True)
config = Pix2StructConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
config.pad_token_id = PAD
config.decoder_start_token_id = PAD
config.eos_token_id = EOS
model = Pix2StructForConditionalGeneration(config).eval()

proc = Pix2StructImageProcessor(patch_size={"height": PH, "width": PW}, max_patches=MAX_PATCHES,
                                is_vqa=False)
g = torch.Generator().manual_seed(3)
images = [torch.rand(3, 8, 20, generator=g) * 255, torch.rand(3, 16, 16, generator=g) * 255,
          torch.rand(3, 4, 28, generator=g) * 255]
enc = proc(images=images, return_tensors="pt", max_patches=MAX_PATCHES)
patches, patch_mask = enc["flattened_patches"], enc["attention_mask"]
n_real = patch_mask.sum(-1).long().tolist()
assert len(set(n_real)) > 1 and max(n_real) < MAX_PATCHES, n_real  # every image is padded

targets = [[7, 8, 9, 10, EOS], [11, 12, EOS], [13, 14, 15, 16, 17, 18, EOS]]
T = max(len(t) for t in targets)
labels = torch.tensor([t + [-100] * (T - len(t)) for t in targets])

ok = True
with torch.no_grad():
    out = model(flattened_patches=patches, attention_mask=patch_mask, labels=labels)
    enc_h = out.encoder_last_hidden_state
    n_tok = sum(len(t) for t in targets)
    alone_sum = 0.0
    for b in range(len(images)):
        p1 = patches[b:b + 1, : n_real[b]]                      # only the real patches
        assert (p1.sum(-1) != 0).all()
        lab1 = torch.tensor([targets[b]])
        o1 = model(flattened_patches=p1, attention_mask=torch.ones(1, n_real[b]), labels=lab1)
        ok &= torch.allclose(o1.encoder_last_hidden_state[0], enc_h[b, : n_real[b]], atol=1e-5)
        L = len(targets[b])
        ok &= torch.allclose(o1.logits[0], out.logits[b, :L], atol=1e-4)
        alone_sum += o1.loss.item() * L
    ok &= abs(out.loss.item() * n_tok - alone_sum) < 1e-3
    print("encoder states, label logits and loss match each image alone:", ok)

    # independent reference for the decoder's masking: one position at a time with no
    # decoder mask (the prefix alone), against the teacher-forced padded batch
    for b in range(len(images)):
        p1 = patches[b:b + 1, : n_real[b]]
        dec = torch.tensor([[PAD] + targets[b][:-1]])
        for i in range(1, dec.size(1) + 1):
            lo = model(flattened_patches=p1, decoder_input_ids=dec[:, :i]).logits[0, -1]
            ok &= torch.allclose(lo, out.logits[b, i - 1], atol=1e-4)
    print("teacher-forced logits match prefix-only runs:", ok)

    gen = model.generate(flattened_patches=patches, attention_mask=patch_mask, max_new_tokens=6,
                         do_sample=False, num_beams=1)
    for b in range(len(images)):
        p1 = patches[b:b + 1, : n_real[b]]
        g1 = model.generate(flattened_patches=p1, attention_mask=torch.ones(1, n_real[b]),
                            max_new_tokens=6, do_sample=False, num_beams=1)
        L = g1.size(1)
        ok &= torch.equal(gen[b, :L], g1[0])
        ok &= bool((gen[b, L:] == PAD).all())
    print("greedy generation matches each image alone:", ok)

print("MATCH" if ok else "MISMATCH")
assert ok
