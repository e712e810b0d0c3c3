# FlagEmbedding BGE-M3 (FlagEmbedding/inference/embedder/encoder_only/m3.py, _colbert_embedding / colbert_score):
# colbert vectors are last_hidden_state[:, 1:] * attention_mask[:, 1:][:, :, None] (CLS dropped, padding zeroed);
# _process_colbert_vecs then trims each row to attention_mask.sum()-1 vectors, so padded doc vectors never enter
# the max; score = sum over real query tokens of max over doc tokens / number of real query tokens.
import warnings
warnings.filterwarnings('ignore')
import torch
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, V = 32, 50
enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(D, 4, 64, dropout=0.0, batch_first=True), 2).eval()
emb = torch.nn.Embedding(V, D)
colbert_linear = torch.nn.Linear(D, D)

def pad(seqs):
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    am = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s); am[i, :len(s)] = 1
    return ids, am

def encode(ids, am):
    return enc(emb(ids), src_key_padding_mask=(am == 0))  # True = ignore for nn.Transformer

def _colbert_embedding(last_hidden_state, mask):
    colbert_vecs = colbert_linear(last_hidden_state[:, 1:])
    colbert_vecs = colbert_vecs * mask[:, 1:][:, :, None].float()
    return torch.nn.functional.normalize(colbert_vecs, dim=-1)

def _process_colbert_vecs(colbert_vecs, attention_mask):
    tokens_num = int(attention_mask.sum())
    return colbert_vecs[:tokens_num - 1]

def colbert_score(q_reps, p_reps, q_mask):
    token_scores = torch.einsum('in,jn->ij', q_reps, p_reps)
    scores, _ = token_scores.max(-1)
    return scores.sum() / q_mask[1:].sum()

with torch.no_grad():
    queries = [[1, 5, 7, 9], [1, 3, 4, 8, 11, 12, 2]]
    docs = [[1, 20, 21, 22, 23, 24, 25, 26, 2], [1, 30, 31, 2]]
    qi, qm = pad(queries); di, dm = pad(docs)
    qv = _colbert_embedding(encode(qi, qm), qm); dv = _colbert_embedding(encode(di, dm), dm)
    batched = torch.stack([torch.stack([colbert_score(_process_colbert_vecs(qv[a], qm[a]), _process_colbert_vecs(dv[b], dm[b]), qm[a]) for b in range(2)]) for a in range(2)])
    ref = torch.zeros(2, 2)
    for a, q in enumerate(queries):
        for b, d in enumerate(docs):
            qa = torch.tensor([q]); da = torch.tensor([d])
            qh = colbert_linear(enc(emb(qa))[:, 1:])[0]; dh = colbert_linear(enc(emb(da))[:, 1:])[0]
            qh = torch.nn.functional.normalize(qh, dim=-1); dh = torch.nn.functional.normalize(dh, dim=-1)
            ref[a, b] = (qh @ dh.T).max(-1).values.mean()  # explicit per-query-token loop equivalent
    diff = (batched - ref).abs().max().item()
    print("max diff padded late-interaction vs each pair alone:", diff)
    assert diff < 1e-10
