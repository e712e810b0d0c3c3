"""txtai LateEncoder: late-interaction (ColBERT MaxSim) reranking over zero-padded multi-vector batches.

Citation: neuml/txtai#1215 ("Ignore padding rows in LateEncoder scores", merged); code before the fix
read at neuml/txtai 20f818f7 (src/python/txtai/pipeline/text/lateencoder.py, LateEncoder.__call__ /
encode / score; src/python/txtai/models/pooling/late.py, LatePooling.forward / preencode /
postencode; src/python/txtai/models/pooling/base.py, Pooling.encode). The #1215 diff itself was not
read: the fixed lines follow its description ("This masks padded query and document rows before
averaging"), with the padding rows found the way txtai's own centerdata finds them
(`np.any(value != 0, axis=1)`).

The bug: LatePooling.postencode cuts every token matrix to its true length, L2-normalises it and
pads the batch back to the longest one with zero rows. LateEncoder.score then ran
`einsum("ash,bth->abst").max(-1).mean(-1)` over the padded arrays: a zero document row scores 0
against every query token, so it wins the per-token maximum wherever all true document tokens are
less similar than 0, and the zero query rows of a shorter query are counted in the mean.

The fix: padded document rows are kept out of the maximum and padded query rows out of the average.

Here two queries of different lengths are encoded in one batch, so the shorter one carries zero
rows and its MaxSim scores against the six documents come out scaled down.

Shrunk: a BERT built from a tiny BertConfig with random weights and a hand-made word-level
tokenizer (right padding, as the BERT tokenizer pads) stand in for colbert-ir/colbertv2.0; the
Stanford-format linear projection is one bias-free nn.Linear(hidden, 16); token centering is
switched on as `vectors={"center": True}` does (batch scope, LatePooling.centerdata ported).
"""

import sys

import numpy as np
import torch
from torch import nn
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


# ---- a word-level stand-in for the BERT tokenizer --------------------------------------------------
class WordTokenizer:
    def __init__(self, words):
        self.vocab = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[Q]": 3, "[D]": 4}
        for w in words:
            self.vocab.setdefault(w, len(self.vocab))
        self.pad_token_id = 0

    def __call__(self, texts, padding=True, truncation="longest_first", return_tensors="pt", max_length=None):
        ids = []
        for text in texts:
            row = [1] + [self.vocab[w] for w in text.split()] + [2]
            if max_length:
                row = row[:max_length]
            ids.append(row)
        longest = max(len(r) for r in ids)
        input_ids = torch.tensor([r + [self.pad_token_id] * (longest - len(r)) for r in ids])
        attention_mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in ids])
        return Inputs(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=torch.zeros_like(input_ids))


class Inputs(dict):
    def to(self, device):
        return Inputs({k: v.to(device) for k, v in self.items()})


# ---- txtai/models/pooling/base.py ------------------------------------------------------------------
class Pooling(nn.Module):
    def __init__(self, model, tokenizer, device, maxlength=None):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.maxlength = maxlength

    def encode(self, documents, batch=32, category=None):
        results = []

        documents = self.preencode(documents, category)

        # Sort document indices from largest to smallest to enable efficient batching
        lengths = np.argsort([-len(x) if x else 0 for x in documents])
        documents = [documents[x] for x in lengths]

        for chunk in self.chunk(documents, batch):
            inputs = self.tokenizer(chunk, padding=True, truncation="longest_first", return_tensors="pt", max_length=self.maxlength)
            inputs = inputs.to(self.device)

            with torch.no_grad():
                outputs = self.forward(**inputs)

            results.extend(outputs.cpu().to(torch.float32).numpy())

        results = self.postencode(results, category)

        return np.asarray([results[x] for x in np.argsort(lengths)])

    def chunk(self, texts, size):
        return [texts[x : x + size] for x in range(0, len(texts), size)]

    def forward(self, **inputs):
        return self.model(**inputs)[0]


