# The same bug as rerankers#75 written another way: a sentence embedder's mean pooling of a right-padded batch that
# sums every position's hidden state, padding included, but divides by the number of real tokens
# (`attention_mask.sum(1)`, clamped). The fix multiplies the hidden states by the mask before summing
# (sentence-transformers' Pooling(mode="mean")).
import sys
from types import SimpleNamespace

import torch
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

args = SimpleNamespace(pad_id=0, max_len=12)
encoder = BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, pad_token_id=args.pad_id)).eval()


def collate(sentences):
    width = min(args.max_len, max(len(s) for s in sentences))
    ids = torch.full((len(sentences), width), args.pad_id)
    for row, s in enumerate(sentences):
        ids[row, :len(s)] = torch.tensor(s[:width])
    return ids, (ids != args.pad_id).long()


def mean_pool(hidden, mask):
    if FIXED:
        hidden = hidden * mask.unsqueeze(-1).to(hidden.dtype)
    lengths = torch.clamp(mask.sum(dim=1, keepdim=True), min=1)
    return torch.sum(hidden, dim=1) / lengths


with torch.no_grad():
    ids, mask = collate([[3, 14, 15, 9, 26, 5, 35], [8, 9, 7], [31, 41, 5, 9, 2]])
    batch = mean_pool(encoder(ids, attention_mask=mask).last_hidden_state, mask)
    alone = torch.cat([mean_pool(encoder(i[None, m.bool()]).last_hidden_state, m[None, m.bool()]) for i, m in zip(ids, mask)])
print("max |batched - alone|:", (batch - alone).abs().max().item())
