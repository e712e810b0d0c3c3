"""Correct program: a tiny Mixtral (top-2 sparse MoE) over a left-padded batch, with the router's
load-balancing loss told which tokens are padding.

Citation: huggingface/transformers @af3efdd71ee5b568dfdb71bb41d316df830147af
  src/transformers/models/mixtral/modeling_mixtral.py (MixtralSparseMoeBlock / router top-k,
  load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask),
  MixtralForCausalLM.forward passing `attention_mask` to it, the causal + padding mask of
  MixtralModel), used as the library ships it (built from MixtralConfig, tiny sizes).

Three prompts of 7, 4 and 2 tokens are LEFT padded (pad id 0, attention_mask 0) as a tokenizer with
padding_side="left" does, position ids come from the mask inside generate, labels are -100 on the pads and on each
prompt's BOS (after the shift a pad row would be asked to predict it).
The router sees every row (pads included) but the aux loss weights rows by the attention mask, so
the padding rows neither count as routed tokens nor as router probability mass.

Self-check against a reference written here: each prompt run alone, unpadded:
  * logits at every real position equal the single-prompt forward;
  * the batched aux_loss equals the load-balancing loss computed by hand over the concatenated
    router logits of the real tokens only (per expert: fraction of top-2 assignments times mean
    router probability, times num_experts);
  * the LM loss equals the token-weighted mean of the single-prompt losses;
  * greedy generation of 5 tokens gives each prompt the tokens it gets alone.
"""
import torch
import torch.nn.functional
from transformers import MixtralConfig, MixtralForCausalLM

torch.manual_seed(0)

config = MixtralConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    sliding_window=None,
    router_jitter_noise=0.0,
    router_aux_loss_coef=0.02,
    output_router_logits=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
config._attn_implementation = "eager"
model = MixtralForCausalLM(config).eval()

prompts = [
    [1, 11, 23, 5, 40, 17, 9],
    [1, 33, 8, 61],
    [1, 27],
]
B = len(prompts)
T = max(len(p) for p in prompts)
input_ids = torch.full((B, T), config.pad_token_id, dtype=torch.long)
attention_mask = torch.zeros((B, T), dtype=torch.long)
for i, p in enumerate(prompts):
    input_ids[i, T - len(p):] = torch.tensor(p)
    attention_mask[i, T - len(p):] = 1
labels = input_ids.masked_fill(attention_mask == 0, -100)
# the first real token (BOS) is never a target: after the shift it would be predicted from a pad row
for i, p in enumerate(prompts):
    labels[i, T - len(p)] = -100
position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

with torch.no_grad():
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        labels=labels,
        output_router_logits=True,
    )

# ---- reference: every prompt alone, no padding ----
ref_router_rows = []  # per layer, list of (L_i, E)
n_layers = config.num_hidden_layers
per_layer = [[] for _ in range(n_layers)]
lm_loss_sum, lm_tok = 0.0, 0
with torch.no_grad():
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        single = model(input_ids=ids, output_router_logits=True)
        L = len(p)
        torch.testing.assert_close(out.logits[i, T - L:], single.logits[0], atol=1e-5, rtol=1e-5)
        for layer, rl in enumerate(single.router_logits):
            per_layer[layer].append(rl.reshape(L, -1))
        nll = torch.nn.functional.cross_entropy(single.logits[0, :-1], ids[0, 1:], reduction="sum")
        lm_loss_sum += nll.item()
        lm_tok += L - 1

E, K = config.num_local_experts, config.num_experts_per_tok
counts = torch.zeros(E)
probs = torch.zeros(E)
rows = 0
for layer in range(n_layers):
    logits_real = torch.cat(per_layer[layer], dim=0)
    p = torch.softmax(logits_real, dim=-1)
    top = p.topk(K, dim=-1).indices
    for r in range(logits_real.shape[0]):
        for k in range(K):
            counts[top[r, k]] += 1
        probs += p[r]
        rows += 1
ref_aux = (counts / rows * probs / rows).sum() * E
torch.testing.assert_close(out.aux_loss, ref_aux, atol=1e-6, rtol=1e-5)

ref_lm = lm_loss_sum / lm_tok
torch.testing.assert_close(out.loss, torch.tensor(ref_lm) + config.router_aux_loss_coef * ref_aux, atol=1e-5, rtol=1e-5)

# ---- greedy generation, batched and left padded, against each prompt alone ----
with torch.no_grad():
    gen = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=5,
        min_new_tokens=5,
        do_sample=False,
        pad_token_id=config.pad_token_id,
    )
    for i, p in enumerate(prompts):
        alone = model.generate(
            input_ids=torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=5,
            min_new_tokens=5,
            do_sample=False,
            output_router_logits=False,
            pad_token_id=config.pad_token_id,
        )
        assert gen[i, T:].tolist() == alone[0, len(p):].tolist(), (i, gen[i, T:], alone[0, len(p):])

print("ok: logits, aux loss, lm loss and greedy tokens match the per-prompt runs")
