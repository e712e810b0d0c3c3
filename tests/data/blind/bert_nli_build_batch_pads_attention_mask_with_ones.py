"""bert_nli (a BERT cross-encoder for NLI): build_batch padded the attention masks with ones.

Citation: yg211/bert_nli#3 "utils: Fix padding of attention masks" (commit 8b356e7,
utils/utils.py ``build_batch``; the model is bert_nli.py ``BertNLIModel.ff``, trained by train.py).

Each premise / hypothesis pair is written as "[CLS] s1 [SEP] s2 [SEP]", tokenized, and given
segment ids 0 up to the first [SEP] and 1 after it. ``build_batch`` right-pads the ids with 0,
the segment ids with 1 and the attention masks to the longest pair of the batch.

The bug: ``attention_masks[ii] += [1]*(longest-len(attention_masks[ii]))``, so every padded
position was marked as a real token and the [CLS] vector of the shorter pairs (the pooled output
the NLI head reads) attended to the [PAD] slots.
The fix: ``attention_masks[ii] += [0]*(longest-len(attention_masks[ii]))``.

Ported with the project's names and flow at toy sizes: a BertTokenizer over a small vocab written
to a temporary file, a BertModel built from a tiny BertConfig with random weights (instead of
``from_pretrained('bert-base-uncased')``), one training step of train.py and an evaluation pass.
"""

import os
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertModel, BertTokenizer

FIXED = "--fixed" in sys.argv


# ---- utils/utils.py ----------------------------------------------------------------------------
def get_pair_input(tokenizer, sent1, sent2, model_type):
    if 'roberta' in model_type:
        text = "<s> {} </s></s> {} </s>".format(sent1, sent2)
    else:
        text = "[CLS] {} [SEP] {} [SEP]".format(sent1, sent2)

    tokenized_text = tokenizer.tokenize(text)
    indexed_tokens = tokenizer.encode(text)[1:-1]
    assert len(tokenized_text) == len(indexed_tokens)

    if len(tokenized_text) > 500:
        return None, None
    # Define sentence A and B indices associated to 1st and 2nd sentences (see paper)
    segments_ids = []
    sep_flag = False
    for i in range(len(indexed_tokens)):
        if 'roberta' in model_type and tokenized_text[i] == '</s>' and not sep_flag:
            segments_ids.append(0)
            sep_flag = True
        elif 'bert-' in model_type and tokenized_text[i] == '[SEP]' and not sep_flag:
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
        if ids is None or segs is None: continue
        token_id_list.append(ids)
        segment_list.append(segs)
        attention_masks.append([1]*len(ids))
        if len(ids) > longest: longest = len(ids)

    if len(token_id_list) == 0: return None, None, None

    # padding
    assert(len(token_id_list) == len(segment_list))
    for ii in range(len(token_id_list)):
        token_id_list[ii] += [0]*(longest-len(token_id_list[ii]))
        if FIXED:
            attention_masks[ii] += [0]*(longest-len(attention_masks[ii]))
        else:
            attention_masks[ii] += [1]*(longest-len(attention_masks[ii]))
        segment_list[ii] += [1]*(longest-len(segment_list[ii]))

    return token_id_list, segment_list, attention_masks


# ---- bert_nli.py -------------------------------------------------------------------------------
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
         "the", "a", "lecturer", "committed", "plagiarism", "he", "was", "promoted", "fired",
         "man", "is", "playing", "guitar", "on", "stage", "person", "music", "sleeping", "cat",
         "dog", "running", "in", "park", "an", "animal", "outside", "woman", "reading", "book",
         "sitting", "at", "home", ".", ","]


def tiny_bert_tokenizer():
    vocab_dir = tempfile.mkdtemp()
    vocab_file = os.path.join(vocab_dir, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(VOCAB) + "\n")
    return BertTokenizer(vocab=vocab_file, do_lower_case=True)


