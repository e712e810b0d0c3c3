"""Correct program: a tiny Zamba2 (Mamba2 mixer layers, with two shared transformer blocks, RoPE and
per-call-site LoRA adapters, interleaved as "hybrid" layers) generating greedily from a LEFT-padded
batch with its hybrid cache.

Citation: huggingface/transformers, release v5.25.0 as installed here:
  src/transformers/models/zamba2/modeling_zamba2.py (Zamba2Model.forward: causal_mask_mapping with
  "full_attention" -> create_causal_mask and "linear_attention" -> create_recurrent_attention_mask;
  every layer is handed both, Zamba2HybridLayer.forward gives the 4-D mask (`causal_mask`) to the
  shared transformer and the 2-D mask (`attention_mask`) to its Mamba decoder; Zamba2MambaMixer.forward
  applies apply_mask_to_padding_states to the input and to hidden_states_B_C before the chunked scan),
  src/transformers/masking_utils.py (create_recurrent_attention_mask: the 2-D padding mask trimmed to
  the local length, None on a one-token decode step), used as the library ships it, built from
  Zamba2Config with tiny sizes (PyTorch conv/scan path, no kernels, chunk_size 4 so the left padding
  spans a chunk boundary).

Three prompts of 9, 5 and 2 tokens are left padded as a tokenizer with padding_side="left" and
pad_token = eos_token does (pad id 2, whose embedding is not the zero row of padding_idx 0);
`generate` derives position ids from the attention mask (RoPE in the shared blocks) and extends the
mask by one column per generated token.

Self-check against a reference written here: each prompt alone, unpadded, with no mask and no cache,
re-run from scratch for every new token (a plain greedy loop):
  * the batched prefill logits at every real position equal the single-prompt forward;
  * greedy generation of 6 tokens gives each prompt the tokens it gets alone, and the logits of
    every generated step equal the reference's.
"""
import torch
from transformers import Zamba2Config, Zamba2ForCausalLM

torch.manual_seed(0)

config = Zamba2Config(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=5,
    layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "mamba"],
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_ngroups=1,
    n_mamba_heads=4,
    chunk_size=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_mem_blocks=2,
    use_shared_attention_adapter=True,
    adapter_rank=4,
    use_mem_rope=True,
    intermediate_size=64,
    max_position_embeddings=64,
    initializer_range=0.2,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
config._attn_implementation = "sdpa"
model = Zamba2ForCausalLM(config).eval()

prompts = [
    [1, 17, 33, 9, 44, 21, 5, 38, 11],
    [1, 40, 12, 27, 8],
    [1, 60],
]
max_len = max(len(p) for p in prompts)
PAD = config.eos_token_id  # tokenizer.pad_token = tokenizer.eos_token
input_ids = torch.tensor([[PAD] * (max_len - len(p)) + p for p in prompts])
attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])
NEW = 6

with torch.no_grad():
    # batched prefill, with the position ids generate's first step derives from the mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batched_logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=0
    ).logits

    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=PAD,
    )
    gen_tokens = out.sequences[:, max_len:]
    gen_logits = torch.stack(out.logits, dim=1)  # (batch, NEW, vocab)

    for b, prompt in enumerate(prompts):
        n = len(prompt)
        alone = model(input_ids=torch.tensor([prompt]), logits_to_keep=0).logits[0]
        got = batched_logits[b, max_len - n :]
        assert torch.allclose(got, alone, atol=1e-3), (b, (got - alone).abs().max())

        seq = list(prompt)
        for step in range(NEW):
            ref_logits = model(input_ids=torch.tensor([seq]), logits_to_keep=0).logits[0, -1]
            # generate suppresses EOS until min_new_tokens; do the same in the reference
            masked = ref_logits.clone()
            masked[config.eos_token_id] = float("-inf")
            nxt = int(masked.argmax())
            assert int(gen_tokens[b, step]) == nxt, (b, step, gen_tokens[b].tolist())
            step_logits = gen_logits[b, step]
            keep = torch.isfinite(step_logits)
            assert torch.allclose(step_logits[keep], ref_logits[keep], atol=1e-3), (
                b,
                step,
                (step_logits[keep] - ref_logits[keep]).abs().max(),
            )
            seq.append(nxt)

print("zamba2 left-padded hybrid generate matches per-prompt greedy:", gen_tokens.tolist())
