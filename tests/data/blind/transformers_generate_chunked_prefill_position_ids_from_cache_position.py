# huggingface/transformers#43132 (fixes #43082): GenerationMixin._prefill's chunked-prefill branch
# (generation_config.prefill_chunk_size set) wrote `model_kwargs["position_ids"] = cache_position.unsqueeze(0)`
# for every chunk, so on a left-padded batch each row's prompt got the cache slots' positions (padding counted)
# while the decode steps after it take their positions from the attention mask (padding not counted): a
# left-padded row's keys and queries no longer agree on where its tokens are. The fix stops forcing
# position_ids there: they come from the attention mask, as in the unchunked prefill, sliced per chunk.
# Pre-fix code: src/transformers/generation/utils.py _prefill (v5.0.0rc1); post-fix: installed 5.25 _prefill.
import sys

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
PAD = 0


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval()


def prepare_inputs_for_generation(input_ids, cache=None, attention_mask=None, cache_position=None,
                                  position_ids=None, **kwargs):
    # slice to the tokens the cache has not seen yet
    if cache is not None and cache_position is not None:
        input_ids = input_ids[:, -cache_position.shape[0]:]
    # create position_ids on the fly from the attention mask when the caller gave none
    if attention_mask is not None and position_ids is None:
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
    if position_ids is not None and position_ids.shape[-1] != input_ids.shape[-1]:
        position_ids = position_ids[..., -input_ids.shape[1]:]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "cache": cache, "use_cache": True}


@torch.no_grad()
def _prefill(model, input_ids, prefill_chunk_size, model_kwargs):
    # Only prefill up to the token just before last, so that decoding is completely performed outside this function
    prefill_input_ids = input_ids[:, :-1]
    chunk_size = prefill_chunk_size
    input_chunks = torch.split(prefill_input_ids, chunk_size, dim=-1)

    if "cache" not in model_kwargs:
        raise ValueError("Cannot use prefill chunking without a cache")

    attention_mask = model_kwargs.pop("attention_mask", None)
    position_ids = model_kwargs.pop("position_ids", None)
    past_length = 0
    for input_chunk in input_chunks:
        current_length = past_length + input_chunk.shape[-1]
        # Prepare inputs
        if attention_mask is not None:
            model_kwargs["attention_mask"] = attention_mask[:, :current_length]
        model_kwargs["cache_position"] = torch.arange(past_length, current_length, dtype=torch.long,
                                                      device=input_chunk.device)
        if not FIXED:
            model_kwargs["position_ids"] = model_kwargs["cache_position"].unsqueeze(0)
        elif position_ids is not None:
            model_kwargs["position_ids"] = position_ids[..., past_length:current_length]
        model_inputs = prepare_inputs_for_generation(input_chunk, **model_kwargs)

        outputs = model(**model_inputs, return_dict=True)

        model_kwargs["cache"] = outputs.cache
        past_length = current_length

    model_kwargs["attention_mask"] = attention_mask
    model_kwargs["cache_position"] = model_kwargs["cache_position"][-1:] + 1
    _ = model_kwargs.pop("position_ids", None)
    return model_kwargs


@torch.no_grad()
def greedy_generate(model, input_ids, attention_mask, max_new_tokens, prefill_chunk_size):
    model_kwargs = {"attention_mask": attention_mask, "cache": DynamicCache()}
    if FIXED:
        # generate() now builds the prompt's position_ids from the mask before the prefill
        position_ids = attention_mask.long().cumsum(-1) - 1
        model_kwargs["position_ids"] = position_ids.masked_fill(attention_mask == 0, 0)
    model_kwargs = _prefill(model, input_ids, prefill_chunk_size, model_kwargs)
    step_logits = []
    for _ in range(max_new_tokens):
        model_inputs = prepare_inputs_for_generation(input_ids, **model_kwargs)
        outputs = model(**model_inputs, return_dict=True)
        next_token_logits = outputs.logits[:, -1, :].float()
        step_logits.append(next_token_logits)
        next_tokens = next_token_logits.argmax(dim=-1)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        model_kwargs["cache"] = outputs.cache
        model_kwargs["attention_mask"] = torch.cat(
            [model_kwargs["attention_mask"], model_kwargs["attention_mask"].new_ones((input_ids.shape[0], 1))], dim=-1)
        model_kwargs["cache_position"] = model_kwargs["cache_position"][-1:] + 1
    return input_ids, torch.stack(step_logits, dim=1)


def main():
    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    long_prompt = torch.randint(3, 64, (11,), generator=g)
    short_prompt = torch.randint(3, 64, (6,), generator=g)
    # a tokenizer with padding_side="left" for generation
    input_ids = torch.full((2, 11), PAD, dtype=torch.long)
    attention_mask = torch.zeros((2, 11), dtype=torch.long)
    input_ids[0] = long_prompt
    attention_mask[0] = 1
    input_ids[1, 5:] = short_prompt
    attention_mask[1, 5:] = 1

    sequences, logits = greedy_generate(model, input_ids, attention_mask, max_new_tokens=6, prefill_chunk_size=4)
    print("fixed" if FIXED else "buggy")
    for row in range(2):
        print(f"row {row} new tokens: {sequences[row, 11:].tolist()}")
        print(f"row {row} first-step logits[:4]: {[round(v, 4) for v in logits[row, 0, :4].tolist()]}")


if __name__ == "__main__":
    main()
