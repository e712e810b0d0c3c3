# Citation: huggingface/transformers src/transformers/models/modernbert/modeling_modernbert.py
#   (ModernBertModel.forward: global bidirectional mask from attention_mask + sliding-window mask for local layers,
#   global_attn_every_n_layers / local_attention).
# Masking: every 3rd layer is global (bidirectional over real tokens); the others attend only within
#   |i - j| <= local_attention // 2 = 2, intersected with the padding mask of a right-padded batch. Labels -100 on
#   padding and unmasked tokens; eager attention with additive masks.
import torch
from transformers import ModernBertConfig, ModernBertForMaskedLM

torch.manual_seed(0)
config = ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, local_attention=4, global_attn_every_n_layers=3,
                          max_position_embeddings=64, pad_token_id=0, mask_token_id=3, bos_token_id=1,
                          eos_token_id=2, cls_token_id=1, sep_token_id=2)
config._attn_implementation = "eager"
model = ModernBertForMaskedLM(config)

ids = torch.randint(4, 64, (3, 12))
am = torch.ones_like(ids)
am[1, 9:] = 0
am[2, 5:] = 0
ids = ids.masked_fill(am == 0, 0)
sel = (torch.rand(ids.shape) < 0.3) & (am == 1)
sel[:, 1] = True
labels = torch.where(sel, ids, torch.full_like(ids, -100))
inp = ids.masked_fill(sel, 3)
out = model(input_ids=inp, attention_mask=am, labels=labels)
out.loss.backward()
print(f"loss {out.loss.item():.4f}")
