# Correct program (quiet batch quiet-r138b).
# Ported from jdinalt/forgather @f92f8b8b0940451edcd5642f516514e96aa2dd7e (files last changed in 23ee003):
# src/forgather/ml/datasets/block_tokenizer.py (Document, Bin, pack_sequences_optimized, _pack_single_document,
# _block_tokenize_optimized, block_tokenize_fn with packed=True, packing_strategy="best_fit"),
# src/forgather/ml/data_collator.py (_pos_ids_from_boundaries, get_pos_ids_for_packed_sequence,
# DataCollatorForCausalLM with document_starts), docs/datasets/document-boundaries.md ("Training with Packed
# Sequences": model(input_ids, position_ids, labels)) and modelsrc/transformer/causal_mask.py (no attention_mask is
# handed on; transformers' create_causal_mask reads the packed documents from position_ids).
# Fine-tuning examples are packed best-fit into rows of at most max_length tokens, each row carrying the offsets at
# which its documents start; the collator right-pads the rows to the batch's longest, sets pad labels to -100 and
# returns position_ids that restart at 0 at every document start (pads continue the last document's count). The
# batch is handed to a tiny Qwen3ForCausalLM (sdpa, use_cache=False) with no attention_mask, so each token attends
# causally within its own document only. As forgather packs, each document's closing EOS is trained to predict the
# next document's first token (GPT-style packing); its logits come from its own document.
# Trimmed for CPU: a word-level PreTrainedTokenizerFast built in memory (no BOS, like Qwen3) instead of a downloaded
# one, a tiny Qwen3 from Qwen3Config, float64, a plain DataLoader + AdamW loop instead of forgather's trainer.
# Self-check: every real token's logits in the packed batch equal those of its document run alone (no position_ids,
# no mask), and each batch's loss equals the cross-entropy over the same targets computed from those per-document
# logits.
import copy
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

logger = logging.getLogger(__name__)

torch.manual_seed(0)


# --- forgather/ml/datasets/block_tokenizer.py --------------------------------------------------------------------


@dataclass
class Document:
    """Represents a tokenized document for bin-packing."""

    input_ids: List[int]
    length: int
    original_index: int  # Track original order for debugging


class Bin:
    """
    Represents a bin (output sequence) for bin-packing algorithm.
    Tracks remaining capacity and documents packed into it.
    """

    def __init__(self, max_length: int, stride_tokens: Optional[List[int]] = None):
        self.max_length = max_length
        self.input_ids = stride_tokens if stride_tokens else []
        self.length = len(self.input_ids)
        self.documents = []  # Track which documents are in this bin

    def remaining(self) -> int:
        return self.max_length - self.length

    def can_fit(self, doc_length: int) -> bool:
        return self.remaining() >= doc_length

    def add_document(self, doc: Document, tokens_to_add: Optional[int] = None):
        if tokens_to_add is None:
            tokens_to_add = doc.length

        tokens_to_add = min(tokens_to_add, self.remaining(), doc.length)
        if tokens_to_add > 0:
            self.input_ids.extend(doc.input_ids[:tokens_to_add])
            self.length += tokens_to_add
            self.documents.append((doc.original_index, tokens_to_add))

    def get_ids(self) -> List[int]:
        return self.input_ids

    def get_document_starts(self) -> List[int]:
        """Get starting positions of each document in this bin."""
        if not self.documents:
            return []

        starts = []
        position = 0
        for _, tokens_added in self.documents:
            starts.append(position)
            position += tokens_added
        return starts


def _pack_single_document(doc: Document, bins: List[Bin], max_length: int, strategy: str) -> None:
    if strategy == "best_fit":
        # Find bin with least remaining space that still fits the document
        best_bin = None
        best_remaining = max_length + 1

        for bin in bins:
            if bin.can_fit(doc.length) and bin.remaining() < best_remaining:
                best_bin = bin
                best_remaining = bin.remaining()

        if best_bin:
            best_bin.add_document(doc)
        else:
            new_bin = Bin(max_length)
            new_bin.add_document(doc)
            bins.append(new_bin)

    elif strategy == "first_fit":
        for bin in bins:
            if bin.can_fit(doc.length):
                bin.add_document(doc)
                return

        new_bin = Bin(max_length)
        new_bin.add_document(doc)
        bins.append(new_bin)

    else:
        raise ValueError(f"Unknown packing strategy: {strategy}")


