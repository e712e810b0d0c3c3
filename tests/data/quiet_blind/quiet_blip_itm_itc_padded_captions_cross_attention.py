"""BLIP image-text retrieval: padded captions scored against images with the
ITM head (text self-attention under a key-padding mask, cross-attention to
all image tokens) and the ITC head (unimodal text encoder, same padding mask,
[CLS] features).

Uses huggingface/transformers (installed 5.25.0) as is, a tiny model built from
BlipConfig (no downloads):
  src/transformers/models/blip/modeling_blip.py   (BlipForImageTextRetrieval.forward:
      image_atts = ones, text_encoder(input_ids, attention_mask, encoder_hidden_states,
      encoder_attention_mask), itm_head(question_embeds[:, 0]); ITC branch text_proj/vision_proj)
  src/transformers/models/blip/modeling_blip_text.py (BlipTextModel.forward: extended
      attention mask for the text padding, encoder_extended_attention_mask for the image)
The ITM inputs put the [ENC] id in position 0 as salesforce/BLIP
models/blip_retrieval.py does (`encoder_input_ids[:, 0] = self.tokenizer.enc_token_id`).
Checked against every (image, caption) pair run alone with the caption unpadded.
"""
import torch
from transformers import BlipConfig, BlipForImageTextRetrieval

torch.manual_seed(0)

PAD, CLS, ENC, SEP = 0, 1, 3, 2
cfg = BlipConfig(
    text_config=dict(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, encoder_hidden_size=24, max_position_embeddings=32,
                     pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, sep_token_id=SEP,
                     initializer_range=0.2),
    vision_config=dict(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       image_size=16, patch_size=4, initializer_range=0.2),
    projection_dim=16,
)
model = BlipForImageTextRetrieval(cfg).eval()

captions = [[CLS, 11, 25, 7, 40, 9, 13, SEP], [CLS, 5, 30, SEP], [CLS, 22, 8, 17, 44, SEP]]
L = max(len(c) for c in captions)
ids = torch.full((len(captions), L), PAD, dtype=torch.long)
mask = torch.zeros(len(captions), L, dtype=torch.long)
for b, c in enumerate(captions):
    ids[b, :len(c)] = torch.tensor(c)
    mask[b, :len(c)] = 1  # right padding, 1 = real token

images = torch.randn(2, 3, 16, 16)

ok_all = True
with torch.no_grad():
    # ITM: every image against every caption (flattened pairs, as in BLIP's rerank step)
    pair_img = images.repeat_interleave(len(captions), 0)
    enc_ids = ids.clone()
    enc_ids[:, 0] = ENC
    pair_ids = enc_ids.repeat(2, 1)
    pair_mask = mask.repeat(2, 1)
    itm = model(input_ids=pair_ids, pixel_values=pair_img, attention_mask=pair_mask, use_itm_head=True)
    itm_prob = itm.itm_score.softmax(-1)[:, 1]
    for p in range(pair_ids.shape[0]):
        i, b = divmod(p, len(captions))
        n = len(captions[b])
        one = model(input_ids=enc_ids[b:b + 1, :n], pixel_values=images[i:i + 1], use_itm_head=True)
        ok = torch.allclose(itm.itm_score[p], one.itm_score[0], atol=1e-5) and torch.allclose(
            itm.question_embeds[p, :n], one.question_embeds[0], atol=1e-5)
        print(f"itm image {i} caption {b} ({n} tokens): p_match={itm_prob[p]:.4f} match={ok}")
        ok_all &= ok

    # ITC: cosine similarity of [CLS] features, text encoder without the image
    itc = model(input_ids=ids, pixel_values=images, attention_mask=mask, use_itm_head=False)
    for b, c in enumerate(captions):
        one = model(input_ids=ids[b:b + 1, :len(c)], pixel_values=images, use_itm_head=False)
        ok = torch.allclose(itc.itm_score[:, b], one.itm_score[:, 0], atol=1e-5)
        print(f"itc caption {b}: sims={[round(v, 4) for v in itc.itm_score[:, b].tolist()]} match={ok}")
        ok_all &= ok

print("ALL MATCH" if ok_all else "MISMATCH")
assert ok_all
