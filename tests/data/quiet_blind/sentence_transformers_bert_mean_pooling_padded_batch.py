"""sentence-transformers: a padded batch of sentences through a BERT encoder, mean pooling over real tokens.

Follows sentence-transformers, sentence_transformers/models/Transformer.py (Transformer.forward passes
input_ids / attention_mask / token_type_ids to the HF model) and sentence_transformers/models/Pooling.py
(Pooling.forward, pooling_mode_mean_tokens: token_embeddings * attention_mask.unsqueeze(-1), summed and divided
by attention_mask.sum(1).clamp(min=1e-9)), then models/Normalize.py. Commit: not pinned.
The model is transformers' BertModel built from a tiny BertConfig (no download).
"""
import torch
from transformers import BertConfig, BertModel

torch.manual_seed(0)
PAD = 0

config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=32, pad_token_id=PAD,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model = BertModel(config).eval().double()

# "tokenized" sentences: [CLS]=1 ... [SEP]=2, different lengths
sentences = [
    [1, 10, 11, 12, 13, 14, 2],
    [1, 20, 21, 2],
    [1, 30, 31, 32, 33, 34, 35, 36, 37, 2],
]


def tokenize(batch):
    """Like the HF tokenizer with padding=True: right padding, attention_mask 1 for real tokens."""
    longest = max(len(s) for s in batch)
    ids = torch.full((len(batch), longest), PAD, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def mean_pooling(token_embeddings, attention_mask):
    """Pooling.forward, pooling_mode_mean_tokens."""
    input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).to(token_embeddings.dtype)
    sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)
    sum_mask = input_mask_expanded.sum(1).clamp(min=1e-9)
    return sum_embeddings / sum_mask


def encode(batch):
    features = tokenize(batch)
    with torch.no_grad():
        out = model(**features)
    emb = mean_pooling(out.last_hidden_state, features["attention_mask"])
    return torch.nn.functional.normalize(emb, p=2, dim=1)


batched = encode(sentences)

# reference: each sentence on its own, no padding at all
single = torch.cat([encode([s]) for s in sentences], dim=0)
diff = (batched - single).abs().max().item()
print("max |batched - one at a time| =", diff)
assert diff < 1e-10, diff

# cosine similarity matrix, as util.cos_sim
sim = batched @ batched.T
print("cos_sim diag:", sim.diag().tolist())
assert torch.allclose(sim.diag(), torch.ones(3, dtype=sim.dtype))
