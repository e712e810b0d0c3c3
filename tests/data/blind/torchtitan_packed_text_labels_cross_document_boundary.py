"""torchtitan packed text dataset: each document's last token was trained to predict the next
document's first token.

Citation: pytorch/torchtitan#4075 "Mask loss at document boundaries" (commit 3f71477c8),
torchtitan/hf_datasets/text_datasets.py (HuggingFaceTextDataset.__iter__).

The bug: __iter__ appended every document's tokens (BOS ... EOS) to one buffer, cut windows of
seq_len + 1 tokens and yielded ``input = x[:-1]``, ``label = x[1:]``, so inside a packed row the label
of a document's last token is the first token of the following document, although the block-causal
mask built from the per-document positions (reset to 0 at each document start) keeps the two
documents from seeing each other.

The fix: shift inside each document before packing (inputs get ``sample_tokens[:-1]``, labels
``sample_tokens[1:]``, positions ``range(len(sample_tokens) - 1)``) and cut windows of exactly
seq_len tokens from the input, label and position buffers.

Ported at toy sizes: a word-level tokenizer with BOS/EOS, the dataset's buffers and
_normalize_positions, the document mask torchtitan derives from ``positions``
(``doc_ids = cumsum(positions == 0) - 1``, and-ed with causal; here as the dense additive
[B, 1, S, S] mask of the HF-backend's _build_dense_attention_mask), a tiny HF Llama fed
``position_ids=positions``, and the trainer's cross-entropy over the labels.
"""

import sys

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- a word-level tokenizer with BOS / EOS ------------------------------------------------------
class ToyTokenizer:
    def __init__(self, texts):
        words = sorted({w for t in texts for w in t.split()})
        self.bos_id, self.eos_id = 0, 1
        self.vocab = {w: i + 2 for i, w in enumerate(words)}
        self.n_words = len(self.vocab) + 2

    def encode(self, text, add_bos=True, add_eos=True):
        ids = [self.vocab[w] for w in text.split()]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])


# ---- torchtitan/hf_datasets/text_datasets.py ----------------------------------------------------
class HuggingFaceTextDataset:
    def __init__(self, data, tokenizer, seq_len=2048):
        self._data = data
        self._tokenizer = tokenizer
        self.seq_len = seq_len
        self._text_processor = lambda sample: sample["text"]
        self._sample_idx = 0
        self._inputs_buffer: list[int] = []
        self._labels_buffer: list[int] = []
        self._positions_buffer: list[int] = []

    def _normalize_positions(self, positions: list[int]) -> list[int]:
        offset = positions[0]
        if offset > 0:
            for i, p in enumerate(positions):
                if p == 0:
                    break
                positions[i] = p - offset
        return positions

    def __iter__(self):
        if not FIXED:
            max_buffer_token_len = 1 + self.seq_len

        for sample in self._data:
            sample_text = self._text_processor(sample)
            sample_tokens = self._tokenizer.encode(sample_text, add_bos=True, add_eos=True)

            if FIXED:
                # Shift inputs and labels within the document, so the target of
                # a document's last token is never the next document's first token.
                self._inputs_buffer.extend(sample_tokens[:-1])
                self._labels_buffer.extend(sample_tokens[1:])
                self._positions_buffer.extend(range(len(sample_tokens) - 1))
            else:
                self._inputs_buffer.extend(sample_tokens)
                # Per-document positions reset at document boundaries.
                self._positions_buffer.extend(range(len(sample_tokens)))
            self._sample_idx += 1

            if FIXED:
                while len(self._inputs_buffer) >= self.seq_len:
                    input_ids = torch.LongTensor(self._inputs_buffer[: self.seq_len])
                    label_ids = torch.LongTensor(self._labels_buffer[: self.seq_len])
                    positions = torch.LongTensor(self._normalize_positions(self._positions_buffer[: self.seq_len]))
                    self._inputs_buffer = self._inputs_buffer[self.seq_len :]
                    self._labels_buffer = self._labels_buffer[self.seq_len :]
                    self._positions_buffer = self._positions_buffer[self.seq_len :]
                    yield {"input": input_ids, "positions": positions}, label_ids
            else:
                while len(self._inputs_buffer) >= max_buffer_token_len:
                    x = torch.LongTensor(self._inputs_buffer[:max_buffer_token_len])
                    pos = torch.LongTensor(self._normalize_positions(self._positions_buffer[:max_buffer_token_len]))
                    self._inputs_buffer = self._inputs_buffer[max_buffer_token_len:]
                    self._positions_buffer = self._positions_buffer[max_buffer_token_len:]

                    input = x[:-1]
                    label = x[1:]
                    positions = pos[:-1]
                    yield {"input": input, "positions": positions}, label


# ---- block_causal mask from positions (get_causal_mask_mod & get_document_mask_mod) -------------
def build_block_causal_mask(positions, dtype):
    batch_size, seq_len = positions.shape
    idx = torch.arange(seq_len)
    allowed = (idx[:, None] >= idx[None, :]).unsqueeze(0).expand(batch_size, -1, -1)
    doc_ids = torch.cumsum((positions == 0).int(), dim=1) - 1
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    allowed = allowed & same_doc
    mask = torch.zeros((batch_size, seq_len, seq_len), dtype=dtype)
    mask.masked_fill_(~allowed, float("-inf"))
    return mask.unsqueeze(1)


def cross_entropy_loss(pred, labels):
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=-100)


# ---- a few documents, a tiny Llama, one pass over the packed rows -------------------------------
docs = [
    {"text": "the cat sat on the mat"},
    {"text": "dogs chase balls in the park"},
    {"text": "rain falls on green hills"},
    {"text": "a bird sings at dawn"},
    {"text": "the river runs to the sea"},
    {"text": "snow covers the quiet town"},
    {"text": "bees make sweet honey"},
]
tokenizer = ToyTokenizer([d["text"] for d in docs])
dataset = HuggingFaceTextDataset(docs, tokenizer, seq_len=16)

config = LlamaConfig(vocab_size=tokenizer.n_words, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     bos_token_id=0, eos_token_id=1, pad_token_id=None)
config._attn_implementation = "sdpa"
model = LlamaForCausalLM(config).eval()

batches = list(dataset)
inputs = torch.stack([b[0]["input"] for b in batches])
positions = torch.stack([b[0]["positions"] for b in batches])
labels = torch.stack([b[1] for b in batches])

attention_masks = build_block_causal_mask(positions, model.dtype)
with torch.no_grad():
    logits = model(input_ids=inputs, attention_mask=attention_masks, position_ids=positions).logits
loss_sum = cross_entropy_loss(logits, labels)
num_tokens = int((labels != -100).sum())

print("rows:", inputs.shape[0], "seq_len:", inputs.shape[1])
print("inputs[0]:   ", inputs[0].tolist())
print("labels[0]:   ", labels[0].tolist())
print("positions[0]:", positions[0].tolist())
eos_targets = int(((inputs == tokenizer.eos_id) & (labels != -100)).sum())
print("tokens trained with an EOS input:", eos_targets)
print(f"loss: {loss_sum.item() / num_tokens:.6f} over {num_tokens} tokens")
