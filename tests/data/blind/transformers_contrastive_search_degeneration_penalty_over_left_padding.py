# Citation: huggingface/transformers#33507 ("Fix contrastive search to correctly handle input with
#   padding"), merged for v4.46.
# Upstream: src/transformers/generation/utils.py -- GenerationMixin._contrastive_search (non
#   low_memory path: cache batch_repeat_interleave(top_k), one forward over the B*K candidates,
#   batch_select_indices(augmented_idx)) and _ranking_fast; LlamaForCausalLM
#   .prepare_inputs_for_generation (position_ids from the attention_mask cumsum) and
#   _update_model_kwargs_for_generation (a ones column appended to attention_mask each step).
# Bug: the degeneration penalty of contrastive search is the max cosine similarity between a
#   candidate's last hidden state and every earlier last hidden state of its row. With a
#   left-padded batch those earlier states include the pad positions, so a pad token's hidden
#   state can be the maximum and decide which candidate is picked: the padded row generates
#   differently from the same prompt run alone.
# Fix: _contrastive_search builds cosine_matrix_mask from the attention_mask (decoder_attention_mask
#   for encoder-decoders), repeat_interleaves it top_k times, grows it by a ones column per step, and
#   _ranking_fast adds (1 - mask) * finfo.min to the cosine matrix before the max.
import sys

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _ranking_fast(context_hidden, next_hidden, next_top_k_probs, *args):
    """
    Reranks the top_k candidates based on a degeneration penalty (cosine similarity with previous tokens), as described
    in the paper "A Contrastive Framework for Neural Text Generation". Returns the index of the best candidate for each
    row in the batch.
    """
    if FIXED:
        cosine_matrix_mask, alpha, beam_width = args
    else:
        alpha, beam_width = args
    norm_context_hidden = context_hidden / context_hidden.norm(dim=2, keepdim=True)
    norm_next_hidden = next_hidden / next_hidden.norm(dim=2, keepdim=True)
    cosine_matrix = torch.matmul(norm_context_hidden, norm_next_hidden.transpose(1, 2)).squeeze(-1)  # [B*K, S]

    if FIXED:
        # Penalize cosine_matrix based on the cosine_matrix_mask (ignore padding positions)
        # Using a large negative value for masked positions
        cosine_matrix_mask = cosine_matrix_mask.to(dtype=cosine_matrix.dtype)
        cosine_matrix_mask = (1 - cosine_matrix_mask) * torch.finfo(cosine_matrix.dtype).min
        cosine_matrix = cosine_matrix + cosine_matrix_mask

    degeneration_penalty, _ = torch.max(cosine_matrix, dim=-1)  # [B*K]
    next_top_k_probs = next_top_k_probs.view(-1)  # [B*K]
    contrastive_score = (1.0 - alpha) * next_top_k_probs - alpha * degeneration_penalty
    contrastive_score = torch.stack(torch.split(contrastive_score, beam_width))  # [B, K]
    _, selected_idx = contrastive_score.max(dim=-1)  # [B]
    return selected_idx


def prepare_inputs_for_generation(input_ids, past_key_values=None, attention_mask=None, cache_position=None,
                                  use_cache=True, **kwargs):
    # LlamaForCausalLM.prepare_inputs_for_generation (v4.45)
    if past_key_values is not None:
        if input_ids.shape[1] != cache_position.shape[0]:
            input_ids = input_ids[:, cache_position]

    position_ids = None
    if attention_mask is not None:
        # create position_ids on the fly for batch generation
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        if past_key_values is not None and past_key_values.get_seq_length() > 0:
            position_ids = position_ids[:, -input_ids.shape[1]:]
            position_ids = position_ids.clone(memory_format=torch.contiguous_format)

    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "cache_position": cache_position,
        "past_key_values": past_key_values,
        "use_cache": use_cache,
        "attention_mask": attention_mask,
    }


