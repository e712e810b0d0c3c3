# huggingface/transformers#15556, fixed by huggingface/transformers#20726: BART's prepare_inputs_for_generation did not
# forward `decoder_attention_mask`, so when generation continues a decoder prompt containing <pad> (masked out by the
# caller's decoder_attention_mask) every decoding step still attends the pad token through the self-attention cache.
import sys

import torch
from transformers import BartConfig, BartForConditionalGeneration

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Bart(BartForConditionalGeneration):
    def prepare_inputs_for_generation(self, decoder_input_ids, cache=None, attention_mask=None,
                                      decoder_attention_mask=None, encoder_outputs=None, use_cache=None, **kwargs):
        # cut decoder_input_ids if past is used
        if cache is not None and cache.get_seq_length() > 0:
            decoder_input_ids = decoder_input_ids[:, -1:]
        inputs = {
            "input_ids": None,  # encoder_outputs is defined. input_ids not needed
            "encoder_outputs": encoder_outputs,
            "cache": cache,
            "decoder_input_ids": decoder_input_ids,
            "attention_mask": attention_mask,
            "use_cache": use_cache,
        }
        if FIXED:
            inputs["decoder_attention_mask"] = decoder_attention_mask
        return inputs

    def _update_model_kwargs_for_generation(self, model_kwargs, cache):
        model_kwargs["cache"] = cache
        if FIXED and model_kwargs.get("decoder_attention_mask") is not None:
            m = model_kwargs["decoder_attention_mask"]
            model_kwargs["decoder_attention_mask"] = torch.cat([m, m.new_ones((m.shape[0], 1))], dim=-1)
        return model_kwargs


config = BartConfig(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, init_std=0.3,
                    pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                    forced_bos_token_id=None, attn_implementation="sdpa")
model = Bart(config).eval()

input_ids = torch.tensor([[0, 17, 23, 9, 41, 2]])
attention_mask = torch.ones_like(input_ids)
# decoder prompt "</s> <pad> <s>" with the pad masked out (the layout from the issue)
decoder_input_ids = torch.tensor([[2, 1, 0]])
decoder_attention_mask = torch.tensor([[1, 0, 1]])

with torch.no_grad():
    encoder_outputs = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
    model_kwargs = {"encoder_outputs": encoder_outputs, "attention_mask": attention_mask,
                    "decoder_attention_mask": decoder_attention_mask, "cache": None, "use_cache": True}
    step_logits = []
    for _ in range(4):  # greedy search with the self-attention cache
        model_inputs = model.prepare_inputs_for_generation(decoder_input_ids, **model_kwargs)
        out = model(**model_inputs)
        next_token = out.logits[:, -1].argmax(-1, keepdim=True)
        step_logits.append(out.logits[:, -1])
        decoder_input_ids = torch.cat([decoder_input_ids, next_token], dim=-1)
        model_kwargs = model._update_model_kwargs_for_generation(model_kwargs, out.cache)

    # reference: one full teacher-forced pass over the generated sequence with the pad masked
    full_mask = torch.cat([decoder_attention_mask, torch.ones(1, decoder_input_ids.shape[1] - 3, dtype=torch.long)], -1)
    ref = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask,
                decoder_input_ids=decoder_input_ids[:, :-1], decoder_attention_mask=full_mask[:, :-1]).logits
    diff = max((step_logits[i][0] - ref[0, 2 + i]).abs().max().item() for i in range(4))

print(f"{'fixed' if FIXED else 'buggy'}: generated {decoder_input_ids[0].tolist()}; "
      f"max |step logits - masked full-pass logits| = {diff:.3e}")
