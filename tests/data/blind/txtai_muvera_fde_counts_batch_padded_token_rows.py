# Citation: neuml/txtai#1177 ("fix(muvera): consume true token rows instead of batch-padded ones"),
#   merged as commit a1c9b94d0093e2d6db145ef7c3c011d971c59e9c; the code before the fix is a1c9b94d^ (11ebacdb).
# Upstream: src/python/txtai/models/pooling/base.py (Pooling.encode / forward), models/pooling/late.py
#   (LatePooling.forward / preencode / postencode, Dense), models/pooling/muvera.py (Muvera.__call__).
#   Stanford-format ColBERT settings ([unused0] / [unused1] markers); MUVERA is on by default for late pooling;
#   token centering (off for a single Dense layer) and LEMUR are left out. A tiny BertModel stands in for the
#   checkpoint, a BertTokenizerFast over a small vocab for its tokenizer.
# Bug: LatePooling handed MUVERA the token vectors after every document had been padded to the batch's longest
#   (the model's own [PAD] positions, then zero rows across batches). Those rows fell into simhash partitions:
#   for "data" they were counted and diluted each partition average, for "query" the [PAD] outputs were summed
#   into the encoding, so a text's fixed dimensional encoding depended on what else was in its batch.
# Fix: Muvera declares `unpadded = True`; LatePooling then keeps attention_mask.sum(dim=1) per row in forward
#   and slices each document back to its true token count before normalising and encoding.
import os
import sys
import tempfile

import numpy as np
import torch
from transformers import BertConfig, BertModel, BertTokenizerFast

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

Module = torch.nn.Module


# ---------------------------------------------------------------- models/pooling/base.py
class Pooling(Module):
    """
    Builds pooled vectors usings outputs from a transformers model.
    """

    def __init__(self, model, tokenizer, device, maxlength=None):
        super().__init__()

        self.model = model
        self.tokenizer = tokenizer
        self.device = device

        # Set max length
        self.maxlength = maxlength if maxlength else self.tokenizer.model_max_length if self.tokenizer.model_max_length != int(1e30) else None

        self.prompts = None

        # Move to device
        self.to(self.device)

    def encode(self, documents, batch=32, category=None):
        # Split documents into batches and process
        results = []

        # Apply pre encoding transformation logic
        documents = self.preencode(documents, category)

        # Sort document indices from largest to smallest to enable efficient batching
        # This performance tweak matches logic in sentence-transformers
        lengths = np.argsort([-len(x) if x else 0 for x in documents])
        documents = [documents[x] for x in lengths]

        for chunk in self.chunk(documents, batch):
            # Tokenize input
            inputs = self.tokenizer(chunk, padding=True, truncation="longest_first", return_tensors="pt", max_length=self.maxlength)

            # Move inputs to device
            inputs = inputs.to(self.device)

            # Run inputs through model
            with torch.no_grad():
                outputs = self.forward(**inputs)

            # Add batch result
            results.extend(outputs.cpu().to(torch.float32).numpy())

        # Apply post encoding transformation logic
        results = self.postencode(results, category)

        # Restore original order and return array
        return np.asarray([results[x] for x in np.argsort(lengths)])

    def chunk(self, texts, size):
        return [texts[x : x + size] for x in range(0, len(texts), size)]

    def forward(self, **inputs):
        return self.model(**inputs)[0]

    def preencode(self, documents, category):
        return documents

    def postencode(self, results, category):
        return results


