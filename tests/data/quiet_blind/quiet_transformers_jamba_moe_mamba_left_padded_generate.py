"""Correct program: a tiny Jamba (Mamba mixers interleaved with attention layers, sparse top-2 MoE
feed-forwards every other layer) generating greedily from a LEFT-padded batch with its hybrid cache.

Citation: huggingface/transformers, release v5.25.0 as installed here:
  src/transformers/models/jamba/modeling_jamba.py (JambaModel.forward: causal_mask_mapping with
  "full_attention" -> create_causal_mask and "linear_attention" -> create_recurrent_attention_mask,
  handed per layer through config.layer_types; JambaMambaMixer.forward: apply_mask_to_padding_states
  on the input and on hidden_states_B_C before the conv/scan; JambaSparseMoeBlock top-k router),
  src/transformers/masking_utils.py (create_recurrent_attention_mask: the 2-D padding mask trimmed to
  the local length, None on a one-token decode step), used as the library ships it, built from
  JambaConfig with tiny sizes (PyTorch scan, no kernels).

Three prompts of 7, 4 and 2 tokens are left padded (pad id 0) as a tokenizer with padding_side="left"
does; `generate` derives position ids from the attention mask and extends the mask by one column per
generated token.  The attention layers get the 4-D causal + padding mask, the Mamba layers get the
2-D mask on the prefill and nothing on the decode steps (a generated token is never padding).

Self-check against a reference written here: each prompt alone, unpadded, with no mask and no cache,
re-run from scratch for every new token (a plain greedy loop):
  * the batched prefill logits at every real position equal the single-prompt forward;
  * greedy generation of 6 tokens gives each prompt the tokens it gets alone, and the logits of
    every generated step equal the reference's.
"""
import torch
from transformers import JambaConfig, JambaForCausalLM

torch.manual_seed(0)

config = JambaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    expert_layer_period=2,
    expert_layer_offset=1,
    attn_layer_period=2,
    attn_layer_offset=1,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_dt_rank=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    max_position_embeddings=64,
)
config._attn_implementation = "sdpa"
model = JambaForCausalLM(config).eval()

prompts = [
    [1, 17, 33, 9, 44, 21, 5],
    [1, 40, 12, 27],
    [1, 60],
]
max_len = max(len(p) for p in prompts)
input_ids = torch.tensor([[config.pad_token_id] * (max_len - len(p)) + p for p in prompts])
attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])
NEW = 6

with torch.no_grad():
    # batched prefill, the way generate's first step computes position ids from the mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batched_logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits

    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=config.pad_token_id,
    )
    gen_tokens = out.sequences[:, max_len:]
    gen_logits = torch.stack(out.logits, dim=1)  # (batch, NEW, vocab)

    for b, prompt in enumerate(prompts):
        n = len(prompt)
        alone = model(input_ids=torch.tensor([prompt])).logits[0]
        got = batched_logits[b, max_len - n :]
        assert torch.allclose(got, alone, atol=1e-4), (b, (got - alone).abs().max())

        seq = list(prompt)
        for step in range(NEW):
            ref_logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            # generate suppresses EOS until min_new_tokens; do the same in the reference
            masked = ref_logits.clone()
            masked[config.eos_token_id] = float("-inf")
            nxt = int(masked.argmax())
            assert int(gen_tokens[b, step]) == nxt, (b, step, gen_tokens[b].tolist())
            step_logits = gen_logits[b, step]
            keep = torch.isfinite(step_logits)
            assert torch.allclose(step_logits[keep], ref_logits[keep], atol=1e-4), (
                b,
                step,
                (step_logits[keep] - ref_logits[keep]).abs().max(),
            )
            seq.append(nxt)

print("jamba left-padded hybrid generate matches per-prompt greedy:", gen_tokens.tolist())
