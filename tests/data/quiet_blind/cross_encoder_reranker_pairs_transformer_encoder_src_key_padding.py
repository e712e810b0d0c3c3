"""Cross-encoder reranking: (query, passage) pairs packed as [CLS] q [SEP] p [SEP], padded, scored from [CLS].

Follows sentence-transformers, sentence_transformers/cross_encoder/CrossEncoder.py (CrossEncoder.predict /
rank: the tokenizer encodes each pair with padding=True, truncation, token_type_ids 0 for the query part and 1 for
the passage part, the model's logits at [CLS] are the scores, passages sorted by score). Commit: not pinned.
Plain torch stand-in for the BERT: nn.TransformerEncoder with src_key_padding_mask (True = pad).
Reference: each pair scored alone without padding.
"""
import torch
import torch.nn as nn

torch.manual_seed(0)
D, V = 32, 60
CLS, SEP, PAD = 1, 2, 0


class CrossEncoderLite(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.seg = nn.Embedding(V, D), nn.Embedding(40, D), nn.Embedding(2, D)
        layer = nn.TransformerEncoderLayer(D, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.classifier = nn.Linear(D, 1)

    def forward(self, input_ids, token_type_ids, attention_mask):
        T = input_ids.shape[1]
        x = self.tok(input_ids) + self.pos(torch.arange(T)) + self.seg(token_type_ids)
        h = self.encoder(x, src_key_padding_mask=attention_mask == 0)
        return self.classifier(h[:, 0]).squeeze(-1)


def encode_pairs(pairs):
    rows = []
    for q, p in pairs:
        ids = [CLS] + q + [SEP] + p + [SEP]
        tt = [0] * (len(q) + 2) + [1] * (len(p) + 1)
        rows.append((ids, tt))
    L = max(len(r[0]) for r in rows)
    ids = torch.tensor([r[0] + [PAD] * (L - len(r[0])) for r in rows])
    tt = torch.tensor([r[1] + [0] * (L - len(r[1])) for r in rows])
    am = torch.tensor([[1] * len(r[0]) + [0] * (L - len(r[0])) for r in rows])
    return ids, tt, am


model = CrossEncoderLite().eval().double()
query = [10, 11, 12]
passages = [[20, 21, 22, 23, 24, 25, 26], [30, 31], [40, 41, 42, 43], [50]]

with torch.no_grad():
    scores = model(*encode_pairs([(query, p) for p in passages]))
    ref = torch.stack([model(*encode_pairs([(query, p)]))[0] for p in passages])
ranking = scores.argsort(descending=True).tolist()
diff = (scores - ref).abs().max().item()
print("scores:", [round(s, 6) for s in scores.tolist()], "ranking:", ranking)
print("max |padded batch scores - one pair alone| =", diff)
assert diff < 1e-10, diff
assert ranking == ref.argsort(descending=True).tolist()