# ---------------------------------------------------------------- models/pooling/muvera.py
class Muvera:
    """
    Implements the MUVERA (Multi-Vector Retrieval via Fixed Dimensional Encodings) algorithm. This reduces late interaction multi-vector
    outputs to a single fixed vector.

        output dimensions = repetitions * 2^hashes * projected
    """

    if FIXED:
        # Signals LatePooling that this encoder must receive true, unpadded token rows
        unpadded = True

    def __init__(self, repetitions=20, hashes=5, projection=16, seed=42):
        # Number of repetitions
        self.repetitions = repetitions

        # Number of simhash projections
        self.hashes = hashes

        # Optional number of projected dimensions
        self.projection = projection

        # Seed
        self.seed = seed

    def __call__(self, data, category):
        # Get stats
        dimension, length = data[0].shape[1], len(data)

        # Determine projection dimension
        identity = not self.projection
        projection = dimension if identity else self.projection

        # Number of simhash partitions
        partitions = 2**self.hashes

        # Document tracking
        lengths = torch.tensor([len(doc) for doc in data], dtype=torch.int64)
        total = lengths.sum().item()
        documents = torch.repeat_interleave(torch.arange(length), lengths)

        # Stack all vectors
        points = torch.cat([torch.as_tensor(doc, dtype=torch.float32) for doc in data])

        # Output vectors
        size = self.repetitions * partitions * projection
        vectors = torch.zeros((length, size), dtype=torch.float32)

        # Process each repetition
        for number in range(self.repetitions):
            seed = self.seed + number

            # Calculate the simhash
            sketches = torch.matmul(points, self.random(dimension, self.hashes, seed))

            # Dimensionality reduction, if necessary
            projected = points if identity else torch.matmul(points, self.reducer(dimension, projection, seed))

            # Get partition indices
            bits = (sketches > 0).to(torch.int64)
            indices = torch.zeros(total, dtype=torch.int64)

            # Calculate vector indices
            for x in range(self.hashes):
                indices = (indices << 1) + (bits[:, x] ^ (indices & 1))

            # Initialize storage
            fdesum = torch.zeros((length * partitions * projection,), dtype=torch.float32)
            counts = torch.zeros((length * partitions,), dtype=torch.int32)

            # Count vectors per partition per document
            flat = documents * partitions + indices
            counts.index_add_(0, flat, torch.ones(total, dtype=torch.int32))
            counts = counts.reshape(length, partitions)

            # Aggregate vectors using flattened indexing for efficiency
            base = flat * projection

            for d in range(projection):
                fdesum.index_add_(0, base + d, projected[:, d])

            # Reshape for easier manipulation
            fdesum = fdesum.reshape(length, partitions, projection)

            # Convert sums to averages for data category
            if category == "data":
                # Safe division (avoid divide by zero)
                counts = counts[:, :, None]
                fdesum = torch.where(counts > 0, fdesum / counts.to(torch.float32), fdesum)

            # Save results
            start = number * partitions * projection
            vectors[:, start : start + partitions * projection] = fdesum.reshape(length, -1)

        return vectors.cpu().numpy()

    def random(self, dimension, projection, seed):
        rng = np.random.default_rng(seed)
        return torch.from_numpy(rng.normal(loc=0.0, scale=1.0, size=(dimension, projection)).astype(np.float32))

    def reducer(self, dimension, projection, seed):
        rng = np.random.default_rng(seed)
        out = np.zeros((dimension, projection), dtype=np.float32)
        indices = rng.integers(0, projection, size=dimension)
        signs = rng.choice([-1.0, 1.0], size=dimension)
        out[np.arange(dimension), indices] = signs

        return torch.from_numpy(out)


