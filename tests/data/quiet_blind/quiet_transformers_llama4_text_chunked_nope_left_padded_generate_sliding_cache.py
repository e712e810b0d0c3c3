# Citation: huggingface/transformers v5.25.0 (installed): src/transformers/models/llama4/configuration_llama4.py
#   (Llama4TextConfig: no_rope_layers from no_rope_layer_interval, layer_types "chunked_attention" on the RoPE layers and
#   "full_attention" on the NoPE layers, moe_layers from interleave_moe_layer_step), models/llama4/modeling_llama4.py
#   (Llama4TextModel.forward builds {"full_attention": create_causal_mask, "chunked_attention": create_chunked_causal_mask}
#   unless handed a dict; Llama4TextAttention: RoPE + qk_norm on chunked layers, temperature tuning on NoPE layers),
#   src/transformers/masking_utils.py (create_chunked_causal_mask: chunks counted from each row's first real token) and
#   src/transformers/cache_utils.py (DynamicCache: a DynamicSlidingWindowLayer of attention_chunk_size for the chunked
#   layers, keeping its last chunk - 1 keys), src/transformers/generation/utils.py (position_ids from the 2-D mask).
# A tiny Llama 4 text model (iRoPE: three chunked RoPE layers then one NoPE global layer, chunks of 4, two MoE layers)
# greedily continues a left-padded batch of three prompts (10, 3 and 7 tokens) through generate with its default
# DynamicCache, then scores the finished left-padded batch in one forward with position_ids from the attention mask.
# Both are checked against each sequence run alone, unpadded, without a cache, under masks written here per layer type.
import torch
from transformers import GenerationConfig, Llama4ForCausalLM, Llama4TextConfig

torch.manual_seed(0)
CHUNK = 4
config = Llama4TextConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=64,
    intermediate_size_mlp=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    no_rope_layer_interval=4,
    attention_chunk_size=CHUNK,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="sdpa",
)
assert config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
model = Llama4ForCausalLM(config).double().eval()

PAD = config.pad_token_id
prompts = [torch.randint(3, config.vocab_size, (n,)) for n in (10, 3, 7)]
P = max(len(p) for p in prompts)
input_ids = torch.full((len(prompts), P), PAD, dtype=torch.long)
attention_mask = torch.zeros(len(prompts), P, dtype=torch.long)
for row, prompt in enumerate(prompts):  # left padding, as a tokenizer with padding_side="left" returns it
    input_ids[row, P - len(prompt):] = prompt
    attention_mask[row, P - len(prompt):] = 1

NEW = 7
gen_config = GenerationConfig(
    max_new_tokens=NEW,
    do_sample=False,
    pad_token_id=PAD,
    eos_token_id=None,
    bos_token_id=config.bos_token_id,
    return_dict_in_generate=True,
    output_logits=True,
)
with torch.no_grad():
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=gen_config,
    )
generated = out.sequences[:, P:]
step_logits = torch.stack(out.logits, dim=1)  # (B, NEW, V), generate hands them back in float32


def reference_masks(length):
    """The two masks Llama 4 uses, for one unpadded sequence, written as a double loop (True = may attend)."""
    full = torch.zeros(length, length, dtype=torch.bool)
    chunked = torch.zeros(length, length, dtype=torch.bool)
    for q in range(length):
        for k in range(q + 1):
            full[q, k] = True
            chunked[q, k] = k // CHUNK == q // CHUNK
    return {"full_attention": full[None, None], "chunked_attention": chunked[None, None]}


def reference_logits(tokens):
    with torch.no_grad():
        return model(input_ids=tokens[None], attention_mask=reference_masks(len(tokens)), use_cache=False).logits[0]


for row, prompt in enumerate(prompts):
    seq = prompt.clone()
    for step in range(NEW):
        logits = reference_logits(seq)[-1]
        torch.testing.assert_close(step_logits[row, step], logits.float(), rtol=1e-5, atol=1e-5)
        nxt = logits.argmax()
        assert nxt == generated[row, step], (row, step)
        seq = torch.cat([seq, nxt[None]])

# Score the finished batch in one forward, still left-padded: positions count each row's real tokens from 0.
sequences = out.sequences
full_mask = torch.cat([attention_mask, torch.ones_like(generated)], dim=1)
position_ids = full_mask.cumsum(-1) - 1
position_ids.masked_fill_(full_mask == 0, 1)
with torch.no_grad():
    logits = model(input_ids=sequences, attention_mask=full_mask, position_ids=position_ids).logits
logprobs = logits[:, :-1].log_softmax(-1).gather(-1, sequences[:, 1:, None])[..., 0]
for row, prompt in enumerate(prompts):
    start = P - len(prompt)
    seq = sequences[row, start:]
    ref = reference_logits(seq)
    torch.testing.assert_close(logits[row, start:], ref, rtol=1e-9, atol=1e-9)
    ref_logprobs = ref[:-1].log_softmax(-1).gather(-1, seq[1:, None])[:, 0]
    torch.testing.assert_close(logprobs[row, start:], ref_logprobs, rtol=1e-9, atol=1e-9)
    print(f"row {row}: prompt {len(prompt)} tokens, generated {generated[row].tolist()}, "
          f"log-likelihood {ref_logprobs.sum().item():.4f}")
print("generate and batched scoring match each sequence run alone")
