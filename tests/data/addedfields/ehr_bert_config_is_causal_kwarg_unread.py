# Written another way for causal-config-ignored (the FGA-DIKU/BONSAI#343 bug, in another EHR project's style): a
# next-visit model over a right-padded batch of patients' code sequences, built on transformers' BertModel with
# `BertConfig(..., is_causal=True)`: a field BertConfig defines nowhere, the program's own word that the encoder is
# causal, which BertModel never reads, so each visit sees the later ones. The fix hands the model its own 4-D causal
# and padding mask (True = attend).
import sys

import torch
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    max_position_embeddings=32, pad_token_id=0, attn_implementation="sdpa", is_causal=True)


class NextVisitModel(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.bert = BertModel(config, add_pooling_layer=False)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, codes):
        mask = (codes != 0).long()
        if FIXED:
            length = codes.shape[1]
            causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
            mask = causal[None, None] & mask.bool()[:, None, None, :]
        return self.head(self.bert(input_ids=codes, attention_mask=mask).last_hidden_state)


model = NextVisitModel(config).eval()
codes = torch.tensor([[5, 9, 14, 22, 7, 0, 0], [3, 11, 8, 19, 25, 30, 2]])
with torch.no_grad():
    logits = model(codes)
    changed = codes.clone()
    changed[1, 4:] = torch.tensor([40, 41, 42])
    leak = (model(changed)[1, :4] - logits[1, :4]).abs().max().item()
print(f"fixed={FIXED}: change of the first 4 visits' logits when later visits change = {leak:.3e}")