def _update_model_kwargs_for_generation(outputs, model_kwargs, num_new_tokens=1):
    model_kwargs["past_key_values"] = outputs.past_key_values
    attention_mask = model_kwargs["attention_mask"]
    model_kwargs["attention_mask"] = torch.cat(
        [attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1
    )
    model_kwargs["cache_position"] = model_kwargs["cache_position"][-1:] + num_new_tokens
    return model_kwargs


@torch.no_grad()
def contrastive_search(model, input_ids, attention_mask, top_k, penalty_alpha, max_new_tokens):
    batch_size = input_ids.shape[0]
    model_kwargs = {
        "attention_mask": attention_mask,
        "past_key_values": DynamicCache(config=model.config),
        "cache_position": torch.arange(input_ids.shape[1]),
    }

    if FIXED:
        # Create cosine_matrix_mask based on the attention_mask
        cosine_matrix_mask = torch.ones_like(input_ids, dtype=torch.long)
        cosine_matrix_mask = model_kwargs["attention_mask"]
        cosine_matrix_mask = cosine_matrix_mask.repeat_interleave(top_k, dim=0)

    for step in range(max_new_tokens):
        if model_kwargs["past_key_values"].get_seq_length() == 0:
            model_kwargs["use_cache"] = True
            model_inputs = prepare_inputs_for_generation(input_ids, **model_kwargs)
            outputs = model(**model_inputs, return_dict=True, output_hidden_states=True)

            # last decoder hidden states will be used to compute the degeneration penalty (cosine similarity with
            # previous tokens)
            last_hidden_states = outputs.hidden_states[-1]
            logit_for_next_step = outputs.logits[:, -1, :].clone().float()

            model_kwargs = _update_model_kwargs_for_generation(outputs, model_kwargs)
            # Expands model inputs top_k times, for batched forward passes (akin to beam search).
            model_kwargs["attention_mask"] = model_kwargs["attention_mask"].repeat_interleave(top_k, dim=0)

        # contrastive search decoding consists of two steps: (1) candidate tokens recall; (2) candidate re-rank by
        # degeneration penalty
        next_probs = nn.functional.softmax(logit_for_next_step, dim=-1)
        top_k_probs, top_k_ids = torch.topk(next_probs, dim=-1, k=top_k)
        del outputs

        # Replicates the new past_key_values to match the `top_k` candidates
        past = model_kwargs["past_key_values"]
        past.batch_repeat_interleave(top_k)
        model_kwargs["past_key_values"] = past

        # compute the candidate tokens by the language model and collect their hidden_states
        next_model_inputs = prepare_inputs_for_generation(top_k_ids.view(-1, 1), **model_kwargs)
        outputs = model(**next_model_inputs, return_dict=True, output_hidden_states=True)
        del next_model_inputs

        next_hidden = outputs.hidden_states[-1]
        logits = outputs.logits[:, -1, :].float()
        context_hidden = last_hidden_states.repeat_interleave(top_k, dim=0)

        # compute the degeneration penalty and re-rank the candidates based on the degeneration penalty and the
        # model confidence.
        if FIXED:
            selected_idx = _ranking_fast(
                context_hidden, next_hidden, top_k_probs, cosine_matrix_mask, penalty_alpha, top_k
            )
            cosine_matrix_mask = torch.cat(
                [cosine_matrix_mask, cosine_matrix_mask.new_ones((cosine_matrix_mask.shape[0], 1))], dim=-1
            )
        else:
            selected_idx = _ranking_fast(context_hidden, next_hidden, top_k_probs, penalty_alpha, top_k)
        selected_idx = selected_idx.to("cpu")

        augmented_idx = torch.tensor([x + i * top_k for i, x in enumerate(selected_idx)])

        # prepare for the next step: (1) next token_id; (2) past_key_values; (3) last_hidden_states for computing
        # the degeneration penalty; (4) logits for selecting next top-k candidates
        next_tokens = top_k_ids[range(len(top_k_ids)), selected_idx]
        next_hidden = torch.stack(torch.split(next_hidden.squeeze(dim=1), top_k))
        next_hidden = next_hidden[range(batch_size), selected_idx, :]
        last_hidden_states = torch.cat([last_hidden_states, next_hidden.unsqueeze(1)], dim=1)

        next_past_key_values = outputs.past_key_values
        next_past_key_values.batch_select_indices(augmented_idx)

        logit_for_next_step = torch.stack(torch.split(logits, top_k))[range(batch_size), selected_idx, :]

        model_kwargs = _update_model_kwargs_for_generation(outputs, model_kwargs)
        model_kwargs["past_key_values"] = next_past_key_values

        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)

    return input_ids


def main():
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()

    pad = config.pad_token_id
    prompts = [
        [1, 17, 42, 8, 63, 25, 71, 33, 90, 12],
        [1, 54, 9, 77, 31],
    ]
    # tokenizer.padding_side = "left"
    max_len = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (max_len - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])

    out = contrastive_search(model, input_ids, attention_mask, top_k=4, penalty_alpha=0.6, max_new_tokens=12)
    for row in out.tolist():
        print(row[max_len:])


if __name__ == "__main__":
    main()
