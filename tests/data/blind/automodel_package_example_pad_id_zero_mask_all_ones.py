"""NeMo Automodel `_package_tokenized_example` searched for EOS instead of pad id 0: mask all ones.

Citation: NVIDIA-NeMo/Automodel PR #3704 ("fix(datasets): correct attention mask for
left-padded and pad-id-0 tokenizers").  Open PR; its description was read, the diff was not,
so the helper bodies below are reconstructed from that description (names as given there).

Bug: callers compute the pad id as `_add_pad_token(tok) or tok.eos_token_id`; for a tokenizer
whose pad_token_id is 0, `0 or eos` is the EOS id.  `_package_tokenized_example` then finds
the padding by stripping *trailing* tokens equal to that id, finds none, leaves
`content_length` at the full sequence length, and emits an all-ones attention mask: every
real token attends the whole pad run (labels are -100 there, so the loss curve looks normal).
Fix: choose the pad id with an explicit `is None` test (and locate padding on either side),
so the pad run is masked.

Reproduction: a pad-id-0 tokenizer stand-in, SQuAD-like examples right-padded to
seq_length=8 with token 0, the dataset helper building `attention_mask`, a collator, and a
causal decoder layer that turns `attention_mask` into a 4-D boolean mask for SDPA.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class _Tok:
    """Tokenizer stand-in: pad_token_id 0 (as in several tokenizers the PR measured), eos 2."""

    pad_token_id = 0
    eos_token_id = 2


def _add_pad_token(tokenizer):
    """Return the tokenizer's pad id (adding none here, it already has one)."""
    return tokenizer.pad_token_id


def _pad_id(tokenizer):
    if FIXED:
        pad = _add_pad_token(tokenizer)
        return tokenizer.eos_token_id if pad is None else pad
    return _add_pad_token(tokenizer) or tokenizer.eos_token_id


def _package_tokenized_example(input_ids, labels, pad_token_id, seq_length):
    """Pad to seq_length and build attention_mask by stripping the trailing pad run."""
    # the tokenizer pads with its own pad token, whatever id the caller passed in
    input_ids = list(input_ids) + [_Tok.pad_token_id] * (seq_length - len(input_ids))
    labels = list(labels) + [-100] * (seq_length - len(labels))
    content_length = len(input_ids)
    while content_length > 0 and input_ids[content_length - 1] == pad_token_id:
        content_length -= 1
    attention_mask = [1] * content_length + [0] * (seq_length - content_length)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def collate(examples):
    return {k: torch.tensor([e[k] for e in examples]) for k in examples[0]}


class DecoderLayer(nn.Module):
    def __init__(self, vocab=16, hidden=16, heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.heads = heads

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def main():
    torch.manual_seed(0)
    tok = _Tok()
    pad_token_id = _pad_id(tok)
    raw = [([5, 6, 7, 8, 9, 3, 2], [-100, -100, -100, -100, 9, 3, 2]), ([5, 11, 12, 2], [-100, -100, 12, 2])]
    examples = [_package_tokenized_example(ids, lab, pad_token_id, seq_length=8) for ids, lab in raw]
    batch = collate(examples)
    out = DecoderLayer()(batch["input_ids"], batch["attention_mask"])
    print("attention_mask", batch["attention_mask"].tolist())
    print("out[1,0,-1,:3] =", [round(x, 4) for x in out[1, 0, -1, :3].tolist()])


if __name__ == "__main__":
    main()
