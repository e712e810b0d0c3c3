"""A decoder used as a text embedder (GPT-2, right-padded batch): the output is first multiplied by its padding mask,
`attention_mask[..., None] * hidden`, then each row is read at one position, `[arange(B), index]`. The index is
`attention_mask.argmin(1) - 1`: the position before the first pad, which for an unpadded row is -1 and, clamped,
0 (its first token). `--fixed` reads at `attention_mask.sum(1) - 1`, each row's last real token; checked against
each text run alone."""
import sys

import torch
from transformers import GPT2Config, GPT2Model

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

config = GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=16, bos_token_id=1,
                    eos_token_id=2, attn_implementation="eager")
model = GPT2Model(config).eval()
texts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18, 19]]
width = max(map(len, texts))
input_ids = torch.tensor([t + [0] * (width - len(t)) for t in texts])
attention_mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in texts])

with torch.no_grad():
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    masked = attention_mask[..., None] * hidden
    index = attention_mask.sum(1) - 1 if FIXED else torch.clamp(attention_mask.argmin(1) - 1, min=0)
    embeddings = masked[torch.arange(len(texts)), index]
    alone = torch.stack([model(input_ids=torch.tensor([t])).last_hidden_state[0, -1] for t in texts])
worst = float((embeddings - alone).abs().max())
print(f"largest difference from each text alone: {worst:.2e}")
assert (worst < 1e-5) == FIXED
