# huggingface/transformers#30670: the "static kv-cache" batched generation loop of the llm_optims docs passes the
# padding mask to the prefill only; decode_one_tokens calls the model without it, so left-padded rows attend to pads.
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
NUM_TOKENS_TO_GENERATE = 6
PAD = 0


def decode_one_tokens(model, cur_token, input_pos, cache_position, past_key_values, attention_mask=None):
    if FIXED:
        logits = model(cur_token, attention_mask=attention_mask, position_ids=input_pos,
                       cache_position=cache_position, cache=past_key_values, return_dict=False, use_cache=True)[0]
    else:
        logits = model(cur_token, position_ids=input_pos, cache_position=cache_position,
                       cache=past_key_values, return_dict=False, use_cache=True)[0]
    new_token = torch.argmax(logits[:, -1], dim=-1)[:, None]
    return new_token


def generate(model, inputs):
    batch_size, seq_length = inputs["input_ids"].shape
    attention_mask = inputs["attention_mask"]
    with torch.no_grad():
        past_key_values = StaticCache(config=model.config, max_cache_len=64)
        cache_position = torch.arange(seq_length)
        generated_ids = torch.zeros(batch_size, seq_length + NUM_TOKENS_TO_GENERATE + 1, dtype=torch.int)
        generated_ids[:, cache_position] = inputs["input_ids"].to(torch.int)

        logits = model(**inputs, cache_position=cache_position, cache=past_key_values,
                       return_dict=False, use_cache=True)[0]
        next_token = torch.argmax(logits[:, -1], dim=-1)[:, None]
        generated_ids[:, seq_length] = next_token[:, 0]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch_size, 1))], dim=-1)

        cache_position = torch.tensor([seq_length])
        for _ in range(1, NUM_TOKENS_TO_GENERATE):
            next_token = decode_one_tokens(model, next_token.clone(), None, cache_position, past_key_values,
                                           attention_mask=attention_mask)
            generated_ids[:, cache_position + 1] = next_token.int()
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch_size, 1))], dim=-1)
            cache_position += 1
    return generated_ids[:, seq_length:seq_length + NUM_TOKENS_TO_GENERATE]


def left_pad(prompts):
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention_mask[i, width - len(p):] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def main():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()

    prompts = [[1, 9, 4, 33, 17, 25, 40, 12, 8, 3], [1, 21, 6]]
    batched = generate(model, left_pad(prompts))
    alone = torch.cat([generate(model, left_pad([p])) for p in prompts])
    rows_changed = (batched != alone).any(dim=-1).tolist()
    print("fixed" if FIXED else "buggy", "batched", batched.tolist(), "alone", alone.tolist(),
          "rows that change when batched", rows_changed)


if __name__ == "__main__":
    main()
