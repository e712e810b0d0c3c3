# huggingface/transformers#26892 (re-landed in #27503): assisted decoding called the assistant model with
# only input_ids and its cache, never the attention_mask, so the draft model attended to the prompt's pad tokens.
import sys

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


def tiny_llama(layers, seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def positions_from_mask(attention_mask):
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    return position_ids


@torch.no_grad()
def assisted_decoding(model, assistant_model, input_ids, attention_mask, max_new_tokens=6, num_assistant_tokens=4):
    model_kwargs = {"attention_mask": attention_mask}
    assistant_cache = DynamicCache()
    drafted_logits = []
    n_matches_total = 0
    start_len = input_ids.shape[-1]
    while input_ids.shape[-1] - start_len < max_new_tokens:
        cur_len = input_ids.shape[-1]
        candidate_input_ids = input_ids
        # 1. the assistant forecasts num_assistant_tokens tokens, reusing its own cache
        for _ in range(num_assistant_tokens):
            prev_seq_len = assistant_cache.get_seq_length()
            new_token_len = candidate_input_ids.shape[1] - prev_seq_len
            assist_inputs = candidate_input_ids[:, -new_token_len:]
            if FIXED:
                assistant_attention_mask = torch.cat(
                    [model_kwargs["attention_mask"],
                     model_kwargs["attention_mask"].new_ones((1, candidate_input_ids.shape[1] - cur_len))], dim=-1)
                position_ids = positions_from_mask(assistant_attention_mask)[:, -new_token_len:]
                assistant_model_outputs = assistant_model(assist_inputs, attention_mask=assistant_attention_mask,
                                                          position_ids=position_ids,
                                                          cache=assistant_cache, use_cache=True)
            else:
                assistant_model_outputs = assistant_model(assist_inputs, cache=assistant_cache, use_cache=True)
            assistant_cache = assistant_model_outputs.past_key_values or assistant_cache
            drafted_logits.append(assistant_model_outputs.logits[:, -1, :])
            new_token = assistant_model_outputs.logits[:, -1, :].argmax(dim=-1)
            candidate_input_ids = torch.cat((candidate_input_ids, new_token[:, None]), dim=-1)

        candidate_length = candidate_input_ids.shape[1] - cur_len
        # 2. the main model scores all candidates in one forward pass, with the padding mask
        candidate_mask = torch.cat(
            [model_kwargs["attention_mask"], model_kwargs["attention_mask"].new_ones((1, candidate_length))], dim=-1)
        outputs = model(candidate_input_ids, attention_mask=candidate_mask,
                        position_ids=positions_from_mask(candidate_mask))
        new_logits = outputs.logits[:, -candidate_length - 1:]
        selected_tokens = new_logits.argmax(dim=-1)
        candidate_new_tokens = candidate_input_ids[:, -candidate_length:]
        n_matches = int(((~(candidate_new_tokens == selected_tokens[:, :-1])).cumsum(dim=-1) < 1).sum())
        n_matches_total += n_matches
        valid_tokens = selected_tokens[:, : n_matches + 1]
        input_ids = torch.cat((input_ids, valid_tokens), dim=-1)
        model_kwargs["attention_mask"] = torch.cat(
            [model_kwargs["attention_mask"], model_kwargs["attention_mask"].new_ones((1, valid_tokens.shape[1]))],
            dim=-1)
        # 3. drop the assistant's cache entries for rejected tokens
        tokens_to_remove = assistant_cache.get_seq_length() - (input_ids.shape[-1] - 1)
        if tokens_to_remove > 0:
            assistant_cache.crop(-tokens_to_remove)
    return input_ids, torch.cat(drafted_logits), n_matches_total


def main():
    model = tiny_llama(layers=2, seed=0)
    assistant_model = tiny_llama(layers=2, seed=0)  # a copy of the main model: every draft should be accepted
    # one prompt, left-padded to the bucket length used by the serving code
    prompt = torch.tensor([[1, 7, 19, 23, 5, 11]])
    pad_len = 6
    input_ids = torch.cat([torch.full((1, pad_len), PAD), prompt], dim=-1)
    attention_mask = torch.cat([torch.zeros(1, pad_len, dtype=torch.long), torch.ones_like(prompt)], dim=-1)

    out, drafted_logits, n_matches = assisted_decoding(model, assistant_model, input_ids, attention_mask)

    # reference: the assistant's first draft on the unpadded prompt
    with torch.no_grad():
        ref_first = assistant_model(prompt).logits[:, -1, :]
    print("fixed" if FIXED else "buggy", "generated", out[0, input_ids.shape[1]:].tolist(),
          "accepted drafts", n_matches,
          "first draft logit max diff vs unpadded", round((drafted_logits[0] - ref_first[0]).abs().max().item(), 6))


if __name__ == "__main__":
    main()
