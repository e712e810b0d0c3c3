# Citation: stanfordnlp/stanza commit 766643aa ("bert & roberta attention masks", 2022-07-29).
# Upstream: stanza/models/common/bert_embedding.py, extract_bert_embeddings (used by the NER tagger and
#   the constituency parser to get one transformer vector per word: sum of the last hidden layers, the
#   last word piece of each word picked through tokenized.word_ids()).
# Bug: the batch of sentences was tokenized with padding="longest" but return_attention_mask=False, and
#   the model was called as model(id_tensor, output_hidden_states=True) without an attention_mask, so
#   every word of a shorter sentence attended to the [PAD] pieces of the padded batch (a word's vector
#   depended on the other sentences in its batch).
# Fix: tokenize with return_attention_mask=True and pass attention_mask=torch.tensor(tokenized['attention_mask'])
#   to the model (xlnet kept attention_mask=None).
import math
import sys

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv


class TextTooLongError(ValueError):
    def __init__(self, length, max_len, line_num, text):
        super().__init__("Found a text of length %d (possibly after tokenizing).  Maximum handled length is %d  Error occurred at line %d" % (length, max_len, line_num))
        self.line_num = line_num
        self.text = text


# ---- stand-in for a fast BERT tokenizer (no download): greedy longest-match word pieces ----
class _Encoding(dict):
    def __init__(self, data, word_ids):
        super().__init__(data)
        self._word_ids = word_ids

    def word_ids(self, batch_index=0):
        return self._word_ids[batch_index]


class TinyWordPieceTokenizer:
    pad_token_id = 0
    cls_token_id = 1
    sep_token_id = 2
    unk_token_id = 3
    model_max_length = 64

    def __init__(self, vocab):
        self.vocab = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[UNK]": 3}
        for piece in vocab:
            self.vocab.setdefault(piece, len(self.vocab))

    def _wordpiece(self, word):
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            found = None
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    found = piece
                    break
                end -= 1
            if found is None:
                return [self.unk_token_id]
            pieces.append(self.vocab[found])
            start = end
        return pieces

    def __call__(self, data, padding=False, is_split_into_words=True, return_offsets_mapping=False, return_attention_mask=True):
        all_ids, all_word_ids = [], []
        for sentence in data:
            ids, word_ids = [self.cls_token_id], [None]
            for w_idx, word in enumerate(sentence):
                pieces = self._wordpiece(word)
                ids.extend(pieces)
                word_ids.extend([w_idx] * len(pieces))
            ids.append(self.sep_token_id)
            word_ids.append(None)
            all_ids.append(ids)
            all_word_ids.append(word_ids)
        out = {}
        if padding == "longest":
            max_len = max(len(x) for x in all_ids)
            masks = [[1] * len(x) + [0] * (max_len - len(x)) for x in all_ids]
            all_word_ids = [w + [None] * (max_len - len(w)) for w in all_word_ids]
            all_ids = [x + [self.pad_token_id] * (max_len - len(x)) for x in all_ids]
        else:
            masks = [[1] * len(x) for x in all_ids]
        out["input_ids"] = all_ids
        out["token_type_ids"] = [[0] * len(x) for x in all_ids]
        if return_attention_mask:
            out["attention_mask"] = masks
        return _Encoding(out, all_word_ids)


BAD_TOKENIZERS = ('bert-base-german-cased', 'dbmdz/bert-base-german-cased', 'google/muril-base-cased', 'l3cube-pune/marathi-roberta')


