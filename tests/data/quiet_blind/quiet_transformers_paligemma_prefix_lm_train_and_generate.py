# Citation: huggingface/transformers src/transformers/models/paligemma/modeling_paligemma.py
#   (PaliGemmaModel / create_causal_mask_mapping: token_type_ids==0 marks the prefix [image tokens, bos, prompt, \n],
#   which is attended bidirectionally; suffix tokens (type 1) are causal; attention_mask removes padding).
# Masking: training batch with image span + prompt as a bidirectional prefix and a causal answer suffix, right-padded
#   (labels -100 on prefix and padding); then left-padded generation where the prefix is bidirectional at prefill and
#   each decoded token attends the cache causally. Image tokens see the whole image span and the prompt.
import torch
from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration, SiglipVisionConfig, GemmaConfig

torch.manual_seed(0)
IMG = 99
vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            image_size=16, patch_size=8, projection_dim=32)
text = GemmaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=8, pad_token_id=0, bos_token_id=2, eos_token_id=1)
config = PaliGemmaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMG,
                         projection_dim=32, vocab_size=100)
config.text_config.vocab_size = 100
model = PaliGemmaForConditionalGeneration(config)
n_img = (16 // 8) ** 2

# training: [img x4, bos, prompt..., \n(=3)] [answer..., eos] [pad...]
def sample(prompt, answer, L):
    prefix = [IMG] * n_img + [2] + prompt + [3]
    suffix = answer + [1]
    ids = prefix + suffix
    pad = L - len(ids)
    input_ids = ids + [0] * pad
    tt = [0] * len(prefix) + [1] * len(suffix) + [0] * pad
    am = [1] * len(ids) + [0] * pad
    labels = [-100] * len(prefix) + suffix + [-100] * pad
    return input_ids, tt, am, labels

rows = [sample([10, 11, 12], [20, 21, 22, 23], 16), sample([13], [24, 25], 16)]
input_ids, token_type_ids, attention_mask, labels = (torch.tensor([r[i] for r in rows]) for i in range(4))
pixel_values = torch.randn(2, 3, 16, 16)
out = model(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask,
            token_type_ids=token_type_ids, labels=labels)
out.loss.backward()

# generation: left-padded prompts, prefix only
model.eval()
prompts = [[IMG] * n_img + [2, 10, 11, 12, 3], [0, 0] + [IMG] * n_img + [2, 13, 3]]
gen_ids = torch.tensor(prompts)
gen_mask = (gen_ids != 0).long()
with torch.no_grad():
    gen = model.generate(input_ids=gen_ids, attention_mask=gen_mask, pixel_values=pixel_values,
                         token_type_ids=torch.zeros_like(gen_ids), max_new_tokens=5, do_sample=False)
print(f"loss {out.loss.item():.4f} gen {gen[:, gen_ids.shape[1]:].tolist()}")
