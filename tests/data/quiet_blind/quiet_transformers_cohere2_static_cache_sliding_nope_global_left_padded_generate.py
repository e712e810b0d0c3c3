# Citation: huggingface/transformers v5.25.0 (installed) and src/transformers/models/cohere2/modeling_cohere2.py
#   @ca095230eda56a13ead849509f02fbaaa9b3f0e0 (Cohere2Config layer_types from sliding_window_pattern; Cohere2Model.forward
#   builds {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}; RoPE only
#   on the sliding layers, the full layers are NoPE), src/transformers/masking_utils.py, src/transformers/cache_utils.py
#   (StaticCache: StaticSlidingWindowLayer for the sliding layers, StaticLayer for the full ones) and
#   src/transformers/generation/utils.py (cache_implementation="static", position_ids from the 2-D attention_mask).
# A tiny Cohere2 (sliding window 4, every second layer global) greedily continues a left-padded batch of three prompts,
# two of them longer than the window, through generate with a static cache. The result is checked against each prompt
# run alone, unpadded, with no cache, recomputing the whole sequence each step under a 4-D mask dict written here.
import torch
from transformers import Cohere2Config, Cohere2ForCausalLM

torch.manual_seed(0)
config = Cohere2Config(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    sliding_window=4,
    sliding_window_pattern=2,
    logit_scale=1.0,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="sdpa",
)
model = Cohere2ForCausalLM(config).eval()
max_new_tokens = 8

prompts = [
    [1, 17, 33, 54, 9, 71, 23, 60, 44],
    [1, 88, 5],
    [1, 40, 41, 42, 43, 12, 77],
]
max_len = max(len(p) for p in prompts)
input_ids = torch.tensor([[config.pad_token_id] * (max_len - len(p)) + p for p in prompts])
attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])

with torch.no_grad():
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        cache_implementation="static",
        return_dict_in_generate=True,
        output_logits=True,
    )
generated = out.sequences[:, max_len:]
step_logits = torch.stack(out.logits, dim=1)  # (batch, new tokens, vocab)


def reference_masks(length):
    # Additive masks as eager/SDPA take them: query i sees key j when j <= i, and on the sliding layers j > i - window.
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    neg = torch.finfo(torch.float32).min
    causal = k <= q
    sliding = causal & (k > q - config.sliding_window)
    to_additive = lambda keep: torch.zeros(length, length).masked_fill(~keep, neg)[None, None]
    return {"full_attention": to_additive(causal), "sliding_attention": to_additive(sliding)}


def greedy_alone(prompt):
    ids = torch.tensor([prompt])
    logits_seen = []
    for _ in range(max_new_tokens):
        length = ids.shape[1]
        logits = model(
            input_ids=ids,
            attention_mask=reference_masks(length),
            position_ids=torch.arange(length)[None],
            use_cache=False,
        ).logits[:, -1]
        logits_seen.append(logits[0].clone())  # raw scores, as output_logits returns them
        logits[:, config.eos_token_id] = float("-inf")  # min_new_tokens, as generate applies it
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):], torch.stack(logits_seen)


with torch.no_grad():
    for row, prompt in enumerate(prompts):
        ref_tokens, ref_logits = greedy_alone(prompt)
        assert torch.equal(generated[row], ref_tokens), (row, generated[row].tolist(), ref_tokens.tolist())
        assert torch.allclose(step_logits[row], ref_logits, atol=1e-4), (row, (step_logits[row] - ref_logits).abs().max())

print("generated", generated.tolist())
print("static-cache left-padded generate matches each prompt alone without a cache")
