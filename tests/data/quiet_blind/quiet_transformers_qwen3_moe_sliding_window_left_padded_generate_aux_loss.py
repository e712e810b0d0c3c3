"""Correct program: a tiny Qwen3-MoE (top-2 of 4 experts with norm_topk_prob, a dense MLP on layer 0 via
mlp_only_layers, sliding-window attention on every layer) generating greedily from a LEFT-padded batch
with its sliding-window cache, and scoring the router's load-balancing loss over that padded batch.

Citation: huggingface/transformers, release v5.25.0 as installed here:
  src/transformers/models/qwen3_moe/modeling_qwen3_moe.py (Qwen3MoeModel.forward: `mask_function =
  create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask`,
  one 4-D mask handed to every decoder layer; Qwen3MoeAttention passes `sliding_window` to the attention
  function; Qwen3MoeSparseMoeBlock top-k router; Qwen3MoeForCausalLM.forward hands the 2-D
  attention_mask to load_balancing_loss_func, which weights each row's expert counts and router
  probabilities by the flat mask), src/transformers/models/qwen3_moe/configuration_qwen3_moe.py
  (`sliding_window` kept only when use_sliding_window), src/transformers/masking_utils.py
  (create_sliding_window_causal_mask), used as the library ships it, built from Qwen3MoeConfig with
  tiny sizes (SDPA).

Three prompts of 8, 5 and 3 tokens are left padded as a tokenizer with padding_side="left" and
pad_token = eos_token does (pad id 2); `generate` derives position ids from the mask and extends it
by one column per new token; the window (4 keys) is shorter than the longest prompt, so the long
prompt's later tokens and every generated token see only their last 4 positions.

Self-check against references written here:
  * each prompt alone, unpadded, with no mask and no cache: the batched prefill logits and the router
    logits of every sparse layer at every real position equal the single-prompt forward's;
  * greedy generation of 6 tokens gives each prompt the tokens (and per-step logits) of a plain
    greedy loop that re-runs the unpadded prompt from scratch for every new token;
  * the batched aux_loss equals the Switch-Transformer loss written out by hand over the real tokens
    only (the single-prompt router logits, concatenated; pads never counted).
"""
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

torch.manual_seed(0)

config = Qwen3MoeConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[0],
    use_sliding_window=True,
    sliding_window=4,
    max_position_embeddings=64,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
config._attn_implementation = "sdpa"
model = Qwen3MoeForCausalLM(config).eval()

prompts = [
    [1, 17, 33, 9, 44, 21, 5, 38],
    [1, 40, 12, 27, 8],
    [1, 60, 23],
]
max_len = max(len(p) for p in prompts)
PAD = config.eos_token_id  # tokenizer.pad_token = tokenizer.eos_token
input_ids = torch.tensor([[PAD] * (max_len - len(p)) + p for p in prompts])
attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])
NEW = 6
E, K = config.num_experts, config.num_experts_per_tok

with torch.no_grad():
    # batched prefill, with the position ids generate's first step derives from the mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batched = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        output_router_logits=True,
    )
    # router_logits: one (batch * seq, E) tensor per sparse layer
    batched_router = [r.view(len(prompts), max_len, E) for r in batched.router_logits]
    assert len(batched_router) == config.num_hidden_layers - len(config.mlp_only_layers)

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

    real_router = [[] for _ in batched_router]
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        alone = model(input_ids=torch.tensor([prompt]), output_router_logits=True)
        got = batched.logits[b, max_len - n :]
        assert torch.allclose(got, alone.logits[0], atol=1e-4), (b, (got - alone.logits[0]).abs().max())
        for layer, (r_batched, r_alone) in enumerate(zip(batched_router, alone.router_logits)):
            assert torch.allclose(r_batched[b, max_len - n :], r_alone, atol=1e-4), (b, layer)
            real_router[layer].append(r_alone)

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
            assert torch.allclose(step_logits[keep], ref_logits[keep], atol=1e-3), (
                b,
                step,
                (step_logits[keep] - ref_logits[keep]).abs().max(),
            )
            seq.append(nxt)

    # Switch-Transformer load-balancing loss over the real tokens only, written out by hand:
    # E * sum_e (fraction of top-k assignments to e) * (mean router probability of e), over all layers
    counts = torch.zeros(E)
    prob_sum = torch.zeros(E)
    rows = 0
    for layer_logits in real_router:
        logits = torch.cat(layer_logits, dim=0)  # (real tokens, E)
        probs = logits.float().softmax(-1)
        for t in range(probs.shape[0]):
            for e in probs[t].topk(K).indices.tolist():
                counts[e] += 1
            prob_sum += probs[t]
        rows += probs.shape[0]
    ref_aux = E * ((counts / rows) * (prob_sum / rows)).sum()
    assert torch.allclose(batched.aux_loss, ref_aux, atol=1e-5), (batched.aux_loss, ref_aux)

print("qwen3-moe sliding-window left-padded generate matches per-prompt greedy:", gen_tokens.tolist())
print("aux_loss over real tokens:", round(float(batched.aux_loss), 6))
