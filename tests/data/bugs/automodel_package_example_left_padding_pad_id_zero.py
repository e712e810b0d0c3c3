"""NeMo Automodel `_package_tokenized_example` missed left padding and pad id 0: mask all ones.

Citation: NVIDIA-NeMo/Automodel PR #3704 ("fix(datasets): correct attention mask for
left-padded and pad-id-0 tokenizers").  Open PR; its description was read, the diff was not,
so the helper bodies below are reconstructed from that description (names as given there).

Bug: `_package_tokenized_example` finds the padding by stripping *trailing* tokens equal to
the pad id it is handed.  Two ways that goes wrong (the PR measured 30 models broken via the
first, 6 via the second): (1) a left-padding tokenizer has no trailing pad run; (2) callers
compute the pad id as `_add_pad_token(tok) or tok.eos_token_id`, so a pad_token_id of 0
becomes the EOS id and the scan looks for the wrong token.  Either way `content_length` stays
at the full length and the attention mask is all ones: real tokens attend the pad run (labels
are -100 there, so the loss curve looks normal).
Fix: choose the pad id with an explicit `is None` test and locate the pad run on either side,
so the padding is masked.

Reproduction: a tokenizer stand-in with pad_token_id 0 and padding_side "left" (both causes at
once), SQuAD-like examples padded to seq_length=8, the dataset helper building
`attention_mask`, a collator, and a causal decoder layer that turns `attention_mask` into a
4-D boolean mask for SDPA.  Left padding puts the pads before the real tokens, so under the
causal mask the real tokens see them.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class _Tok:
    """Tokenizer stand-in: pad_token_id 0, eos 2, left padding (both kinds the PR measured)."""

    pad_token_id = 0
    eos_token_id = 2
    padding_side = "left"


def _add_pad_token(tokenizer):
    """Return the tokenizer's pad id (adding none here, it already has one)."""
    return tokenizer.pad_token_id


def _pad_id(tokenizer):
    if FIXED:
        pad = _add_pad_token(tokenizer)
        return tokenizer.eos_token_id if pad is None else pad
    return _add_pad_token(tokenizer) or tokenizer.eos_token_id


def _package_tokenized_example(input_ids, labels, pad_token_id, seq_length):
    """Pad to seq_length and build attention_mask from the located pad run."""
    # the tokenizer pads with its own pad token on its own side, whatever id the caller passed in
    n_pad = seq_length - len(input_ids)
    if _Tok.padding_side == "left":
        input_ids = [_Tok.pad_token_id] * n_pad + list(input_ids)
        labels = [-100] * n_pad + list(labels)
    else:
        input_ids = list(input_ids) + [_Tok.pad_token_id] * n_pad
        labels = list(labels) + [-100] * n_pad
    content_length = len(input_ids)
    while content_length > 0 and input_ids[content_length - 1] == pad_token_id:
        content_length -= 1
    leading = 0
    if FIXED:
        while leading < content_length and input_ids[leading] == pad_token_id:
            leading += 1
    attention_mask = [0] * leading + [1] * (content_length - leading) + [0] * (seq_length - content_length)
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
