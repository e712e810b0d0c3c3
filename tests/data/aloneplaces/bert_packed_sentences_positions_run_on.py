# Written another way: the bug of OpenRLHF b2e226f (packed sequences whose position_ids run on over the whole row) in
# a sentence encoder: short sentences packed into one row for a BERT embedding model, each attending only itself
# through a 4-D block-diagonal additive attention_mask, bidirectional. Bug: position_ids = arange over the packed row;
# the fix restarts them at 0 with each sentence, as the sentence run alone is placed.
import sys

import torch
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv

config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=40, attn_implementation="eager")
torch.manual_seed(0)
encoder = BertModel(config, add_pooling_layer=False).eval()

sentences = [[2, 11, 12, 13, 3], [2, 14, 15, 3], [2, 16, 17, 18, 19, 3]]
ids = torch.tensor([sum(sentences, [])])
which = torch.tensor([[n for n, s in enumerate(sentences) for _ in s]])
same = which[:, :, None] == which[:, None, :]  # (1, L, L): each sentence sees itself only
block = torch.zeros(same.shape).masked_fill(~same, torch.finfo(torch.float32).min)[:, None]
if FIXED:
    position_ids = torch.tensor([[p for s in sentences for p in range(len(s))]])
else:
    position_ids = torch.arange(ids.shape[1])[None]
with torch.no_grad():
    hidden = encoder(input_ids=ids, attention_mask=block, position_ids=position_ids).last_hidden_state
    starts = torch.tensor([0, 5, 9])
    packed = hidden[0, starts]  # each sentence's [CLS]
    alone = torch.cat([encoder(input_ids=torch.tensor([s])).last_hidden_state[:, 0] for s in sentences])
print(f"max |packed [CLS] - each sentence alone|: {(packed - alone).abs().max().item():.3e}")
