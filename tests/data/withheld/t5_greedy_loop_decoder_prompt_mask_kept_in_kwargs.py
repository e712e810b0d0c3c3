# Written another way than BART's (transformers#15556, fixed by #20726): a T5 greedy loop of a program's own, in a
# function, continues a batch of two decoder prompts, the shorter one left-padded with T5's pad id and masked out by
# the `decoder_attention_mask` kept in the loop's `step_kwargs`. The buggy loop never hands that mask to the model, so
# every decoder self-attention step (eager softmax with T5's position bias) attends the pad; the fix passes it and
# extends it by one column per generated token.
import sys

import torch
from transformers import T5Config, T5ForConditionalGeneration

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

config = T5Config(vocab_size=48, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                  relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                  attn_implementation="eager")
model = T5ForConditionalGeneration(config).eval()


def greedy(model, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, steps=3):
    encoder_outputs = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
    step_kwargs = {"decoder_attention_mask": decoder_attention_mask, "past_key_values": None}
    new = decoder_input_ids
    for _ in range(steps):
        inputs = {"encoder_outputs": encoder_outputs, "attention_mask": attention_mask, "decoder_input_ids": new,
                  "past_key_values": step_kwargs["past_key_values"], "use_cache": True}
        if FIXED:
            inputs["decoder_attention_mask"] = step_kwargs["decoder_attention_mask"]
        out = model(**inputs)
        new = out.logits[:, -1].argmax(-1, keepdim=True)
        step_kwargs["past_key_values"] = out.past_key_values
        if FIXED:
            m = step_kwargs["decoder_attention_mask"]
            step_kwargs["decoder_attention_mask"] = torch.cat([m, m.new_ones((m.shape[0], 1))], dim=-1)
        decoder_input_ids = torch.cat([decoder_input_ids, new], dim=-1)
    return decoder_input_ids


input_ids = torch.tensor([[5, 9, 14, 22, 1], [11, 4, 26, 1, 0]])
attention_mask = (input_ids != 0).long()
# the decoder prompts: "<start> 7 3 8" and, left-padded, "<pad> <start> 6 2"
decoder_input_ids = torch.tensor([[0, 7, 3, 8], [0, 0, 6, 2]])
decoder_attention_mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
with torch.no_grad():
    out = greedy(model, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask)
print(f"{'fixed' if FIXED else 'buggy'}: generated {out.tolist()}")
