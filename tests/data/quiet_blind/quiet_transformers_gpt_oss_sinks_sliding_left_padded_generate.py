"""Correct program (quiet batch quiet-r89b).

Ported from huggingface/transformers src/transformers/models/gpt_oss/modeling_gpt_oss.py (installed 5.25.0:
GptOssModel.forward building `causal_mask_mapping` with create_causal_mask / create_sliding_window_causal_mask,
GptOssAttention with its learned per-head `sinks` joined to the scores in eager_attention_forward, layer_types
alternating "sliding_attention" / "full_attention") and configuration_gpt_oss.py (GptOssConfig).  The model is
built from a tiny GptOssConfig (sliding_window=4, 4 layers, 4 experts) with random weights, eager attention.

The use, as the model card shows it: a left-padded batch of chat prompts through `model.generate` (greedy,
DynamicCache).  Sliding layers keep only the last 4 positions of each row's own tokens, full layers every earlier
real token, and every head's learned sink logit soaks up probability mass in both.  Self-check: each row's
generated tokens and per-step scores equal those of the same prompt run alone, unpadded, with no cache: a greedy
loop that re-runs the whole sequence each step (attention_mask all ones).
"""
import torch
from transformers import GptOssConfig, GptOssForCausalLM

torch.manual_seed(0)

config = GptOssConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    max_position_embeddings=64,
    pad_token_id=0,
    eos_token_id=96,
    bos_token_id=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
config._attn_implementation = "eager"
model = GptOssForCausalLM(config).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if "sinks" in name:
            p.copy_(torch.randn_like(p))  # learned sink logits, one per head
        elif p.dim() >= 2:
            p.normal_(0.0, 0.2)

prompts = [
    torch.randint(2, 96, (9,)).tolist(),
    torch.randint(2, 96, (5,)).tolist(),
    torch.randint(2, 96, (7,)).tolist(),
]
max_len = max(len(p) for p in prompts)
input_ids = torch.tensor([[config.pad_token_id] * (max_len - len(p)) + p for p in prompts])
attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])

NEW = 8
with torch.no_grad():
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        use_cache=True,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=config.pad_token_id,
    )
generated = out.sequences[:, max_len:]
scores = torch.stack(out.scores, dim=1)  # (B, NEW, V)


def reference_greedy(prompt):
    ids = torch.tensor([prompt])
    step_logits = []
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[:, -1]
            logits[:, config.eos_token_id] = -float("inf")  # min_new_tokens, as generate applies it
            step_logits.append(logits[0])
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):], torch.stack(step_logits)


for b, prompt in enumerate(prompts):
    ref_tokens, ref_logits = reference_greedy(prompt)
    assert generated[b].tolist() == ref_tokens.tolist(), (b, generated[b].tolist(), ref_tokens.tolist())
    finite = torch.isfinite(ref_logits)
    err = (scores[b][finite] - ref_logits[finite]).abs().max().item()
    assert err < 1e-4, (b, err)
    print(f"row {b} (prompt {len(prompt)} tokens, {max_len - len(prompt)} pads): {generated[b].tolist()} max|dlogit|={err:.1e}")

assert max_len + NEW > 2 * config.sliding_window  # decode runs well past the window
print("ok")
