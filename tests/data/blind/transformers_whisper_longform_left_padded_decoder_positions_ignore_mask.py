# huggingface/transformers PR #48028 (WhisperForConditionalGeneration.prepare_inputs_for_generation, regression from #44130).
# Bug: with left-padded decoder prompts (longform, condition_on_prev_tokens) the decoder_attention_mask no longer
# yields decoder_position_ids, so every row gets arange positions and padded rows' real tokens are shifted.
import sys

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class PatchedWhisper(WhisperForConditionalGeneration):
    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, **kwargs):
        if FIXED:
            # During Whisper longform generation with condition_on_prev_tokens=True, shorter sequences
            # in a batch are left-padded. Compute decoder_position_ids from decoder_attention_mask.
            if (
                "decoder_position_ids" not in kwargs
                and (decoder_attention_mask := kwargs.get("decoder_attention_mask")) is not None
            ):
                position_ids = decoder_attention_mask.long().cumsum(-1) - 1
                position_ids = position_ids.masked_fill(decoder_attention_mask == 0, 0)
                kwargs["decoder_position_ids"] = position_ids[..., -input_ids.shape[1]:]
        # buggy: the base class builds no positions from the decoder mask
        return super(WhisperForConditionalGeneration, self).prepare_inputs_for_generation(
            input_ids, cache=cache, attention_mask=attention_mask, **kwargs
        )


config = WhisperConfig(
    vocab_size=64, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=2,
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
    max_source_positions=8, max_target_positions=32, pad_token_id=0, decoder_start_token_id=1,
    eos_token_id=2, bos_token_id=1,
)
config._attn_implementation = "eager"
model = PatchedWhisper(config).eval()

input_features = torch.randn(2, 8, 16)
prev_a = torch.tensor([5, 6, 7, 8, 9, 10, 11])  # longer previous-segment prompt
prev_b = torch.tensor([12, 13, 14])               # shorter one -> left padded
pad = len(prev_a) - len(prev_b)
decoder_input_ids = torch.stack([prev_a, torch.cat([torch.zeros(pad, dtype=torch.long), prev_b])])
decoder_attention_mask = (decoder_input_ids != 0).long()


def greedy(features, ids, mask, steps=5):
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(features)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        logits_all, cur, step_ids = [], ids, ids
        for _ in range(steps):
            # like GenerationMixin: prefill with the whole prompt, then only the new token (the cache holds the rest)
            inputs = model.prepare_inputs_for_generation(
                step_ids, cache=cache, encoder_outputs=encoder_outputs, decoder_attention_mask=mask, use_cache=True,
            )
            out = model(**inputs)
            cache = out.past_key_values
            logits = out.logits[:, -1]
            logits_all.append(logits)
            nxt = logits.argmax(-1, keepdim=True)
            cur = torch.cat([cur, nxt], dim=-1)
            step_ids = nxt
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
        return torch.stack(logits_all, 1)


batched = greedy(input_features, decoder_input_ids, decoder_attention_mask)
alone = greedy(input_features[1:], prev_b[None], torch.ones(1, len(prev_b), dtype=torch.long))
print("max |batched(left-padded row) - alone| logits:", float((batched[1] - alone[0]).abs().max()))
