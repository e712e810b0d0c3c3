"""UniLM seq2seq fine-tuning mask: source bidirectional, target causal, padding rows still see the source.

Follows microsoft/unilm unilm-v1/src/biunilm/seq2seq_loader.py (Preprocess4Seq2seq.__call__):

    input_mask = torch.zeros(self.max_len, self.max_len, dtype=torch.long)
    input_mask[:, :len(tokens_a)+2].fill_(1)
    second_st, second_end = len(tokens_a)+2, len(tokens_a)+len(tokens_b)+3
    input_mask[second_st:second_end, second_st:second_end].copy_(self._tril_matrix[:second_end-second_st, ...])

and pytorch_pretrained_bert/modeling.py (BertModel.get_extended_attention_mask for a 3-D mask:
(1 - mask) * -10000).  Every row, the padding rows included, sees [CLS] source [SEP]; target rows see the
target causally.  So a source token never sees the target (it is an encoder), while padding query rows get
garbage outputs that are never used (masked_lm_positions only point at target tokens).

Reference: each example alone, unpadded, with a mask built pair by pair from segment ids
(key in segment A, or query in segment B and key <= query).  Checks also that the source outputs do not
change when the target changes.  Max diffs must be ~0.
"""
import math
import torch

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
V, E, H, L, MAX_LEN = 30, 24, 4, 2, 14
D = E // H
CLS, SEP, PAD = 1, 2, 0
emb, pos_emb, seg_emb = torch.nn.Embedding(V, E), torch.nn.Embedding(MAX_LEN, E), torch.nn.Embedding(2, E)
layers = [[torch.randn(E, E) / math.sqrt(E) for _ in range(4)] for _ in range(L)]
_tril_matrix = torch.tril(torch.ones(MAX_LEN, MAX_LEN, dtype=torch.long))


def preprocess(tokens_a, tokens_b):
    tokens = [CLS] + tokens_a + [SEP] + tokens_b + [SEP]
    segment_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
    n_pad = MAX_LEN - len(tokens)
    input_ids, segment_ids = tokens + [PAD] * n_pad, segment_ids + [0] * n_pad
    input_mask = torch.zeros(MAX_LEN, MAX_LEN, dtype=torch.long)
    input_mask[:, :len(tokens_a) + 2].fill_(1)
    second_st, second_end = len(tokens_a) + 2, len(tokens_a) + len(tokens_b) + 3
    input_mask[second_st:second_end, second_st:second_end].copy_(
        _tril_matrix[:second_end - second_st, :second_end - second_st])
    return torch.tensor(input_ids), torch.tensor(segment_ids), input_mask


def bert(ids, seg, mask3d):
    Bn, T = ids.shape
    x = emb(ids) + pos_emb(torch.arange(T))[None] + seg_emb(seg)
    ext = (1.0 - mask3d[:, None].to(x.dtype)) * -10000.0  # get_extended_attention_mask, 3-D case
    for wq, wk, wv, wo in layers:
        q, k, v = ((x @ w).view(Bn, T, H, D).transpose(1, 2) for w in (wq, wk, wv))
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + ext, -1)
        x = torch.tanh(x + (p @ v).transpose(1, 2).reshape(Bn, T, E) @ wo)
    return x


pairs = [([5, 6, 7, 8], [9, 10, 11]), ([12, 13], [14, 15, 16, 17, 18, 19]), ([20, 21, 22, 23, 24, 25], [26])]
batch = [preprocess(a, b) for a, b in pairs]
ids, seg, mask = (torch.stack(t) for t in zip(*batch))
out = bert(ids, seg, mask)

max_diff, src_diff = 0.0, 0.0
for b, (a, t) in enumerate(pairs):
    n = len(a) + len(t) + 3
    s = seg[b, :n]
    ref_mask = torch.zeros(1, n, n, dtype=torch.long)
    for i in range(n):
        for j in range(n):
            ref_mask[0, i, j] = int(s[j] == 0 or (s[i] == 1 and j <= i))
    ref = bert(ids[b:b + 1, :n], seg[b:b + 1, :n], ref_mask)
    max_diff = max(max_diff, (out[b, :n] - ref[0]).abs().max().item())
    # the source part is an encoder: changing the target must not move it
    ids2 = ids[b:b + 1, :n].clone()
    ids2[0, len(a) + 2:n - 1] = torch.randint(3, V, (len(t),))
    other = bert(ids2, seg[b:b + 1, :n], ref_mask)
    src_diff = max(src_diff, (other[0, :len(a) + 2] - ref[0, :len(a) + 2]).abs().max().item())

print("padding rows finite (they see the source):", bool(torch.isfinite(out).all()))
print("max |batched padded - single unpadded|:", max_diff, " source moved by target:", src_diff)
assert max_diff < 1e-12 and src_diff < 1e-12