def pack_sequences_optimized(
    documents: List[Document],
    max_length: int,
    min_len: int,
    overflow: bool,
    strategy: str = "best_fit",
):
    """Pack documents into bins; returns (sequences, document_starts)."""
    if not documents:
        return [], []

    # Sort documents by length (descending) for better packing
    sorted_docs = sorted(documents, key=lambda d: d.length, reverse=True)

    bins: List[Bin] = []

    for doc in sorted_docs:
        if doc.length > max_length:
            if overflow:
                raise NotImplementedError("split_document_optimally is not ported")
            # Truncate document
            truncated = Document(
                input_ids=doc.input_ids[:max_length],
                length=max_length,
                original_index=doc.original_index,
            )
            _pack_single_document(truncated, bins, max_length, strategy)
        else:
            _pack_single_document(doc, bins, max_length, strategy)

    output_sequences = []
    document_starts = []
    for bin in bins:
        if bin.length >= min_len:
            output_sequences.append(bin.get_ids())
            document_starts.append(bin.get_document_starts())

    return output_sequences, document_starts


def block_tokenize_fn(
    features: Dict[str, List[Any]],
    tokenizer: PreTrainedTokenizerFast,
    feature: str,
    max_length=512,
    overflow: bool = True,
    packing_strategy: str = "best_fit",
    min_len: int = 1,
    add_bos: bool = True,
    add_eos: bool = True,
):
    """The packed=True, best_fit / first_fit path of forgather's block_tokenize_fn."""
    assert min_len >= 1
    if tokenizer.bos_token_id is None:
        add_bos = False
    if tokenizer.eos_token_id is None:
        add_eos = False

    outputs = tokenizer(
        features[feature],
        truncation=False,
        return_length=True,
        max_length=9223372036854775807,
        add_special_tokens=False,
    )

    documents = []
    for idx, (record_length, input_ids) in enumerate(zip(outputs["length"], outputs["input_ids"])):
        if add_bos:
            record_length += 1
            input_ids = [tokenizer.bos_token_id] + input_ids
        if record_length < min_len:
            continue
        if add_eos:
            record_length += 1
            input_ids = input_ids + [tokenizer.eos_token_id]
        documents.append(Document(input_ids=input_ids, length=record_length, original_index=idx))

    output_sequences, document_starts = pack_sequences_optimized(
        documents=documents,
        max_length=max_length,
        min_len=min_len,
        overflow=overflow,
        strategy=packing_strategy,
    )
    return {"input_ids": output_sequences, "document_starts": document_starts}


# --- forgather/ml/data_collator.py -------------------------------------------------------------------------------


def _pos_ids_from_boundaries(x: Tensor, document_starts: Tensor) -> Tensor:
    """
    Generate position IDs from explicit document boundary positions.

    document_starts: (B, max_docs) document start positions, padded with -1.
    """
    B, T = x.shape
    device = x.device

    pos_ids = torch.zeros((B, T), dtype=torch.long, device=device)

    for batch_idx in range(B):
        starts = document_starts[batch_idx]
        starts = starts[starts >= 0]  # Remove padding

        if len(starts) == 0:
            pos_ids[batch_idx] = torch.arange(T, device=device)
        else:
            for i, start in enumerate(starts):
                # Calculate end position (next boundary or end of sequence)
                end = starts[i + 1] if i + 1 < len(starts) else T
                doc_length = end - start
                pos_ids[batch_idx, start:end] = torch.arange(doc_length, device=device)

    return pos_ids


