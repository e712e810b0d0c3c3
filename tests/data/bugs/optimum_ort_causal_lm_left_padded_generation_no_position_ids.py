# huggingface/optimum#1381 (commit 89d08c4c, "Add position ids in ONNX export and ORT").
# ORTModelForCausalLM.prepare_inputs_for_generation returned "position_ids": None, and the exported
# decoder had no position_ids input, so the graph fell back to transformers' default positions
# (arange from the past length, the same for every row). On a left-padded batch the shorter prompt's
# tokens got positions shifted by its pad count, and batched generation differed from batch size 1.
# Fix: build position_ids from the attention_mask (cumsum - 1, pads filled with 1; last column once a
# cache exists) and feed them to the decoder.
# The ONNX Runtime session is stood in for by the tiny GPT-2 the decoder was exported from.
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv


class ORTModelForCausalLM:
    def __init__(self, decoder):
        self.decoder = decoder  # stands in for the decoder_model_merged.onnx session
        self.input_names = {"input_ids": 0, "attention_mask": 1}
        if FIXED:
            self.input_names["position_ids"] = 2

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, position_ids=None, **kwargs):
        model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if "position_ids" in self.input_names:
            model_inputs["position_ids"] = position_ids
        out = self.decoder(**model_inputs, past_key_values=past_key_values, use_cache=True)
        return out.logits, out.past_key_values

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, **kwargs):
        attention_mask = kwargs.get("attention_mask", None)
        use_cache = kwargs.get("use_cache", None)

        if FIXED:
            position_ids = kwargs.get("position_ids", None)
            if attention_mask is not None and position_ids is None:
                # create position_ids on the fly for batch generation
                position_ids = attention_mask.long().cumsum(-1) - 1
                position_ids.masked_fill_(attention_mask == 0, 1)
                if past_key_values:
                    position_ids = position_ids[:, -1].unsqueeze(-1)
        else:
            position_ids = None

        if past_key_values:
            input_ids = input_ids[:, -1:]
        return {
            "input_ids": input_ids,
            "past_key_values": past_key_values,
            "use_cache": use_cache,
            "position_ids": position_ids,
            "attention_mask": attention_mask,
        }

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, max_new_tokens):
        past_key_values = None
        for _ in range(max_new_tokens):
            inputs = self.prepare_inputs_for_generation(
                input_ids, past_key_values=past_key_values, attention_mask=attention_mask, use_cache=True
            )
            logits, past_key_values = self.forward(**inputs)
            next_tokens = logits[:, -1, :].argmax(-1)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        return input_ids


def main():
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, initializer_range=0.5,
    )
    decoder = GPT2LMHeadModel(config).eval()
    model = ORTModelForCausalLM(decoder)

    # tokenizer.padding_side = "left", as for batched generation
    pad = config.pad_token_id
    input_ids = torch.tensor([[11, 23, 5, 42, 17, 9, 30, 8], [pad, pad, pad, pad, 14, 3, 27, 50]])
    attention_mask = (input_ids != pad).long()

    out = model.generate(input_ids, attention_mask, max_new_tokens=8)
    for row in out.tolist():
        print(row[input_ids.shape[1]:])


if __name__ == "__main__":
    main()
