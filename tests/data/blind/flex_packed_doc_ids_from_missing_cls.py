"""Packed FlexAttention document mask whose document ids come from CLS tokens that are absent.

Citation: meta-pytorch/attention-gym#98 ("Building a composite mask with attention_mask from
tokenizers"). The reporter packed protein sequences (ESM tokenizer) into one row and used a
BERT-style bidirectional sliding-window + document mask_mod. The maintainer's corrected repro
(comment by drisspg, 2026-07-02) names the bug: "`docs` was built from CLS-token positions,
but tokenization used `add_special_tokens=False`, so no CLS tokens exist -> `docs` was all
zeros and the sliding window leaked across sequence boundaries in the packed layout." I read the
issue text and the header of the corrected script, not every line of either script.

Bug: document ids = cumulative count of CLS tokens; with add_special_tokens=False there are
none, every token gets document 0, and the document term of the mask_mod is always true.

Fix: document ids that mark the real sequence boundaries (here: derived from each tokenized
sequence's length, i.e. one id per packed sequence).

Reproduction: plain torch with eager `flex_attention` + `create_block_mask` on CPU; a
character-level stand-in for the ESM tokenizer (cls id 0, no special tokens added); random
q/k/v stand in for one attention layer over the packed row [seq_a, seq_b, seq_a, seq_b].
"""
import sys
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

FIXED = "--fixed" in sys.argv

AMINO = "LAGVSERTIDPKQNFYMHWCXBUZO"
CLS_TOKEN_ID = 0


def tokenize(seq, add_special_tokens=False):
    """Stand-in for EsmTokenizer(seq, add_special_tokens=..., padding=False).input_ids."""
    ids = [AMINO.index(c) + 4 for c in seq]
    if add_special_tokens:
        ids = [CLS_TOKEN_ID] + ids + [2]
    return ids


def main():
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    torch.manual_seed(0)
    heads = 4
    head_dim = 16
    sliding_window_size = 64
    seq_a = "MYDSNIFEKVNQYKFLYIWWLIMINVNH"
    seq_b = "VPAALSAHAVLVDHHDQLLAALRVLLPVRHWEGAVVTPEQTRRQHVAQRDMVVRSLLLAPTPEERGEERPRKPRQVTVVPVVSREPGAHAYRLPIVREARYL"
    batch = [seq_a, seq_b, seq_a, seq_b]

    # Example 1 with (1, seq_len * batch_size)
    input_ids = []
    lengths = []
    for seq in batch:
        ids = tokenize(seq, add_special_tokens=False)
        input_ids.extend(ids)
        lengths.append(len(ids))
    input_ids = torch.tensor(input_ids).flatten()
    L = input_ids.shape[0]

    if FIXED:
        docs = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(lengths))
    else:
        docs = (input_ids == CLS_TOKEN_ID).cumsum(dim=0)

    def doc_mask_mod(b, h, q_idx, kv_idx):  # BERT style document mask with sliding window
        bidirectional_sliding_window_mask = torch.abs(q_idx - kv_idx) < sliding_window_size
        doc_mask = docs[q_idx] == docs[kv_idx]
        return bidirectional_sliding_window_mask & doc_mask

    block_mask = create_block_mask(doc_mask_mod, 1, 1, L, L, device="cpu")
    q = torch.randn(1, heads, L, head_dim)
    k = torch.randn(1, heads, L, head_dim)
    v = torch.randn(1, heads, L, head_dim)
    out = flex_attention(q, k, v, block_mask=block_mask)
    print("packed output, mean |x| of the first seq_b: %.4f" % out[0, :, lengths[0]:lengths[0] + lengths[1]].abs().mean().item())


if __name__ == "__main__":
    main()
