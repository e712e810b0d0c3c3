"""transformers Gemma 3 text model, Gemma-2 layout: batched left-padded `generate` into a StaticCache.

Citation: huggingface/transformers v5.25.0 (the installed release):
src/transformers/models/gemma3/modeling_gemma3.py (Gemma3TextModel.forward building one mask per layer type with
create_causal_mask / create_sliding_window_causal_mask, Gemma3Attention with attn_logit_softcapping and
query_pre_attn_scalar, eager_attention_forward; Gemma3ForCausalLM with final_logit_softcapping),
src/transformers/cache_utils.py (StaticCache: a StaticLayer per full layer, a StaticSlidingWindowLayer per sliding
layer), and the recipe of docs/source/en/kv_cache.md / llm_optims.md: a left-padding tokenizer and
`model.generate(..., cache_implementation="static")`.

The config alternates sliding and global layers as Gemma 2 does (`layer_types` given explicitly), with Gemma 2's
attention-logit and final-logit soft-capping, so the model runs eager (SDPA cannot soft-cap). Prompts are longer
than the window and decoding runs well past it, so every sliding layer's cache wraps around.

What the masking does: every real token attends, causally, the real tokens of its own row; never a left-pad
position, never a static-cache slot not written yet; on sliding layers only the last `sliding_window` positions.
Checked against a reference written here: each prompt on its own, unpadded, decoded greedily by full forwards
with no cache at all: same tokens, and the same per-step logits (float32, to 1e-4).
"""
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

PAD, EOS, BOS = 0, 1, 2


def build_model():
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=128,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        initializer_range=0.1,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


def left_pad(prompts):
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return input_ids, attention_mask


@torch.no_grad()
def reference_greedy(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    tokens, logits = [], []
    for _ in range(max_new_tokens):
        step = model(input_ids=ids, use_cache=False).logits[:, -1]
        nxt = step.argmax(-1)
        tokens.append(nxt.item())
        logits.append(step[0])
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    return tokens, torch.stack(logits)


def main():
    model = build_model()
    prompts = [
        [BOS, 11, 12, 13, 14, 15, 16, 17, 18, 19],
        [BOS, 40, 41, 42, 43, 44],
        [BOS, 70, 71],
        [BOS, 90, 91, 92, 93, 94, 95, 96],
    ]
    max_new_tokens = 8
    input_ids, attention_mask = left_pad(prompts)
    width = input_ids.shape[1]

    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            cache_implementation="static",
            eos_token_id=None,
            return_dict_in_generate=True,
            output_logits=True,
        )
    generated = out.sequences[:, width:]
    step_logits = torch.stack(out.logits, dim=1)  # [batch, steps, vocab]

    worst = 0.0
    for row, prompt in enumerate(prompts):
        ref_tokens, ref_logits = reference_greedy(model, prompt, max_new_tokens)
        assert generated[row].tolist() == ref_tokens, (row, generated[row].tolist(), ref_tokens)
        err = (step_logits[row] - ref_logits).abs().max().item()
        worst = max(worst, err)
        assert err < 1e-4, (row, err)
        print(f"row {row}: prompt {len(prompt):2d} tokens, generated {ref_tokens}")
    print(f"batched static-cache generate == per-prompt no-cache greedy (max logit err {worst:.1e})")


if __name__ == "__main__":
    main()