def get_pos_ids_for_packed_sequence(
    x: Tensor,
    token_id: Optional[int] = None,
    document_starts: Optional[Tensor] = None,
    eos: bool = True,
) -> Tensor:
    if document_starts is not None:
        return _pos_ids_from_boundaries(x, document_starts)
    raise ValueError("Must provide document_starts (the token-based legacy mode is not ported)")


class DataCollatorForCausalLM:
    """Pads with tokenizer.pad(features, **pad_kwargs), labels = input_ids with pads set to ignore_index."""

    def __init__(
        self,
        tokenizer,
        truncation: bool = False,
        ignore_index: int = -100,
        input_name: str = "input_ids",
        labels_name: str | None = "labels",
        packed_sequences: Optional[bool] = None,
        **pad_kwargs,
    ):
        tokenizer = copy.deepcopy(tokenizer)
        if tokenizer.pad_token is None:
            logger.warning("No PAD token defined. Setting pad token to EOS")
            tokenizer.pad_token = tokenizer.eos_token

        if tokenizer.padding_side == "left":
            logger.warning("Padding side set to left; moving it to the right")
            tokenizer.padding_side = "right"

        if tokenizer.truncation_side == "left":
            logger.warning("Truncation side set to left; moving it to the right")
            tokenizer.truncation_side = "right"

        self.tokenizer = tokenizer
        self.max_length = pad_kwargs.get("max_length", tokenizer.model_max_length)
        self.input_name = input_name
        self.labels_name = labels_name
        self.packed_sequences = packed_sequences
        padding = pad_kwargs.get("padding", None)
        pad_to_max_length = padding and isinstance(padding, str) and padding == "max_length"
        if not pad_to_max_length and "max_length" in pad_kwargs:
            pad_kwargs.pop("max_length")

        if self.max_length > tokenizer.model_max_length:
            raise ValueError(f"{self.max_length=} is greater than {tokenizer.model_max_length=}")
        self.truncation = truncation
        self.ignore_index = ignore_index
        self.pad_kwargs = pad_kwargs

    def __call__(self, features: List[Dict[str, Any]]) -> Dict[str, Any]:
        if self.truncation:
            features = self._truncate(features)

        # Extract document_starts before padding (tokenizer.pad won't handle this custom field)
        document_starts_list = None
        if features and "document_starts" in features[0]:
            document_starts_list = [f.pop("document_starts") for f in features]

        padded_batch = self.tokenizer.pad(features, **self.pad_kwargs)
        input_ids: Tensor = padded_batch["input_ids"]
        labels: Tensor | None = padded_batch.get("labels", None)
        if labels is None:
            labels = torch.where(input_ids == self.tokenizer.pad_token_id, self.ignore_index, input_ids)
        output_dict = {self.input_name: input_ids}
        if not self.labels_name:
            return output_dict, labels

        output_dict["labels"] = labels

        use_packed_sequences = self.packed_sequences
        if use_packed_sequences is None:
            use_packed_sequences = document_starts_list is not None

        if use_packed_sequences:
            document_starts_tensor = self._pad_document_starts(document_starts_list)
            output_dict["position_ids"] = get_pos_ids_for_packed_sequence(
                input_ids, document_starts=document_starts_tensor
            )
        return output_dict

    def _truncate(self, features):
        return [{key: value[: self.max_length] for key, value in example.items()} for example in features]

    def _pad_document_starts(self, document_starts_list: List[List[int]]) -> Tensor:
        if not document_starts_list:
            return torch.tensor([], dtype=torch.long)

        max_docs = max(len(starts) for starts in document_starts_list)
        padded = []
        for starts in document_starts_list:
            padded.append(starts + [-1] * (max_docs - len(starts)))
        return torch.tensor(padded, dtype=torch.long)


# --- a word-level tokenizer with no BOS (stands in for Qwen3's) ----------------------------------------------------

TEXTS = [
    "user : name a red fruit assistant : an apple is a red fruit",
    "user : what is two plus two assistant : four",
    "user : say hello assistant : hello there",
    "user : list three colours assistant : red green and blue are three colours that people like",
    "user : what do cats eat assistant : cats eat fish and meat",
    "user : is the sky blue assistant : yes",
    "user : name a planet assistant : mars is a planet near the earth and it looks red at night when the sky is dark",
    "user : count to three assistant : one two three",
    "user : what is an apple assistant : a fruit",
]

