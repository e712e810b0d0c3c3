# A hierarchical document encoder (HIBERT / Hierarchical Attention Network style): each sentence slot is a learned query
# that attention-pools its own sentence's tokens, multi-head, einsum scores filled with -inf outside the sentence. A
# document with fewer sentences than the batch's widest has empty sentence slots whose rows are -inf everywhere: their
# NaN outputs are set to 0 in place with nan_to_num_ and the document mask drops them from the sentence-level encoder.
# Correct: checked against each document alone, one sentence at a time, with no padding at all.
import torch

torch.manual_seed(3)
torch.set_default_dtype(torch.float64)
D, H = 16, 2
Wq, Wk, Wv, Ws = (torch.randn(D, D) / D ** 0.5 for _ in range(4))
slot = torch.randn(D)  # the sentence query (one learned vector, shared by every slot)


def pool_sentences(tokens, sentence_of, n_slots):
    """tokens (B, T, D); sentence_of (B, T): each token's sentence, -1 for padding -> (B, S, D) sentence vectors."""
    B, T, _ = tokens.shape
    inside = sentence_of[:, None, :] == torch.arange(n_slots)[None, :, None]  # (B, S, T): slot s reads its tokens
    q = (slot @ Wq).expand(B, n_slots, D).reshape(B, n_slots, H, D // H).transpose(1, 2)
    k = (tokens @ Wk).reshape(B, T, H, D // H).transpose(1, 2)
    v = (tokens @ Wv).reshape(B, T, H, D // H).transpose(1, 2)
    scores = torch.einsum("bhsd,bhtd->bhst", q, k) / (D // H) ** 0.5
    scores = scores.masked_fill(~inside[:, None], float("-inf"))
    out = torch.einsum("bhst,bhtd->bhsd", scores.softmax(dim=-1), v)
    out.nan_to_num_(0.0)  # empty sentence slots: NaN rows of a softmax over nothing, set to 0, then ignored
    return out.transpose(1, 2).reshape(B, n_slots, D)


def encode(tokens, sentence_of, n_sentences):
    """Sentence vectors, then one layer of attention among each document's real sentences."""
    S = max(n_sentences)
    sent = pool_sentences(tokens, sentence_of, S)
    real = torch.arange(S)[None, :] < torch.tensor(n_sentences)[:, None]  # (B, S)
    s = (sent @ Ws) @ sent.transpose(-1, -2) / D ** 0.5
    s = s.masked_fill(~real[:, None, :], float("-inf"))
    return sent + s.softmax(-1) @ sent, real


docs = [[3, 2, 4], [2, 3]]  # sentence lengths; the second document has two sentences and 4 padding tokens
T = max(sum(d) for d in docs)
sentence_of = torch.full((len(docs), T), -1)
for b, lengths in enumerate(docs):
    sentence_of[b, :sum(lengths)] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
tokens = torch.randn(len(docs), T, D)
tokens[sentence_of < 0] = 50.0  # padding tokens: values no real sentence may read
batched, real = encode(tokens, sentence_of, [len(d) for d in docs])

worst = 0.0
for b, lengths in enumerate(docs):
    pooled, start = [], 0
    for n in lengths:  # one sentence alone: every head over its own tokens, no mask at all
        x = tokens[b, start:start + n]
        heads = []
        for h in range(H):
            part = slice(h * D // H, (h + 1) * D // H)
            w = (((x @ Wk)[:, part] @ (slot @ Wq)[part]) / (D // H) ** 0.5).softmax(-1)
            heads.append(w @ (x @ Wv)[:, part])
        pooled.append(torch.cat(heads))
        start += n
    pooled = torch.stack(pooled)
    ref = pooled + ((pooled @ Ws) @ pooled.T / D ** 0.5).softmax(-1) @ pooled
    worst = max(worst, (batched[b, :len(lengths)] - ref).abs().max().item())
assert not torch.isnan(batched).any()
print(f"max diff padded hierarchical pooling vs each document alone: {worst:.2e}")
assert worst < 1e-12
