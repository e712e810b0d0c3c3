"""ColBERT: queries are padded with [MASK] tokens that ARE attended; documents are padded with [PAD] that is not.

Follows stanford-futuredata/ColBERT colbert/modeling/tokenization/query_tokenization.py (QueryTokenizer.tensorize:
pad to query_maxlen, then ids[ids == pad_token_id] = mask_token_id, and with attend_to_mask_tokens
mask[ids == mask_token_id] = 1), doc_tokenization.py (DocTokenizer.tensorize: ordinary padding, attention_mask 0
on [PAD]) and colbert/modeling/colbert.py (ColBERT.query / ColBERT.doc: mask = [PAD] and skiplist (punctuation)
removed from the document embeddings; colbert_score: MaxSim, max over the document's kept tokens, summed over
every query token, the [MASK] ones included).

The query's [MASK] augmentation is the model's design ("query augmentation"): those slots are real inputs, attended
as keys and scored as queries.  The document's pad rows come out of the encoder as garbage and are dropped by the
doc mask before MaxSim.  Reference: each document alone, unpadded, and each query encoded alone (still augmented
to query_maxlen, as ColBERT always does), scores by explicit loops.  Max diff must be ~0.  A variant that masks
the [MASK] tokens out must give different scores, so the augmentation really counts.
"""
import math
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
torch.set_grad_enabled(False)
V, E, H, L, DIM = 40, 32, 4, 2, 8
PAD, CLS, SEP, MASK, Q_MARK, D_MARK, PUNCT = 0, 1, 2, 3, 4, 5, 6
QUERY_MAXLEN = 8
emb, pos = torch.nn.Embedding(V, E), torch.nn.Embedding(32, E)
layers = [[torch.randn(E, E) / math.sqrt(E) for _ in range(4)] for _ in range(L)]
linear = torch.randn(E, DIM) / math.sqrt(E)
skiplist = {PUNCT}


def bert(ids, mask):
    B, T = ids.shape
    x = emb(ids) + pos(torch.arange(T))[None]
    key_ok = mask.bool()[:, None, None, :]
    for wq, wk, wv, wo in layers:
        q, k, v = ((x @ w).view(B, T, H, E // H).transpose(1, 2) for w in (wq, wk, wv))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=key_ok)
        x = torch.tanh(x + a.transpose(1, 2).reshape(B, T, E) @ wo)
    return x


def tensorize_queries(queries, attend_to_mask_tokens=True):
    ids = torch.full((len(queries), QUERY_MAXLEN), PAD)
    mask = torch.zeros(len(queries), QUERY_MAXLEN, dtype=torch.long)
    for i, q in enumerate(queries):
        t = [CLS, Q_MARK] + q + [SEP]
        ids[i, :len(t)], mask[i, :len(t)] = torch.tensor(t), 1
    ids[ids == PAD] = MASK
    if attend_to_mask_tokens:
        mask[ids == MASK] = 1
    return ids, mask


def tensorize_docs(docs):
    T = max(len(d) for d in docs) + 3
    ids = torch.full((len(docs), T), PAD)
    mask = torch.zeros(len(docs), T, dtype=torch.long)
    for i, d in enumerate(docs):
        t = [CLS, D_MARK] + d + [SEP]
        ids[i, :len(t)], mask[i, :len(t)] = torch.tensor(t), 1
    return ids, mask


def query(ids, mask):
    return F.normalize(bert(ids, mask) @ linear, dim=2)


def doc(ids, mask):
    D = F.normalize(bert(ids, mask) @ linear, dim=2)
    keep = mask.bool() & ~torch.isin(ids, torch.tensor(sorted(skiplist)))  # ColBERT.mask: pad + punctuation
    return D, keep


def colbert_score(Q, D, keep):  # every query against every doc
    sim = torch.einsum("qid,bjd->qbij", Q, D).masked_fill(~keep[None, :, None, :], -9999)
    return sim.max(-1).values.sum(-1)


queries = [[10, 11, 12], [13, 14], [15, 16, 17, 18]]
docs = [[20, 21, PUNCT, 22, 23, 24, 25], [26, 27], [28, PUNCT, 29, 30, 31]]
Q = query(*tensorize_queries(queries))
D, keep = doc(*tensorize_docs(docs))
scores = colbert_score(Q, D, keep)

ref = torch.zeros(len(queries), len(docs))
for qi, q in enumerate(queries):
    Qs = query(*tensorize_queries([q]))[0]  # alone, but still augmented to QUERY_MAXLEN with [MASK]
    for di, d in enumerate(docs):
        ids = torch.tensor([[CLS, D_MARK] + d + [SEP]])
        Ds = F.normalize(bert(ids, torch.ones_like(ids)) @ linear, dim=2)[0]
        kept = [j for j in range(ids.shape[1]) if int(ids[0, j]) not in skiplist]
        ref[qi, di] = sum(max(float(Qs[i] @ Ds[j]) for j in kept) for i in range(QUERY_MAXLEN))
max_diff = (scores - ref).abs().max().item()
Q_no_aug = query(*tensorize_queries(queries, attend_to_mask_tokens=False))
aug_effect = (colbert_score(Q_no_aug, D, keep) - scores).abs().max().item()

print("scores:\n", scores)
print("max |batched - per-pair loop|:", max_diff, " effect of attending [MASK] (> 0):", aug_effect)
assert max_diff < 1e-12 and aug_effect > 1e-6