words = sorted({w for t in TEXTS for w in t.split()})
vocab = {"<|endoftext|>": 0, "<|pad|>": 1}
for w in words:
    vocab[w] = len(vocab)
word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=word_level,
    eos_token="<|endoftext|>",
    pad_token="<|pad|>",
    model_max_length=24,
    padding_side="right",
)

MAX_LENGTH = 24

packed = block_tokenize_fn(
    {"text": TEXTS},
    tokenizer,
    "text",
    max_length=MAX_LENGTH,
    overflow=False,
    packing_strategy="best_fit",
)
train_dataset = [
    {"input_ids": ids, "document_starts": starts}
    for ids, starts in zip(packed["input_ids"], packed["document_starts"])
]
assert any(len(r["document_starts"]) > 1 for r in train_dataset)
assert len({len(r["input_ids"]) for r in train_dataset}) > 1

collator = DataCollatorForCausalLM(tokenizer, padding="longest", return_tensors="pt")

config = Qwen3Config(
    vocab_size=len(vocab),
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    pad_token_id=tokenizer.pad_token_id,
    eos_token_id=tokenizer.eos_token_id,
    bos_token_id=None,
    use_cache=False,
    attention_dropout=0.0,
    attn_implementation="sdpa",
)
model = Qwen3ForCausalLM(config).to(torch.float64)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

reference_starts = [list(r["document_starts"]) for r in train_dataset]
reference_ids = [list(r["input_ids"]) for r in train_dataset]
batch_size = 2
loader = DataLoader(
    [dict(r, row=i) for i, r in enumerate(train_dataset)],
    batch_size=batch_size,
    shuffle=False,
    collate_fn=lambda feats: (
        [f["row"] for f in feats],
        # an HF datasets row is a fresh dict on every read; the collator pops document_starts from it
        collator([{"input_ids": f["input_ids"], "document_starts": list(f["document_starts"])} for f in feats]),
    ),
)


def per_document_logits(row_ids, starts):
    """Each document of a packed row run alone: plain causal attention from position 0, nothing packed."""
    ends = starts[1:] + [len(row_ids)]
    pieces = []
    for start, end in zip(starts, ends):
        doc = torch.tensor([row_ids[start:end]])
        pieces.append(model(input_ids=doc).logits[0])
    return torch.cat(pieces, dim=0)


worst_logits, worst_loss, n_batches = 0.0, 0.0, 0
for epoch in range(2):
    for rows, batch in loader:
        assert set(batch) == {"input_ids", "labels", "position_ids"}
        outputs = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            labels=batch["labels"],
        )

        with torch.no_grad():
            targets, ref_logits = [], []
            for b, row in enumerate(rows):
                n = len(reference_ids[row])
                alone = per_document_logits(reference_ids[row], reference_starts[row])
                worst_logits = max(worst_logits, (outputs.logits[b, :n] - alone).abs().max().item())
                # same targets as the model's shifted labels: position t predicts the row's token t + 1
                ref_logits.append(alone[:-1])
                targets.append(batch["labels"][b, 1:n])
            # transformers takes the loss in float32 (ForCausalLMLoss upcasts with logits.float())
            expected = F.cross_entropy(torch.cat(ref_logits).float(), torch.cat(targets), ignore_index=-100)
            worst_loss = max(worst_loss, abs(outputs.loss.item() - expected.item()))

        outputs.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        n_batches += 1

print(f"{len(train_dataset)} packed rows, {sum(len(s) for s in reference_starts)} documents, {n_batches} steps")
print(f"max |packed - per-document| logits: {worst_logits:.2e}; max |loss - reference loss|: {worst_loss:.2e}")
assert worst_logits < 1e-10, worst_logits
assert worst_loss < 1e-6, worst_loss
print("ok")
