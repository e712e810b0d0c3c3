# Written another way than DeepSpeedExamples#457: a batch of prompts padded on the right by a hand-written collator
# (the training-time default), then handed as they are to GPT-2's generate() with their attention_mask (SDPA). Each
# short prompt ends in pads marked 0, so its first new token is predicted from a pad position.
# Fixed: the same prompts padded on the left before generate().
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(3)

PAD = 0


def collate(prompts, side):
    width = max(map(len, prompts))
    ids, mask = [], []
    for p in prompts:
        pads = width - len(p)
        ids.append([PAD] * pads + p if side == "left" else p + [PAD] * pads)
        mask.append([0] * pads + [1] * len(p) if side == "left" else [1] * len(p) + [0] * pads)
    return torch.tensor(ids), torch.tensor(mask)


config = GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=4, pad_token_id=PAD, bos_token_id=1,
                    eos_token_id=1)
config._attn_implementation = "sdpa"
model = GPT2LMHeadModel(config).eval()

prompts = [[1, 10, 11, 12, 13], [1, 14, 15], [1, 16, 17, 18]]
input_ids, attention_mask = collate(prompts, "left" if FIXED else "right")
with torch.no_grad():
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False,
                         pad_token_id=PAD)
print(out[:, input_ids.shape[1]:].tolist())