class BertNLIModel(nn.Module):
    """Performs prediction, given the input of BERT embeddings.
    """
    def __init__(self, model_path=None, gpu=False, bert_type='bert-base', label_num=3, batch_size=8):
        super(BertNLIModel, self).__init__()
        self.bert_type = bert_type

        if 'bert-base' in bert_type:
            # was BertModel.from_pretrained('bert-base-uncased') / BertTokenizer.from_pretrained(...)
            config = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=64,
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                max_position_embeddings=64, type_vocab_size=2,
                                attn_implementation="eager")
            self.bert = BertModel(config)
            self.tokenizer = tiny_bert_tokenizer()
        else:
            print('illegal bert type {}!'.format(bert_type))

        self.num_hidden_layers = self.bert.config.num_hidden_layers
        self.vdim = self.bert.config.hidden_size
        self.nli_head = nn.Linear(self.vdim, label_num)
        self.gpu = gpu
        self.batch_size = batch_size
        self.sm = nn.Softmax(dim=1)

    def forward(self, sent_pair_list, checkpoint=False, bs=None):
        all_probs = None
        if bs is None:
            bs = self.batch_size
        for batch_idx in range(0, len(sent_pair_list), bs):
            probs = self.ff(sent_pair_list[batch_idx:batch_idx+bs], checkpoint)[1].data.cpu().numpy()
            if all_probs is None:
                all_probs = probs
            else:
                all_probs = np.append(all_probs, probs, axis=0)
        labels = []
        for pp in all_probs:
            ll = np.argmax(pp)
            if ll == 0:
                labels.append('contradiction')
            elif ll == 1:
                labels.append('entail')
            else:
                assert ll == 2
                labels.append('neutral')
        return labels, all_probs

    def ff(self, sent_pair_list, checkpoint):
        ids, types, masks = build_batch(self.tokenizer, sent_pair_list, self.bert_type)
        if ids is None: return None
        ids_tensor = torch.tensor(ids)
        types_tensor = torch.tensor(types)
        masks_tensor = torch.tensor(masks)

        cls_vecs = self.bert(input_ids=ids_tensor, token_type_ids=types_tensor, attention_mask=masks_tensor)[1]

        logits = self.nli_head(cls_vecs)
        probs = self.sm(logits)
        return logits, probs


# ---- train.py / test_trained_model.py ----------------------------------------------------------
def train_step(model, optimizer, sent_pairs, labels, checkpoint=False, max_grad_norm=1.0):
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    optimizer.zero_grad()
    logits, _ = model.ff(sent_pairs, checkpoint)
    true_labels = torch.LongTensor(labels)
    loss = loss_fn(logits, true_labels)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


def evaluate(model, sent_pairs, all_labels, checkpoint=False, test_bs=4):
    model.eval()
    with torch.no_grad():
        _, probs = model(sent_pairs, checkpoint, bs=test_bs)
    all_predict = [np.argmax(pp) for pp in probs]
    acc = len([i for i in range(len(all_labels)) if all_predict[i] == all_labels[i]])*1./len(all_labels)
    return acc, probs


def main():
    torch.manual_seed(0)
    model = BertNLIModel(bert_type='bert-base', batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)

    # 0: contradiction, 1: entail, 2: neutral
    train_pairs = [
        ("the lecturer committed plagiarism .", "he was promoted ."),
        ("a man is playing guitar on stage .", "a person is playing music ."),
        ("the cat is sleeping .", "an animal is sleeping in the park outside ."),
        ("a woman is reading a book at home .", "a woman is sitting ."),
    ]
    train_labels = [0, 1, 2, 1]
    loss = train_step(model, optimizer, train_pairs, train_labels)
    print("train loss: {:.6f}".format(loss))

    dev_pairs = [
        ("the dog is running in the park .", "an animal is outside ."),
        ("the lecturer was fired .", "he was promoted ."),
        ("a man is sleeping at home , reading a book .", "a man is playing guitar ."),
        ("a woman is playing guitar .", "a person is playing music on stage ."),
    ]
    dev_labels = [1, 0, 0, 1]
    acc, probs = evaluate(model, dev_pairs, dev_labels)
    print("dev acc: {:.3f}".format(acc))
    for (s1, s2), pp in zip(dev_pairs, probs):
        print("{!r} / {!r}: {}".format(s1, s2, np.round(pp, 6).tolist()))


if __name__ == "__main__":
    main()
