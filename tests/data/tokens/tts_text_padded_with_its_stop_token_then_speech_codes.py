"""A text-to-speech GPT over [text, stop, pad..., start-of-speech, codes]: each row's text padded with the stop token.

The batch's shorter text is padded on the right with the stop-text id (2) itself, and the attention_mask marks those
filler slots 0 while it keeps the real stop token after each text 1: the mask places the padding by position, from
each row's length, not from the ids (a mask built from the ids would hide every stop token). The model is transformers'
GPT-2 built from its config, its pad id another (0). Self-check: the shorter row's logits at its real positions match
the row run alone, unpadded (quiet).
"""
import sys

import torch
from transformers import GPT2Config, GPT2Model

torch.manual_seed(0)
STOP, START = 2, 3
model = GPT2Model(GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2, n_positions=64, pad_token_id=0,
                              bos_token_id=1, eos_token_id=1)).eval()
texts, codes = [[10, 11, 12, 13, 14], [15, 16]], [[30, 31], [32, 33]]
width = max(len(t) for t in texts)
ids, mask, alone = [], [], []
for text, code in zip(texts, codes):
    pad = width - len(text)
    ids.append(text + [STOP] + [STOP] * pad + [START] + code)
    if "--ones-at-ends" in sys.argv:
        mask.append([1] * len(text) + [0] * pad + [1] + [1] * (1 + len(code)))
    else:
        mask.append([1] * (len(text) + 1) + [0] * pad + [1] * (1 + len(code)))
    alone.append(text + [STOP, START] + code)
ids, mask = torch.tensor(ids), torch.tensor(mask)
positions = (mask.cumsum(-1) - 1).clamp(min=0)
with torch.no_grad():
    batch = model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
    own = model(input_ids=torch.tensor([alone[1]])).last_hidden_state[0]
real = mask[1].bool()
gap = float((batch[1][real] - own).abs().max())
assert gap < 1e-5 or "--ones-at-ends" in sys.argv, gap
print("the padded row vs the row run alone:", gap)
