# Correct program (quiet batch quiet-r80b).
#
# Ported from huggingface/transformers @63210d0e3b74c2119b7998ff65bc6a2729283626 (the port of microsoft/BioGPT):
#   src/transformers/models/biogpt/modeling_biogpt.py  BioGptForCausalLM / BioGptModel.forward (create_causal_mask
#       from the 2-D attention_mask and the cache, BioGptLearnedPositionalEmbedding: position_ids + offset 2)
#   src/transformers/models/biogpt/tokenization_biogpt.py  build_inputs_with_special_tokens ([</s>] + tokens)
#   src/transformers/generation/utils.py  _prepare_position_ids_for_generation (attention_mask.cumsum(-1) - 1,
#       masked_fill(attention_mask == 0, 0)) and _update_model_kwargs_for_generation (position_ids[..., -1:] + 1,
#       attention_mask concatenated with ones), written out as a hand loop over the DynamicCache
# Trimmed: a tiny BioGptConfig with random weights; token ids written by hand.
#
# Prompts of different lengths left-padded (padding_side="left", pad=1); the prompt goes through once with its
# attention_mask and cumsum position_ids, then one token per step with the grown mask, the next position and the
# cache. model.generate runs the same batch as a second path.
#
# Self-check: each prompt decoded alone (no padding, positions 0..n-1) gives the same greedy tokens and the same
# next-token log-probs at every step as its row of the padded batch (hand loop and model.generate); the prefill
# logits at each row's real positions equal the prompt run alone without a cache.
import sys

import torch
import torch.nn.functional as F
from transformers import BioGptConfig, BioGptForCausalLM

torch.manual_seed(0)
PAD, BOS, EOS = 1, 0, 2
STEPS = 7

config = BioGptConfig(
    vocab_size=73,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    activation_dropout=0.0,
    initializer_range=0.3,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
)
model = BioGptForCausalLM(config).eval()


def build_inputs_with_special_tokens(token_ids_0):
    # BioGptTokenizer: </s> in front, nothing at the end
    return [EOS] + token_ids_0


def left_pad(seqs):
    max_len = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), max_len), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), max_len), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, max_len - len(s):] = torch.tensor(s)
        attention_mask[i, max_len - len(s):] = 1
    return input_ids, attention_mask


def greedy(input_ids, attention_mask, steps):
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
    cache = out.cache
    prefill_logits = out.logits
    tokens, step_logps = [], []
    next_logits = out.logits[:, -1, :]
    for _ in range(steps):
        step_logps.append(F.log_softmax(next_logits, -1))
        next_tokens = next_logits.argmax(-1)
        tokens.append(next_tokens)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        position_ids = position_ids[:, -1:] + 1
        out = model(input_ids=next_tokens[:, None], attention_mask=attention_mask, position_ids=position_ids,
                    cache=cache, use_cache=True)
        cache = out.cache
        next_logits = out.logits[:, -1, :]
    return torch.stack(tokens, 1), torch.stack(step_logps, 1), prefill_logits


g = torch.Generator().manual_seed(3)
prompts = [build_inputs_with_special_tokens(torch.randint(3, 73, (n,), generator=g).tolist()) for n in (2, 8, 5, 1)]
input_ids, attention_mask = left_pad(prompts)
L = input_ids.shape[1]

failures = 0
with torch.no_grad():
    b_tokens, b_logps, b_prefill = greedy(input_ids, attention_mask, STEPS)
    gen = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=STEPS, do_sample=False,
                         eos_token_id=None, pad_token_id=PAD)[:, L:]
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        a_tokens, a_logps, _ = greedy(ids, torch.ones_like(ids), STEPS)
        full_alone = model(input_ids=ids, use_cache=False).logits[0]
        if not torch.equal(a_tokens[0], b_tokens[i]):
            failures += 1
            print(f"prompt {i}: batch {b_tokens[i].tolist()} alone {a_tokens[0].tolist()}")
        if not torch.equal(a_tokens[0], gen[i]):
            failures += 1
            print(f"prompt {i}: generate {gen[i].tolist()} alone {a_tokens[0].tolist()}")
        if not torch.allclose(a_logps[0], b_logps[i], atol=1e-5):
            failures += 1
            print(f"prompt {i}: step log-probs differ by {(a_logps[0] - b_logps[i]).abs().max().item():.3g}")
        n = len(p)
        if not torch.allclose(b_prefill[i, L - n:], full_alone, atol=1e-5):
            failures += 1
            print(f"prompt {i}: prefill logits differ by {(b_prefill[i, L - n:] - full_alone).abs().max().item():.3g}")

if failures:
    print(f"FAILED: {failures} mismatches")
    sys.exit(1)
print("ok: left-padded BioGPT batch with a KV cache matches each prompt decoded alone")
