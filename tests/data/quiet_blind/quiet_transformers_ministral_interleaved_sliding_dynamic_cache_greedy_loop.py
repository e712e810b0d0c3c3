# Correct program (quiet batch quiet-r116b).
# Citation: huggingface/transformers @3edd469dffb340abd4ba261e7a787650133e819b
#   src/transformers/models/ministral/modeling_ministral.py (MinistralModel.forward: `causal_mask_mapping` of
#   create_causal_mask / create_sliding_window_causal_mask picked per layer by `config.layer_types[i]`;
#   MinistralAttention passes `sliding_window` only on "sliding_attention" layers), cache_utils.py
#   (DynamicCache(config=...) giving the sliding layers a DynamicSlidingWindowLayer that keeps the last
#   sliding_window - 1 keys) and generation/utils.py (prepare_inputs_for_generation: position_ids from
#   attention_mask.cumsum(-1) - 1, pads filled with 1; the attention mask grows by one column per step).
# A tiny Ministral (three sliding layers of window 4, then a full layer, as Ministral-8B interleaves them) generates
# greedily from a left-padded batch with a hand-written decode loop over a DynamicCache, well past the window. The
# result is checked against each prompt run alone, unpadded, recomputing the whole sequence every step without a
# cache, and against model.generate on the same batch.
import torch
from transformers import DynamicCache, MinistralConfig, MinistralForCausalLM

PAD_ID = 0
MAX_NEW_TOKENS = 10


def build_model():
    config = MinistralConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        pad_token_id=PAD_ID,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = MinistralForCausalLM(config).eval()
    return model


def left_pad(prompts):
    """Collate token lists as the tokenizer does with padding_side="left"."""
    max_len = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), max_len), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), max_len), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, max_len - len(p):] = torch.tensor(p)
        attention_mask[i, max_len - len(p):] = 1
    return input_ids, attention_mask


@torch.no_grad()
def greedy_with_cache(model, input_ids, attention_mask, max_new_tokens):
    cache = DynamicCache(config=model.config)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                cache=cache, use_cache=True)
    cache = out.cache
    step_logits = [out.logits[:, -1, :]]
    next_tokens = out.logits[:, -1, :].argmax(-1)
    generated = [next_tokens]
    for _ in range(max_new_tokens - 1):
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        position_ids = position_ids[:, -1:]
        out = model(input_ids=next_tokens[:, None], attention_mask=attention_mask, position_ids=position_ids,
                    cache=cache, use_cache=True)
        cache = out.cache
        step_logits.append(out.logits[:, -1, :])
        next_tokens = out.logits[:, -1, :].argmax(-1)
        generated.append(next_tokens)
    return torch.stack(generated, dim=1), torch.stack(step_logits, dim=1)


@torch.no_grad()
def greedy_reference(model, prompt, max_new_tokens):
    """One prompt, no padding, no cache: the whole sequence is run again at every step."""
    ids = torch.tensor([prompt])
    tokens, logits = [], []
    for _ in range(max_new_tokens):
        last = model(input_ids=ids, use_cache=False).logits[:, -1, :]
        nxt = last.argmax(-1)
        tokens.append(nxt)
        logits.append(last)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    return torch.cat(tokens), torch.cat(logits)


def main():
    model = build_model()
    g = torch.Generator().manual_seed(1)
    lengths = [9, 3, 6, 1]
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    input_ids, attention_mask = left_pad(prompts)

    tokens, logits = greedy_with_cache(model, input_ids, attention_mask, MAX_NEW_TOKENS)

    worst = 0.0
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = greedy_reference(model, prompt, MAX_NEW_TOKENS)
        assert torch.equal(tokens[i], ref_tokens), (i, tokens[i].tolist(), ref_tokens.tolist())
        err = (logits[i] - ref_logits).abs().max().item()
        worst = max(worst, err)
        assert err < 1e-4, (i, err)

    with torch.no_grad():
        gen = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=MAX_NEW_TOKENS,
                             do_sample=False, pad_token_id=PAD_ID, eos_token_id=None)
    assert torch.equal(gen[:, input_ids.shape[1]:], tokens), (gen[:, input_ids.shape[1]:].tolist(), tokens.tolist())

    print("prompt lengths", lengths, "window", model.config.sliding_window, "layers", model.config.layer_types)
    print("generated", tokens.tolist())
    print(f"cached left-padded loop == per-prompt uncached reference (max logit err {worst:.2e}) == generate()")


if __name__ == "__main__":
    main()
