# huggingface/sentence-transformers#3937, commit adc09fca ("Fix XTR input validation, padding masks, ...")
# xtr_scores derived a padding mask from all-zero rows for documents only. Called without queries_mask on
# zero-padded query token embeddings, the pad rows of shorter queries took part in the global top-k token
# retrieval and counted in the normaliser Z, so a query's XTR score depended on how long its batch-mates were.
import sys

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

_EMPTY_DOCUMENT_SCORE = -1e9


def _zero_row_mask(padded: Tensor) -> Tensor:
    return padded.any(dim=-1).to(padded.dtype)


def _fill_empty_document_scores(scores: Tensor, empty: Tensor) -> Tensor:
    return scores.masked_fill(empty, _EMPTY_DOCUMENT_SCORE)


def xtr_scores(
    queries_embeddings: Tensor,
    documents_embeddings: Tensor,
    queries_mask: Tensor | None = None,
    documents_mask: Tensor | None = None,
    top_k: int = 256,
) -> Tensor:
    if FIXED:
        if isinstance(top_k, bool) or top_k <= 0:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}.")
    Qb, Qt, H = queries_embeddings.shape
    D, N, Dt, _ = documents_embeddings.shape
    Db = D * N
    docs_flat = documents_embeddings.reshape(Db, Dt, H)
    Q_flat = queries_embeddings.reshape(Qb * Qt, H)
    if documents_mask is not None:
        docs_mask_flat = documents_mask.reshape(Db, Dt)
    else:
        # Mirror maxsim: treat all-zero rows as padding, or a pad token's 0.0 wins the per-document
        # max over genuinely negative real similarities.
        docs_mask_flat = _zero_row_mask(docs_flat)
    if FIXED:
        if queries_mask is None:
            queries_mask = _zero_row_mask(queries_embeddings).bool()

    D_flat = docs_flat.reshape(Db * Dt, H).T
    scores = (Q_flat @ D_flat).view(Qb, Qt, Db, Dt)
    scores.masked_fill_(
        ~docs_mask_flat.bool().unsqueeze(0).unsqueeze(0),
        torch.finfo(scores.dtype).min,
    )

    clubbed = scores.flatten(2, 3)
    top_values, indices = clubbed.topk(min(top_k, clubbed.shape[-1]), dim=-1, sorted=False)
    masked = clubbed.fill_(torch.finfo(clubbed.dtype).min).scatter_(-1, indices, top_values)
    doc_ids = torch.where(docs_mask_flat.bool().reshape(-1)[indices], indices // Dt, Db)
    alpha = torch.zeros(Qb, Qt, Db + 1, dtype=torch.bool, device=indices.device).scatter_(-1, doc_ids, True)[..., :Db]
    topk_scores_max = masked.view(Qb, Qt, Db, Dt).max(dim=-1).values.float()
    # XTR imputes a missing similarity as 0, which is what a document with no retrieved token gets.
    topk_scores_max = topk_scores_max.masked_fill(~alpha, 0.0)

    if FIXED:
        topk_scores_max = topk_scores_max * queries_mask.unsqueeze(-1)
        alpha = alpha & queries_mask.bool().unsqueeze(-1)
    else:
        if queries_mask is not None:
            topk_scores_max = topk_scores_max * queries_mask.unsqueeze(-1)
            alpha = alpha & queries_mask.bool().unsqueeze(-1)

    scores_sum = topk_scores_max.sum(dim=1)
    Z = alpha.float().sum(dim=1).clamp_(min=1)
    scores = scores_sum / Z
    return _fill_empty_document_scores(scores, ~docs_mask_flat.bool().any(dim=-1))


class MultiVectorEncoder(torch.nn.Module):
    """Transformer -> Dense projection -> Normalize, returning each text's own token embeddings (ColBERT-style)."""

    def __init__(self, embedding_dim=32):
        super().__init__()
        config = BertConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64,
        )
        self.bert = BertModel(config, add_pooling_layer=False).eval()
        self.dense = torch.nn.Linear(64, embedding_dim, bias=False)

    def tokenize(self, texts):
        rows = [[1] + [5 + (sum(map(ord, w)) % 90) for w in t.lower().split()] + [2] for t in texts]
        max_len = max(len(r) for r in rows)
        input_ids = torch.tensor([r + [0] * (max_len - len(r)) for r in rows])
        attention_mask = torch.tensor([[1] * len(r) + [0] * (max_len - len(r)) for r in rows])
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    @torch.no_grad()
    def encode(self, texts):
        features = self.tokenize(texts)
        token_embeddings = self.bert(**features).last_hidden_state
        token_embeddings = F.normalize(self.dense(token_embeddings), p=2, dim=-1)
        return [emb[mask.bool()] for emb, mask in zip(token_embeddings, features["attention_mask"])]


model = MultiVectorEncoder()
queries = [
    "what is late interaction retrieval",
    "xtr",
    "how are padded query tokens masked in token retrieval scoring",
]
documents = [
    ["late interaction compares every query token with every document token", "a recipe for bread"],
    ["xtr retrieves tokens first and scores documents from them", "the weather is sunny"],
    ["padding rows must be masked out of the scores", "cats sleep most of the day"],
]

q_embs = torch.nn.utils.rnn.pad_sequence(model.encode(queries), batch_first=True, padding_value=0)
d_list = [model.encode(group) for group in documents]
d_max = max(e.shape[0] for group in d_list for e in group)
docs = torch.zeros(len(documents), len(documents[0]), d_max, q_embs.shape[-1])
for i, group in enumerate(d_list):
    for n, e in enumerate(group):
        docs[i, n, : e.shape[0]] = e

scores = xtr_scores(q_embs, docs, top_k=8)
labels = torch.arange(len(queries)) * len(documents[0])
loss = F.cross_entropy(scores * 20.0, labels)
print(f"fixed={FIXED} xtr_ce_loss={loss.item():.6f} score_sum={scores.sum().item():.6f}")
