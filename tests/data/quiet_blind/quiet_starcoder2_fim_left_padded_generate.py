# Citation: huggingface/transformers src/transformers/models/starcoder2/modeling_starcoder2.py @v5.24 (generation utils)
# StarCoder2 fill-in-the-middle prompts "<fim_prefix>P<fim_suffix>S<fim_middle>" of different lengths are
# LEFT-padded by the tokenizer; generate() passes attention_mask, position_ids come from cumsum(mask)-1, and the
# model's causal + padding (and sliding-window) mask keeps pad keys out; the cache grows with the mask during decode.
import torch
from transformers import Starcoder2Config, Starcoder2ForCausalLM

torch.manual_seed(0)

PAD, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, EOS = 0, 1, 2, 3, 4
config = Starcoder2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          sliding_window=8, initializer_range=0.5, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)
model = Starcoder2ForCausalLM(config).eval()


def fim_prompt(prefix, suffix):  # PSM format as in the StarCoder paper
    return [FIM_PREFIX] + prefix + [FIM_SUFFIX] + suffix + [FIM_MIDDLE]


prompts = [fim_prompt([10, 11, 12, 13, 14, 15], [20, 21, 22]),
           fim_prompt([30, 31], [40]),
           fim_prompt([50, 51, 52], [60, 61, 62, 63, 64])]
L = max(len(p) for p in prompts)
input_ids = torch.full((3, L), PAD)
attention_mask = torch.zeros(3, L, dtype=torch.long)
for i, p in enumerate(prompts):  # tokenizer padding_side="left"
    input_ids[i, L - len(p):] = torch.tensor(p)
    attention_mask[i, L - len(p):] = 1

with torch.no_grad():
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False,
                         pad_token_id=PAD, eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    middles = out.sequences[:, L:]
    for i, p in enumerate(prompts):
        single = model.generate(input_ids=torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                                eos_token_id=None, return_dict_in_generate=True, output_logits=True)
        assert torch.equal(single.sequences[0, len(p):], middles[i]), (i, single.sequences[0, len(p):], middles[i])
        for a, b in zip(out.logits, single.logits):
            assert torch.allclose(a[i], b[0], atol=1e-4)
print("middles", middles.tolist())