# ---- txtai/models/pooling/late.py ------------------------------------------------------------------
class LatePooling(Pooling):
    def __init__(self, model, tokenizer, device, linear, center, qprefix="[Q] ", qlength=32, dprefix="[D] ", dlength=180):
        super().__init__(model, tokenizer, device)
        self.encoder = None
        self.lengths = None
        self.qprefix, self.qlength, self.dprefix, self.dlength = qprefix, qlength, dprefix, dlength
        self.linear = linear
        self.center = {"scope": "batch"} if center is True else center
        self.batches = None

    def forward(self, **inputs):
        # Track true token counts
        self.lengths.extend(inputs["attention_mask"].sum(dim=1).cpu().tolist())

        # Track model batch boundaries for batch-scoped centering
        if self.center and self.center["scope"] == "batch":
            self.batches.append(inputs["attention_mask"].shape[0])

        tokens = super().forward(**inputs)
        return self.linear(tokens)

    def preencode(self, documents, category):
        self.lengths = []

        if self.center and self.center["scope"] == "batch":
            self.batches = []

        results = []
        for text in documents:
            prefix = self.qprefix if category == "query" else self.dprefix
            if prefix:
                text = f"{prefix}{text}"
            results.append(text)

        maxlength = self.qlength if category == "query" else self.dlength
        if maxlength:
            self.maxlength = maxlength

        return results

    def postencode(self, results, category):
        data, maxlength = [], 0
        for vectors, length in zip(results, self.lengths):
            maxlength = max(length, maxlength)

            # Normalize vector
            vectors = vectors[:length]
            vectors /= np.linalg.norm(vectors, axis=1)[:, np.newaxis]
            data.append(vectors)

        # Apply vector centering
        if self.center:
            data = self.centerdata(data)

        # Standard multi-vector output - pad values to maxlength
        padded = []
        for vectors in data:
            padded.append(np.pad(vectors, [(0, maxlength - vectors.shape[0]), (0, 0)]))

        return np.asarray(padded)

    def centerdata(self, data):
        array = isinstance(data, np.ndarray)
        vectors = [np.array(value, copy=True) for value in data]
        masks = [np.any(value != 0, axis=1) for value in vectors]
        scope = self.center["scope"]

        means = [None] * len(vectors)
        if scope == "batch":
            batches = getattr(self, "batches", None)
            sizes = batches if batches and sum(batches) == len(vectors) else [len(vectors)]
            offset = 0
            for size in sizes:
                rows = [vectors[x][masks[x]] for x in range(offset, offset + size) if masks[x].any()]
                mean = np.concatenate(rows).mean(axis=0) if rows else None
                means[offset : offset + size] = [mean] * size
                offset += size

        for x, (value, mask) in enumerate(zip(vectors, masks)):
            if mask.any():
                current = value[mask]
                average = current.mean(axis=0) if scope == "document" else means[x]
                current = current - average
                norms = np.linalg.norm(current, axis=1, keepdims=True)
                current = np.divide(current, norms, out=np.zeros_like(current), where=norms != 0)
                vectors[x][mask] = current

        return np.asarray(vectors) if array else vectors


# ---- txtai/pipeline/text/lateencoder.py ------------------------------------------------------------
class LateEncoder:
    def __init__(self, model, device="cpu"):
        self.device = device
        self.model = model

    def __call__(self, query, texts, limit=None):
        queries = [query] if isinstance(query, str) else query

        queries = self.encode(queries, "query")
        data = self.encode(texts, "data") if isinstance(texts[0], str) else texts

        scores = []
        for q in queries:
            scores.extend(self.score(q.unsqueeze(0), data, limit))

        return scores[0] if isinstance(query, str) else scores

    def encode(self, data, category):
        return torch.from_numpy(self.model.encode(data, category=category)).to(self.device)

    def score(self, queries, data, limit):
        if FIXED:
            # keep zero-padded token rows out of the maximum and the average
            qmask = queries.ne(0).any(dim=-1)
            dmask = data.ne(0).any(dim=-1)
            scores = torch.einsum("ash,bth->abst", queries, data)
            scores = scores.masked_fill(~dmask[None, :, None, :], float("-inf")).max(axis=-1).values
            scores = (scores * qmask[:, None, :]).sum(axis=-1) / qmask.sum(axis=-1, keepdim=True)
        else:
            # Compute bulk dot product using einstein notation
            scores = torch.einsum("ash,bth->abst", queries, data).max(axis=-1).values.mean(axis=-1)
        scores = scores.cpu().numpy()

        indices = np.argpartition(-scores, limit if limit and limit < scores.shape[0] else scores.shape[0] - 1)[:, :limit]
        scores = np.take_along_axis(scores, indices, axis=1)

        order = np.argsort(-scores, axis=1)
        indices, scores = np.take_along_axis(indices, order, axis=1), np.take_along_axis(scores, order, axis=1)

        results = []
        for x, index in enumerate(indices):
            results.append(list(zip(index.tolist(), scores[x].tolist())))

        return results


def main():
    queries = [
        "who wrote the origin of species",
        "tallest mountain",
    ]
    texts = [
        "darwin published the origin of species in london in eighteen fifty nine after years of notes",
        "everest is the tallest mountain above sea level",
        "the species list",
        "mountain weather changes fast near the summit and climbers wait for a window of calm days",
        "london",
        "who wrote it",
    ]
    words = sorted({w for t in queries + texts for w in t.split()})
    tokenizer = WordTokenizer(words)

    config = BertConfig(
        vocab_size=len(tokenizer.vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    bert = BertModel(config, add_pooling_layer=False).eval()
    linear = nn.Linear(config.hidden_size, 16, bias=False)

    # LateEncoder(path, vectors={"center": True}): batch-scoped token centering switched on
    pooling = LatePooling(bert, tokenizer, "cpu", linear, center=True)
    encoder = LateEncoder(pooling)

    results = encoder(queries, texts)
    for query, ranked in zip(queries, results):
        print(f"query: {query!r}")
        for index, score in ranked:
            print(f"  {index}  {score:+.5f}  {texts[index]!r}")


if __name__ == "__main__":
    main()
