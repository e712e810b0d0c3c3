"""Batched greedy decoding with left-padded prompts, a KV cache and position ids taken from the mask.

Follows huggingface/transformers:
  generation/utils.py  GenerationMixin: tokenizer padding_side="left"; each step appends a 1 to attention_mask;
      prepare_inputs_for_generation: position_ids = attention_mask.long().cumsum(-1) - 1,
      position_ids.masked_fill_(attention_mask == 0, 1), then only the last column once a cache exists
  models/gpt_neox/modeling_gpt_neox.py  GPTNeoXForCausalLM (partial rotary, rotary_pct), from GPTNeoXConfig
  cache_utils.py  DynamicCache (passed as `cache=`, the name this transformers version uses for past_key_values)
The loop is written out by hand, as serving code and RL rollouts do (cache_position passed explicitly).
Reduced: 2 layers, hidden 32, 4 heads, vocab 50, prompts of 6, 3 and 1 tokens, 5 new tokens, attn "sdpa".
Reference: each prompt decoded alone with no padding and no cache, one full forward per step.
"""
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
from transformers.cache_utils import DynamicCache

torch.manual_seed(0)

PAD, NEW = 0, 5
config = GPTNeoXConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, rotary_pct=0.5, max_position_embeddings=64,
                       pad_token_id=PAD, use_parallel_residual=True)
config._attn_implementation = "sdpa"
model = GPTNeoXForCausalLM(config).eval().double()

prompts = [torch.randint(1, 50, (n,)).tolist() for n in (6, 3, 1)]
width = max(map(len, prompts))
input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

with torch.no_grad():
    cache = DynamicCache(config=config)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                cache=cache, use_cache=True, cache_position=torch.arange(width))
    generated, step_logits = [], []
    for step in range(NEW):
        logits = out.logits[:, -1, :]
        step_logits.append(logits)
        nxt = logits.argmax(-1, keepdim=True)
        generated.append(nxt)
        attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)], dim=1)
        position_ids = (attention_mask.long().cumsum(-1) - 1)[:, -1:]
        out = model(input_ids=nxt, attention_mask=attention_mask, position_ids=position_ids,
                    cache=cache, use_cache=True,
                    cache_position=torch.tensor([width + step]))
    generated = torch.cat(generated, 1)

    max_diff = 0.0
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        for step in range(NEW):
            ref = model(input_ids=ids, use_cache=False).logits[:, -1, :]
            max_diff = max(max_diff, (ref[0] - step_logits[step][i]).abs().max().item())
            ids = torch.cat([ids, ref.argmax(-1, keepdim=True)], 1)
        assert ids[0, len(p):].tolist() == generated[i].tolist()

print("generated", generated.tolist())
print("max |left-padded cached logits - alone uncached|:", max_diff)
assert max_diff < 1e-10
