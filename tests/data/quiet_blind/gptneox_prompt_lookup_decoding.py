# Follows transformers generation/candidate_generator.py `PromptLookupCandidateGenerator` (prompt-lookup test in
# tests/generation/test_utils.py): n-gram drafts are verified in one multi-query cached forward (causal block at
# an offset); rejected rows are discarded and the cache cropped, so output must equal plain greedy decoding.
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

torch.manual_seed(6)
cfg = GPTNeoXConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5,
                    pad_token_id=0, eos_token_id=None, bos_token_id=None)
model = GPTNeoXForCausalLM(cfg).double().eval()
model.generation_config.eos_token_id = None
model.generation_config.pad_token_id = 0

# a repetitive prompt so that n-gram lookup proposes (and sometimes gets accepted) drafts
base = torch.randint(1, 61, (5,))
prompt = torch.cat([base, base, base[:3]]).unsqueeze(0)
worst = 0.0
for impl in ("sdpa", "eager"):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        greedy = model.generate(prompt, max_new_tokens=12, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
        lookup = model.generate(prompt, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3,
                                max_matching_ngram_size=2, output_logits=True, return_dict_in_generate=True)
        full = model(lookup.sequences, use_cache=False).logits[0]
    assert torch.equal(greedy.sequences, lookup.sequences)
    a = torch.stack(greedy.logits, 1)[0]
    b = torch.stack(lookup.logits, 1)[0]
    c = full[prompt.shape[1] - 1: lookup.sequences.shape[1] - 1]
    d = max((a - b).abs().max().item(), (b - c).abs().max().item())
    assert d == d, "NaN"
    worst = max(worst, d)
print(f"max |prompt-lookup - greedy / no-cache forward| = {worst:.3e}")
assert worst < 1e-6  # generate() returns logits as float32