# ---------------------------------------------------------------- models/pooling/late.py
class LatePooling(Pooling):
    """
    Builds late pooled vectors using outputs from a transformers model.
    """

    def __init__(self, model, tokenizer, device, linear, settings, maxlength=None, modelargs=None):
        # Check if fixed dimensional encoder is enabled
        modelargs = modelargs.copy() if modelargs else {}
        muvera = modelargs.pop("muvera", {})

        # Call parent initialization
        super().__init__(model, tokenizer, device, maxlength)

        # Create fixed dimensional encoder
        self.encoder = Muvera(**muvera) if muvera is not None else None
        self.lengths = None

        # Read model settings (Stanford format: query_token_id, query_maxlen, doc_token_id, doc_maxlen)
        self.qprefix, self.qlength, self.dprefix, self.dlength = settings

        # Linear model
        self.linear = linear

        # Token centering resolves to None for a single Dense layer
        self.center = None
        self.batches = None

    def forward(self, **inputs):
        # Track true token counts for centering and encoders that can't consume padding
        if self.center or getattr(self.encoder, "unpadded", False):
            self.lengths.extend(inputs["attention_mask"].sum(dim=1).cpu().tolist())

        # Run through transformers model
        tokens = super().forward(**inputs)

        # Run through final linear layer and return
        return self.linear(tokens)

    def preencode(self, documents, category):
        # Reset true token counts for this encoding pass
        if self.center or getattr(self.encoder, "unpadded", False):
            self.lengths = []

        results = []

        # Apply prefix
        for text in documents:
            prefix = self.qprefix if category == "query" else self.dprefix
            if prefix:
                text = f"{prefix}{text}"

            results.append(text)

        # Set maxlength
        maxlength = self.qlength if category == "query" else self.dlength
        if maxlength:
            self.maxlength = maxlength

        return results

    def postencode(self, results, category):
        # LEMUR operates on normalized true token rows before batch padding
        if getattr(self.encoder, "unpadded", False):
            data = []
            for vectors, length in zip(results, self.lengths):
                vectors = vectors[:length]
                vectors /= np.linalg.norm(vectors, axis=1)[:, np.newaxis]
                data.append(vectors)

            return self.encoder(data, category)

        length = 0
        for vectors in results:
            # Get max length
            if vectors.shape[0] > length:
                length = vectors.shape[0]

            # Normalize vectors
            vectors /= np.linalg.norm(vectors, axis=1)[:, np.newaxis]

        # Pad values
        data = []
        for vectors in results:
            data.append(np.pad(vectors, [(0, length - vectors.shape[0]), (0, 0)]))

        # Build NumPy array
        data = np.asarray(data)

        # Apply fixed dimesional encoder, if necessary
        return self.encoder(data, category) if self.encoder else data


class Dense(Module):
    """
    Dense layer. Supports multiple linear layers that sum into a final answer.
    """

    def __init__(self, *modules):
        super().__init__()
        self.layers = torch.nn.ModuleList(modules)

    def forward(self, x):
        # Compute sum of all module outputs
        return sum(layer(x) for layer in self.layers)


# ---------------------------------------------------------------- tiny ColBERT checkpoint stand-in
WORDS = (
    "the a of and to in is for on with that this by from as at are be it text short longer considerably "
    "exercises padding behavior pooling layer late interaction retrieval vector vectors query document search "
    "index token tokens model models encoder fixed dimensional encoding batch what how which does why colbert "
    "multi muvera ranking rank score scores similarity dense sparse passage passages answer question"
).split()


def build():
    directory = tempfile.mkdtemp()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]", "[unused1]", ".", ",", "?"] + WORDS
    path = os.path.join(directory, "vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(vocab) + "\n")

    tokenizer = BertTokenizerFast(vocab_file=path, do_lower_case=True, additional_special_tokens=["[unused0]", "[unused1]"])
    tokenizer.model_max_length = 512

    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertModel(config).eval()

    weights = torch.randn(32, config.hidden_size) / config.hidden_size**0.5
    linear = torch.nn.Linear(weights.shape[1], weights.shape[0], bias=False, dtype=weights.dtype)
    with torch.no_grad():
        linear.weight.copy_(weights)

    return model, tokenizer, torch.nn.Sequential(Dense(linear))


def main():
    model, tokenizer, linear = build()
    pooling = LatePooling(model, tokenizer, torch.device("cpu"), linear, ["[unused0] ", 32, "[unused1] ", 180])

    documents = [
        "Late interaction models score every query token against every document token.",
        "MUVERA builds a fixed dimensional encoding from multi vector outputs so a dense index can search it.",
        "Short text.",
        "Padding behavior of the pooling layer changes the vectors of a batch.",
    ]
    queries = ["what is muvera?", "how does late interaction retrieval rank a passage with colbert token vectors?"]

    # Index documents in one batch, encode queries in one batch, score with a dot product as a dense index does
    data = pooling.encode(documents, category="data")
    query = pooling.encode(queries, category="query")
    scores = query @ data.T

    # The short document encoded on its own
    alone = pooling.encode([documents[2]], category="data")

    np.set_printoptions(precision=4, suppress=True)
    print("fixed" if FIXED else "buggy")
    print("fde shape", data.shape)
    print("scores\n", scores)
    print("ranking", np.argsort(-scores, axis=1).tolist())
    print("short document alone vs batched, max abs diff", float(np.abs(alone[0] - data[2]).max()))


if __name__ == "__main__":
    main()
