# huggingface/transformers#35044 ("Add `position_ids` in `XLMRobertaXLForCausalLM.prepare_inputs_for_generation`",
# merged), src/transformers/models/xlm_roberta_xl/modeling_xlm_roberta_xl.py.
#
# XLMRobertaXLForCausalLM overrides prepare_inputs_for_generation and, before the fix, returned no position_ids.
# The model then numbers positions in XLMRobertaXLEmbeddings with
# create_position_ids_from_input_ids(input_ids, padding_idx, past_key_values_length), which counts the non-pad
# tokens of the ids it is handed. During cached decoding it is handed only the last token, so that token is put at
# padding_idx + 1 + past_length, i.e. every left pad of the prompt is counted as a real position: the shorter rows of
# a left-padded batch decode at shifted absolute positions.
# The fix builds position_ids in prepare_inputs_for_generation from the full input_ids (pads stay at padding_idx)
# and slices them the same way input_ids are sliced.
#
# The model is transformers' XLMRobertaXLForCausalLM (tiny config, random weights); prepare_inputs_for_generation is
# the project's override, before or after the fix (cache length read with get_seq_length() for the Cache object),
# driven by a greedy loop written the way GenerationMixin's sample loop drives it.
import sys
import warnings

import torch
from transformers import XLMRobertaXLConfig, XLMRobertaXLForCausalLM

FIXED = "--fixed" in sys.argv
warnings.filterwarnings("ignore", category=FutureWarning)

from transformers.models.xlm_roberta_xl.modeling_xlm_roberta_xl import XLMRobertaXLEmbeddings

create_position_ids_from_input_ids = XLMRobertaXLEmbeddings.create_position_ids_from_input_ids


class PatchedXLMRobertaXLForCausalLM(XLMRobertaXLForCausalLM):
    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, **model_kwargs):
        # Overwritten -- model logic breaks when `inputs_embeds` are passed from this function

        input_shape = input_ids.shape
        # if model is used as a decoder in encoder-decoder model, the decoder attention mask is created on the fly
        if attention_mask is None:
            attention_mask = input_ids.new_ones(input_shape)

        if FIXED:
            # Create missing `position_ids` on the fly
            position_ids = None
            if model_kwargs.get("position_ids") is None:
                position_ids = create_position_ids_from_input_ids(
                    input_ids, padding_idx=self.config.pad_token_id
                )  # placed in kwargs for further processing (see below)

        # cut decoder_input_ids if past_key_values is used
        if past_key_values is not None and past_key_values.get_seq_length() > 0:
            past_length = past_key_values.get_seq_length()

            # Some generation methods already pass only the last input ID
            if input_ids.shape[1] > past_length:
                remove_prefix_length = past_length
            else:
                # Default to old behavior: keep only final ID
                remove_prefix_length = input_ids.shape[1] - 1

            input_ids = input_ids[:, remove_prefix_length:]
            if FIXED and position_ids is not None:
                position_ids = position_ids[:, remove_prefix_length:]

        if FIXED:
            return {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": position_ids,
                "past_key_values": past_key_values,
            }
        return {"input_ids": input_ids, "attention_mask": attention_mask, "past_key_values": past_key_values}


def greedy_generate(model, input_ids, attention_mask, max_new_tokens):
    from transformers import DynamicCache

    past_key_values = DynamicCache(config=model.config)
    step_logits = []
    for _ in range(max_new_tokens):
        model_inputs = model.prepare_inputs_for_generation(
            input_ids, past_key_values=past_key_values, attention_mask=attention_mask
        )
        out = model(**model_inputs, use_cache=True)
        next_token_logits = out.logits[:, -1, :]
        step_logits.append(next_token_logits)
        next_tokens = next_token_logits.argmax(-1)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
    return input_ids, torch.stack(step_logits, 1)


def main():
    torch.manual_seed(0)
    config = XLMRobertaXLConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        is_decoder=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "eager"
    model = PatchedXLMRobertaXLForCausalLM(config).eval()
    with torch.no_grad():
        model.roberta.embeddings.position_embeddings.weight.normal_(0.0, 1.0)

    pad = config.pad_token_id
    # a tokenizer with padding_side="left": <s> ... </s>-less prompts of 9 and 4 tokens
    prompts = [[0, 17, 33, 52, 8, 61, 40, 25, 77], [0, 44, 12, 90]]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    with torch.no_grad():
        sequences, logits = greedy_generate(model, input_ids, attention_mask, max_new_tokens=6)

    for row, seq in enumerate(sequences.tolist()):
        print(f"row {row}: generated {seq[width:]}")
    print("last-step logits[1, :5]:", [round(x, 4) for x in logits[1, -1, :5].tolist()])


if __name__ == "__main__":
    main()
