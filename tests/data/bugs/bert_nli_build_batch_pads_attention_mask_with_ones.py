"""bert_nli: build_batch padded the attention masks with 1, so BERT attended to [PAD] tokens.

Citation: yg211/bert_nli#3 ("utils: Fix padding of attention masks", merged): "The attention masks
are initialised incorrectly at the moment with all values set to 1. Setting the padded tokens in
the masks to 0 improves the accuracy."  Read: the PR description and utils/utils.py
(`get_pair_input`, `build_batch`) at the pre-fix commit.

Bug: `build_batch` padded each pair's `attention_masks[ii] += [1]*(longest-len(...))`, so the mask
handed to `BertModel(attention_mask=...)` was all ones and every real token (and the [CLS] vector
used by the NLI head) attended to the zero-id padding of shorter pairs.
Fix: pad the mask with zeros: `attention_masks[ii] += [0]*(longest-len(attention_masks[ii]))`.

Reproduction: `BertNLIModel.ff` written after bert_nli.py (not re-read here: BERT encoder -> pooled
[CLS] -> nli_head) on a
batch of two sentence pairs of different length; BERT is a random-weight transformers BertModel
built from a BertConfig, and the WordPiece tokenizer is replaced by a tiny whitespace tokenizer
with the same `tokenize` / `encode` interface (encode adds [CLS]/[SEP] that get_pair_input strips).
"""
import sys

import torch
import torch.nn as nn
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv


class TinyTokenizer:
    """Whitespace stand-in for BertTokenizer: [PAD]=0, [CLS]=1, [SEP]=2, words hashed to 3..99."""

    special = {'[PAD]': 0, '[CLS]': 1, '[SEP]': 2}

    def tokenize(self, text):
        return text.split()

    def encode(self, text):
        ids = [self.special.get(t, 3 + sum(map(ord, t)) % 97) for t in self.tokenize(text)]
        return [1] + ids + [2]


def get_pair_input(tokenizer, sent1, sent2, model_type):
    text = "[CLS] {} [SEP] {} [SEP]".format(sent1, sent2)
    tokenized_text = tokenizer.tokenize(text)
    indexed_tokens = tokenizer.encode(text)[1:-1]
    assert len(tokenized_text) == len(indexed_tokens)
    if len(tokenized_text) > 500:
        return None, None
    segments_ids = []
    sep_flag = False
    for i in range(len(indexed_tokens)):
        if 'bert-' in model_type and tokenized_text[i] == '[SEP]' and not sep_flag:
            segments_ids.append(0)
            sep_flag = True
        elif sep_flag:
            segments_ids.append(1)
        else:
            segments_ids.append(0)
    return indexed_tokens, segments_ids


def build_batch(tokenizer, text_list, model_type):
    token_id_list = []
    segment_list = []
    attention_masks = []
    longest = -1
    for pair in text_list:
        sent1, sent2 = pair
        ids, segs = get_pair_input(tokenizer, sent1, sent2, model_type)
        if ids is None or segs is None:
            continue
        token_id_list.append(ids)
        segment_list.append(segs)
        attention_masks.append([1] * len(ids))
        if len(ids) > longest:
            longest = len(ids)
    if len(token_id_list) == 0:
        return None, None, None
    # padding
    assert len(token_id_list) == len(segment_list)
    for ii in range(len(token_id_list)):
        token_id_list[ii] += [0] * (longest - len(token_id_list[ii]))
        if FIXED:
            attention_masks[ii] += [0] * (longest - len(attention_masks[ii]))
        else:
            attention_masks[ii] += [1] * (longest - len(attention_masks[ii]))
        segment_list[ii] += [1] * (longest - len(segment_list[ii]))
    return token_id_list, segment_list, attention_masks


class BertNLIModel(nn.Module):
    def __init__(self, bert_type='bert-base', label_num=3):
        super().__init__()
        self.bert_type = bert_type
        config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=64)
        config._attn_implementation = "sdpa"
        self.bert = BertModel(config)
        self.tokenizer = TinyTokenizer()
        self.nli_head = nn.Linear(config.hidden_size, label_num)

    def ff(self, sent_pair_list):
        ids, types, masks = build_batch(self.tokenizer, sent_pair_list, self.bert_type)
        if ids is None:
            return None
        ids_tensor = torch.tensor(ids)
        types_tensor = torch.tensor(types)
        masks_tensor = torch.tensor(masks)
        cls_vecs = self.bert(input_ids=ids_tensor, token_type_ids=types_tensor, attention_mask=masks_tensor)[1]
        return self.nli_head(cls_vecs)


def main():
    torch.manual_seed(0)
    model = BertNLIModel().eval()
    pairs = [("a man is playing a guitar on the stage tonight", "a person plays music"),
             ("cats sleep", "animals rest")]
    with torch.no_grad():
        logits = model.ff(pairs)
    print("probs", [[round(p, 4) for p in row] for row in logits.softmax(-1).tolist()])


if __name__ == "__main__":
    main()
