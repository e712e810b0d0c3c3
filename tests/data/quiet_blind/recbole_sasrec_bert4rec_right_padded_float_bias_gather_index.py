# Follows RecBole recbole/model/abstract_recommender.py SequentialRecommender.get_attention_mask (+ gather_indexes) as used by
# sasrec.py (bidirectional=False) and bert4rec.py (bidirectional=True, [MASK] appended at item_seq_len, reconstruct_test_data).
# Sequences are RIGHT-padded with item 0; the bool mask is tril'ed and turned into a 0 / -10000 float bias added to scores.
import math
import torch

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
n_items, L, D, H = 40, 8, 32, 2


def get_attention_mask(item_seq, bidirectional=False):
    attention_mask = item_seq != 0
    extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)  # [B, 1, 1, L], True = real item
    if not bidirectional:
        extended_attention_mask = torch.tril(extended_attention_mask.expand((-1, -1, item_seq.size(-1), -1)))
    extended_attention_mask = torch.where(extended_attention_mask, 0.0, -10000.0)
    return extended_attention_mask


def gather_indexes(output, gather_index):
    gather_index = gather_index.view(-1, 1, 1).expand(-1, -1, output.shape[-1])
    return output.gather(dim=1, index=gather_index).squeeze(1)


class Encoder(torch.nn.Module):
    def __init__(self, n_layers=2):
        super().__init__()
        self.item_embedding = torch.nn.Embedding(n_items + 1, D, padding_idx=0)  # last id = [MASK] for BERT4Rec
        self.position_embedding = torch.nn.Embedding(L, D)
        self.qkv = torch.nn.ModuleList([torch.nn.Linear(D, 3 * D) for _ in range(n_layers)])
        self.out = torch.nn.ModuleList([torch.nn.Linear(D, D) for _ in range(n_layers)])
        self.ln = torch.nn.LayerNorm(D)

    def forward(self, item_seq, extended_attention_mask):
        pos = torch.arange(item_seq.size(1)).unsqueeze(0).expand_as(item_seq)
        h = self.ln(self.item_embedding(item_seq) + self.position_embedding(pos))
        B, T, _ = h.shape
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(h).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-1, -2) / math.sqrt(D // H)
            scores = scores + extended_attention_mask
            h = h + out((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, D))
        return h


model = Encoder().eval()
seqs = [[3, 7, 1, 9, 12, 5], [8, 2], [4, 4, 30, 6]]
item_seq_len = torch.tensor([len(s) for s in seqs])
item_seq = torch.zeros(len(seqs), L, dtype=torch.long)
for i, s in enumerate(seqs):
    item_seq[i, : len(s)] = torch.tensor(s)

worst = 0.0
with torch.no_grad():
    # SASRec: causal + key padding, read the hidden state of the last real item (item_seq_len - 1)
    out = model(item_seq, get_attention_mask(item_seq, bidirectional=False))
    seq_output = gather_indexes(out, item_seq_len - 1)
    for i, s in enumerate(seqs):
        alone = torch.tensor([s])
        causal = torch.triu(torch.full((len(s), len(s)), -math.inf), 1)  # no padding at all, -inf causal mask
        ref = model(alone, causal)[0, -1]
        worst = max(worst, (seq_output[i] - ref).abs().max().item())
    print(f"SASRec causal, right-padded gather at len-1: max diff = {worst:.3e}")

    # BERT4Rec test: append [MASK] at position item_seq_len (still inside the padded row), full bidirectional key mask
    mask_token = n_items
    test_seq = item_seq.clone()
    test_seq[torch.arange(len(seqs)), item_seq_len] = mask_token
    out = model(test_seq, get_attention_mask(test_seq, bidirectional=True))
    seq_output = gather_indexes(out, item_seq_len)
    d2 = 0.0
    for i, s in enumerate(seqs):
        alone = torch.tensor([s + [mask_token]])
        ref = model(alone, torch.zeros(1, 1, 1, len(s) + 1))[0, -1]
        d2 = max(d2, (seq_output[i] - ref).abs().max().item())
    print(f"BERT4Rec bidirectional, [MASK] at item_seq_len: max diff = {d2:.3e}")
    worst = max(worst, d2)
assert worst < 1e-12, worst
print(f"max difference: {worst:.3e}")
