# Citation: huggingface/transformers src/transformers/models/codegen/modeling_codegen.py @v5.24 (as used by salesforce/CodeGen sampling)
# Batched code completion: prompts of different lengths are LEFT-padded (tokenizer.padding_side = "left",
# pad = eos), generate() gets the attention_mask, derives position_ids = cumsum(mask) - 1 (pads filled with 1),
# and CodeGen's rotary self-attention combines that padding mask with the causal mask while the KV cache grows.
import torch
from transformers import CodeGenConfig, CodeGenForCausalLM

torch.manual_seed(0)

EOS = 50
config = CodeGenConfig(vocab_size=64, n_positions=64, n_ctx=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                       n_inner=64, bos_token_id=EOS, eos_token_id=EOS, initializer_range=0.5,
                       tie_word_embeddings=False)
model = CodeGenForCausalLM(config).eval()

prompts = [[3, 4, 5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17]]  # e.g. "def f(x):" headers of varying length
L = max(len(p) for p in prompts)
input_ids = torch.full((3, L), EOS)  # tokenizer.pad_token = tokenizer.eos_token
attention_mask = torch.zeros(3, L, dtype=torch.long)
for i, p in enumerate(prompts):
    input_ids[i, L - len(p):] = torch.tensor(p)
    attention_mask[i, L - len(p):] = 1

gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=EOS, eos_token_id=None, return_dict_in_generate=True,
           output_logits=True)
with torch.no_grad():
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **gen)
    for i, p in enumerate(prompts):
        single = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                **gen)
        assert torch.equal(single.sequences[0, len(p):], out.sequences[i, L:]), i
        for a, b in zip(out.logits, single.logits):
            assert torch.allclose(a[i], b[0], atol=1e-4), i
print("completions", out.sequences[:, L:].tolist())
