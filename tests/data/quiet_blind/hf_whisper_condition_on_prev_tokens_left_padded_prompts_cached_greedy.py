"""Whisper decoding with a cache over a batch of uneven previous-text prompts, left padded.

Follows huggingface/transformers src/transformers/models/whisper/generation_whisper.py
  (WhisperGenerationMixin.generate, long-form with condition_on_prev_tokens=True: _prepare_decoder_input_ids
  builds [<|startofprev|>, previous text..., <|startoftranscript|>, <|en|>, <|transcribe|>, <|notimestamps|>]
  per item, left-pads the shorter ones with pad_token_id and passes decoder_attention_mask) and
  modeling_whisper.py WhisperForConditionalGeneration.prepare_inputs_for_generation:
      position_ids = decoder_attention_mask.long().cumsum(-1) - 1
      position_ids = position_ids.masked_fill(decoder_attention_mask == 0, 0)
      kwargs["decoder_position_ids"] = position_ids[..., -input_ids.shape[1]:]
  Each greedy step feeds the new token with the cache, appends 1 to decoder_attention_mask.
The decoder_attention_mask and the positions it gives are the program's statement: pads are not text, and
each item's first real token is at position 0.
Reduced: WhisperForConditionalGeneration from a tiny WhisperConfig (no weights), float64, random features.
Check: each step's logits for every item equal those of the item alone, unpadded, recomputed without a cache.
"""
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

torch.manual_seed(0)

V = 60
PAD, SOT, SOT_PREV, EN, TRANSCRIBE, NO_TS, EOT = 50, 51, 52, 53, 54, 55, 56
config = WhisperConfig(vocab_size=V, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
                       encoder_attention_heads=4, decoder_attention_heads=4, d_model=32,
                       encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=10,
                       max_target_positions=40, pad_token_id=PAD, bos_token_id=SOT, eos_token_id=EOT,
                       decoder_start_token_id=SOT)
model = WhisperForConditionalGeneration(config).double().eval()

B = 3
input_features = torch.randn(B, 8, 2 * config.max_source_positions, dtype=torch.float64)
prev_texts = [torch.randint(0, 50, (n,)) for n in (7, 0, 3)]  # previous segment's text (one item has none)
prompts = []
for prev in prev_texts:
    head = torch.cat([torch.tensor([SOT_PREV]), prev]) if len(prev) else torch.tensor([], dtype=torch.long)
    prompts.append(torch.cat([head, torch.tensor([SOT, EN, TRANSCRIBE, NO_TS])]))
P = max(len(p) for p in prompts)
decoder_input_ids = torch.full((B, P), PAD)
decoder_attention_mask = torch.zeros(B, P, dtype=torch.long)
for i, p in enumerate(prompts):
    decoder_input_ids[i, P - len(p):], decoder_attention_mask[i, P - len(p):] = p, 1

STEPS = 6
with torch.no_grad():
    encoder_outputs = model.model.encoder(input_features)
    ids, mask, cache, step_logits = decoder_input_ids, decoder_attention_mask, None, []
    new = ids
    for _ in range(STEPS):
        position_ids = mask.long().cumsum(-1) - 1
        position_ids = position_ids.masked_fill(mask == 0, 0)
        out = model(encoder_outputs=encoder_outputs, decoder_input_ids=new, decoder_attention_mask=mask,
                    decoder_position_ids=position_ids[..., -new.shape[1]:], cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits[:, -1]
        step_logits.append(logits)
        new = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, new], 1)
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], 1)

    worst = 0.0
    for i, p in enumerate(prompts):
        enc_i = model.model.encoder(input_features[i:i + 1])
        seq = p[None]
        for t in range(STEPS):
            ref = model(encoder_outputs=enc_i, decoder_input_ids=seq, use_cache=False).logits[0, -1]
            worst = max(worst, (ref - step_logits[t][i]).abs().max().item())
            seq = torch.cat([seq, ids[i:i + 1, P + t:P + t + 1]], 1)
print(f"max |left-padded cached batch logits - item alone without cache|: {worst:.3e}")
assert worst < 1e-10