def extract_bert_embeddings(model_name, tokenizer, model, data, device, keep_endpoints):
    """
    Extract transformer embeddings using a generic roberta extraction
    data: list of list of string (the text tokens)
    """
    is_xlnet = model_name.startswith("xlnet")
    if isinstance(data, tuple):
        data = list(data)
    if FIXED:
        tokenized = tokenizer(data, padding="longest", is_split_into_words=True, return_offsets_mapping=False, return_attention_mask=True)
    else:
        tokenized = tokenizer(data, padding="longest", is_split_into_words=True, return_offsets_mapping=False, return_attention_mask=False)
    list_offsets = [[None] * (len(sentence)+2) for sentence in data]
    for idx in range(len(data)):
        offsets = tokenized.word_ids(batch_index=idx)
        for pos, offset in enumerate(offsets):
            if offset is None:
                continue
            # this uses the last token piece for any offset by overwriting the previous value
            if is_xlnet:
                if offset == 0 and list_offsets[idx][offset+1] is None:
                    list_offsets[idx][offset] = pos
                list_offsets[idx][offset+1] = pos + 1
            else:
                list_offsets[idx][offset+1] = pos
        list_offsets[idx][-1] = list_offsets[idx][-2] + 1
        if not is_xlnet:
            list_offsets[idx][0] = 0
        if any(x is None for x in list_offsets[idx]):
            raise ValueError("OOPS, hit None when preparing to use Bert")

        if len(offsets) > tokenizer.model_max_length - 2:
            raise TextTooLongError(len(offsets), tokenizer.model_max_length, idx, " ".join(data[idx]))

    features = []
    for i in range(int(math.ceil(len(data)/128))):
        with torch.no_grad():
            if is_xlnet:
                input_ids = [[tokenizer.pad_token_id] + x for x in tokenized['input_ids'][128*i:128*i+128]]
                attention_mask = None
            else:
                input_ids = tokenized['input_ids'][128*i:128*i+128]
                if FIXED:
                    attention_mask = torch.tensor(tokenized['attention_mask'][128*i:128*i+128], device=device)
            id_tensor = torch.tensor(input_ids, device=device)
            if FIXED:
                feature = model(id_tensor, attention_mask=attention_mask, output_hidden_states=True)
            else:
                feature = model(id_tensor, output_hidden_states=True)
            feature = feature.hidden_states
            feature = torch.stack(feature[-4:-1], axis=3).sum(axis=3) / 4
            features += feature.clone().detach()

    processed = []
    if not keep_endpoints:
        # remove the bos and eos tokens
        list_offsets = [sent[1:-1] for sent in list_offsets]
    for feature, offsets in zip(features, list_offsets):
        new_sent = feature[offsets]
        processed.append(new_sent)

    return processed


def main():
    torch.manual_seed(0)
    vocab = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "home", "quick", "##ly", "brown", "fox",
             "jump", "##ed", "over", "lazy", "##s", "play", "##ing", "in", "park", "."]
    tokenizer = TinyWordPieceTokenizer(vocab)
    config = BertConfig(vocab_size=len(tokenizer.vocab), hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, initializer_range=0.2)
    model = BertModel(config)
    model.eval()

    data = [
        ["the", "quick", "brown", "fox", "jumped", "over", "the", "lazy", "dogs", "playing", "in", "the", "park", "."],
        ["the", "cat", "sat", "."],
        ["a", "dog", "ran", "home", "quickly", "."],
    ]
    processed = extract_bert_embeddings("bert-base-cased", tokenizer, model, data, "cpu", keep_endpoints=False)

    # a small tagging head on top of the word vectors, as the NER / POS heads use them
    torch.manual_seed(1)
    tagger = torch.nn.Linear(config.hidden_size, 4)
    tags = [torch.randint(0, 4, (len(s),)) for s in data]
    with torch.no_grad():
        loss = sum(F.cross_entropy(tagger(p), t) for p, t in zip(processed, tags)) / len(data)
    print("word vectors per sentence:", [tuple(p.shape) for p in processed])
    print("sentence 1, word 0, first 4 dims:", [round(v, 4) for v in processed[1][0, :4].tolist()])
    print("sentence 2, word 4, first 4 dims:", [round(v, 4) for v in processed[2][4, :4].tolist()])
    print("tagger loss: %.6f" % loss.item())


if __name__ == "__main__":
    main()
